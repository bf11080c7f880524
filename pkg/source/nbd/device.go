package nbd

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/toolrun"
)

// kernelReady fails with ErrFailedPrecondition, naming the module, when
// the kernel has no NBD driver.
func (s *Source) kernelReady() error {
	if _, err := os.Stat(filepath.Join(s.SysDir, "module", "nbd")); err != nil {
		return fmt.Errorf("this node's kernel has no NBD support (%s/module/nbd is missing): load the kernel module nbd (modprobe nbd) on the node: %w",
			s.SysDir, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// devices lists the kernel's NBD devices by name ("nbd0"), in number order.
func (s *Source) devices() ([]string, error) {
	matches, err := filepath.Glob(filepath.Join(s.SysDir, "block", "nbd*"))
	if err != nil {
		return nil, err
	}
	var names []string
	for _, m := range matches {
		n := filepath.Base(m)
		if _, err := strconv.Atoi(strings.TrimPrefix(n, "nbd")); err == nil {
			names = append(names, n)
		}
	}
	num := func(n string) int { i, _ := strconv.Atoi(strings.TrimPrefix(n, "nbd")); return i }
	slices.SortFunc(names, func(a, b string) int { return num(a) - num(b) })
	return names, nil
}

// claimFree returns a device that is neither connected nor claimed by a
// stage in progress, and the function that releases the claim.
func (s *Source) claimFree() (string, func(), error) {
	names, err := s.devices()
	if err != nil {
		return "", nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, n := range names {
		dev := filepath.Join(s.DevDir, n)
		if s.claimed[dev] {
			continue
		}
		if pid, err := s.devicePID(dev); err != nil || pid != 0 {
			continue
		}
		if _, err := os.Stat(dev); err != nil {
			continue
		}
		s.claimed[dev] = true
		return dev, func() { s.mu.Lock(); delete(s.claimed, dev); s.mu.Unlock() }, nil
	}
	return "", nil, fmt.Errorf("all %d NBD devices are connected (raise the nbd module's nbds_max): %w", len(names), errdefs.ErrResourceExhausted)
}

// devicePID reads /sys/block/nbdN/pid: the PID of the process that
// connected the device, or 0 when it is not connected.
func (s *Source) devicePID(dev string) (int, error) {
	b, err := os.ReadFile(filepath.Join(s.SysDir, "block", filepath.Base(dev), "pid"))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0, fmt.Errorf("%s: bad pid %q", dev, b)
	}
	return pid, nil
}

// deviceSize reads the device's size in bytes.
func (s *Source) deviceSize(dev string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(s.SysDir, "block", filepath.Base(dev), "size"))
	if err != nil {
		return 0, err
	}
	sectors, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return sectors * 512, err
}

// owns reports whether st's device is still the connection stage made: the
// pid the kernel recorded then. A connect that was only intended (a crash
// in stage) is recognised by the export's size instead.
func (s *Source) owns(st State) (bool, error) {
	pid, err := s.devicePID(st.Device)
	if err != nil || pid == 0 {
		return false, err
	}
	if !st.Pending {
		return pid == st.PID, nil
	}
	size, err := s.deviceSize(st.Device)
	return err == nil && st.Size > 0 && size == st.Size, err
}

// runConnect runs nbd-client for t on dev. (With TLS nbd-client leaves a
// proxy process behind; toolrun does not wait for it.)
func (s *Source) runConnect(ctx context.Context, t target, dev string, exp Export, readOnly bool) error {
	ctx, cancel := context.WithTimeout(ctx, s.timeout())
	defer cancel()
	args, err := s.connectArgs(t, dev, exp, readOnly)
	if err != nil {
		return err
	}
	out, err := s.run(ctx, args...)
	if err != nil {
		return fmt.Errorf("connect %s to %s: %w", dev, t, err)
	}
	klog.FromContext(ctx).V(2).Info("NBD device connected", "device", dev, "server", t.server, "export", t.export, "output", out)
	return nil
}

func (s *Source) connectArgs(t target, dev string, exp Export, readOnly bool) ([]string, error) {
	var args []string
	if strings.HasPrefix(t.server, "/") {
		args = []string{"-unix", t.server, dev}
	} else {
		host, port, err := splitHostPort(t.server)
		if err != nil {
			return nil, err
		}
		args = []string{host, strconv.Itoa(port), dev}
	}
	bs := "512"
	if exp.Known && exp.Size%4096 == 0 {
		bs = "4096"
	}
	args = append(args, "-N", t.export, "-b", bs, "-t", strconv.Itoa(int(s.timeout()/time.Second)))
	if readOnly {
		args = append(args, "-readonly")
	}
	if t.tls {
		c := s.Config.TLS
		if c == nil {
			return nil, fmt.Errorf("TLS asked for but the admin config has no nbd.tls: %w", errdefs.ErrFailedPrecondition)
		}
		host, _, _ := splitHostPort(t.server)
		args = append(args, "-cacertfile", c.CAFile, "-tlshostname", host)
		if c.CertFile != "" {
			args = append(args, "-certfile", c.CertFile, "-keyfile", c.KeyFile)
		}
	}
	return args, nil
}

// nbdClient connects devices; from PATH.
var nbdClient = toolrun.Tool{Name: "nbd-client", Package: "nbd-client"}

// run runs nbd-client with args and returns its output. A failure that is
// neither a missing program nor the end of ctx is the server's or the
// network's: ErrUnavailable.
func (s *Source) run(ctx context.Context, args ...string) (string, error) {
	out, err := s.runner.Run(ctx, nbdClient, args)
	if err != nil && ctx.Err() == nil && !errors.Is(err, errdefs.ErrFailedPrecondition) {
		return out, fmt.Errorf("%w: %w", err, errdefs.ErrUnavailable)
	}
	return out, err
}

// disconnect disconnects st's device if it is still ours and waits until
// the kernel has let it go.
func (s *Source) disconnect(ctx context.Context, st State) error {
	ours, err := s.owns(st)
	if err != nil {
		return fmt.Errorf("checking %s: %w", st.Device, err)
	}
	if !ours {
		klog.FromContext(ctx).V(2).Info("NBD device not connected to this volume any more; nothing to disconnect", "device", st.Device)
		return nil
	}
	return s.Metrics.Step("nbd_disconnect", func() error {
		dctx, cancel := context.WithTimeout(ctx, s.timeout())
		defer cancel()
		if _, err := s.run(dctx, "-d", st.Device); err != nil {
			return fmt.Errorf("disconnect %s: %w", st.Device, err)
		}
		for {
			if pid, err := s.devicePID(st.Device); err == nil && pid == 0 {
				return nil
			}
			select {
			case <-dctx.Done():
				return fmt.Errorf("%s still connected after nbd-client -d: %w", st.Device, dctx.Err())
			case <-time.After(20 * time.Millisecond):
			}
		}
	})
}
