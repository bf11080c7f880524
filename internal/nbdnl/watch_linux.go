package nbdnl

import (
	"context"
	"fmt"
	"time"

	"github.com/mdlayher/genetlink"

	"github.com/mountplan/mountplan/internal/errdefs"
)

const (
	cmdLinkDead = 4              // NBD_CMD_LINK_DEAD, multicast only
	groupName   = "nbd_mc_group" // NBD_GENL_MCAST_GROUP_NAME
)

// Watcher receives the kernel's NBD_CMD_LINK_DEAD notices: a connection
// of a device failed and, with a dead-connection timeout, its requests
// now wait for a Reconfigure. Reconfigure is only useful after this
// notice (the kernel drops a socket it has no dead place for), so watch
// first, then expect the failure. Listening needs no privilege.
type Watcher struct {
	c *genetlink.Conn
}

// WatchLinkDead subscribes to the notices.
func WatchLinkDead() (*Watcher, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: opening a generic netlink socket: %w: %w", err, errdefs.ErrUnavailable)
	}
	if err := join(c); err != nil {
		c.Close()
		return nil, err
	}
	return &Watcher{c: c}, nil
}

func join(c *genetlink.Conn) error {
	fam, err := family(c)
	if err != nil {
		return err
	}
	for _, g := range fam.Groups {
		if g.Name == groupName {
			if err := c.JoinGroup(g.ID); err != nil {
				return fmt.Errorf("nbdnl: joining %s: %w: %w", groupName, err, errdefs.ErrUnavailable)
			}
			return nil
		}
	}
	return fmt.Errorf("nbdnl: the kernel's nbd family has no group %s: %w", groupName, errdefs.ErrUnimplemented)
}

// Next returns the index of the next device whose connection died, or
// ctx's error.
func (w *Watcher) Next(ctx context.Context) (int, error) {
	stop := context.AfterFunc(ctx, func() { _ = w.c.SetReadDeadline(time.Now()) })
	defer stop()
	for {
		msgs, _, err := w.c.Receive()
		if ctx.Err() != nil {
			return -1, fmt.Errorf("nbdnl: waiting for a dead link: %w", context.Cause(ctx))
		}
		if err != nil {
			return -1, fmt.Errorf("nbdnl: waiting for a dead link: %w: %w", err, errdefs.ErrUnavailable)
		}
		for _, m := range msgs {
			if m.Header.Command != cmdLinkDead {
				continue
			}
			if i, err := replyIndex([]genetlink.Message{m}); err == nil {
				return i, nil
			}
		}
	}
}

// Close ends the subscription.
func (w *Watcher) Close() error { return w.c.Close() }
