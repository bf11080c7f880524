// Package peer tells whether a caller of the mounter's socket is the
// plugin: a process in the plugin container's mount namespace. Any
// process of the plugin's uid (root) could otherwise reach the socket and
// be served as the plugin is (review of b705b24, finding F8): a node's
// monitoring agent with a read-only view of the host, a container that
// mounts the directory. The plugin is told apart by what the kernel says of
// it: the process that listens on the plugin's CSI socket (SO_PEERCRED of a
// connection to it), whose mount namespace a caller must share.
package peer

import (
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/unixrpc"
	"github.com/mountplan/mountplan/pkg/plan"
)

// relearnEvery bounds how often a caller that does not match has the
// plugin's namespace looked up again (the plugin restarted in a new
// container): one dial of its socket a second at most, whoever knocks.
const relearnEvery = time.Second

// Plugin admits the processes of the plugin's mount namespace.
type Plugin struct {
	socket string // the plugin's CSI socket, as this process sees it
	// Own, when set, admits the callers in this process's own mount
	// namespace besides the plugin's: in the chart's mounter container,
	// serve itself, the tools it starts and kubelet's exec probe
	// (mountplan-sidecar probe). The server checks their uid first, and
	// uid 0 there is root in a privileged container, which can do all the
	// socket does without it. Set before the first Allow.
	Own bool

	mu      sync.Mutex
	ns      plan.Namespace // zero until learned
	learned time.Time
	now     func() time.Time
}

// NewPlugin checks callers against the process that listens on socket.
func NewPlugin(socket string) *Plugin {
	return &Plugin{socket: socket, now: time.Now}
}

// Allow accepts pid when it is in the plugin's mount namespace, learning
// that namespace at the first call and again, at most once a second, when
// pid is not in the one learned. A plugin whose socket does not answer
// admits no one: its callers retry.
func (p *Plugin) Allow(pid int) error {
	got, err := mountns.IdentityOf(pid)
	if err != nil {
		return fmt.Errorf("caller pid %d: %w", pid, err)
	}
	if p.Own {
		if own, err := mountns.IdentityOf(os.Getpid()); err == nil && own == got {
			return nil
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ns != (plan.Namespace{}) && p.ns == got {
		return nil
	}
	if p.ns == (plan.Namespace{}) || p.now().Sub(p.learned) >= relearnEvery {
		if err := p.learn(); err != nil {
			return err
		}
		if p.ns == got {
			return nil
		}
	}
	return fmt.Errorf("caller pid %d is in mount namespace %s, not the plugin's (%s, of the process serving %s): "+
		"the mounter serves the plugin only: %w", pid, got, p.ns, p.socket, errdefs.ErrPermissionDenied)
}

func (p *Plugin) learn() error {
	p.learned = p.now()
	pid, err := unixrpc.ListenerPID(p.socket)
	if err != nil {
		return fmt.Errorf("who serves the plugin's socket %s: %w: %w", p.socket, err, errdefs.ErrUnavailable)
	}
	ns, err := mountns.IdentityOf(pid)
	if err != nil {
		return fmt.Errorf("the plugin's process %d (serving %s): %w", pid, p.socket, err)
	}
	p.ns = ns
	return nil
}
