package nbd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/nbdnl"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/internal/blockdev"
)

// kernelReady fails with ErrFailedPrecondition, naming the module, when
// the kernel has no NBD driver: before any handshake or intent.
func (s *Source) kernelReady() error {
	if _, err := os.Stat(filepath.Join(s.SysDir, "module", "nbd")); err != nil {
		return fmt.Errorf("this node's kernel has no NBD support (%s/module/nbd is missing): load the kernel module nbd (modprobe nbd) on the node: %w",
			s.SysDir, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// backendAt reads the backend the kernel shows for device index ("" for
// none: not connected).
func (s *Source) backendAt(index int) string {
	if index < 0 {
		return ""
	}
	b, err := os.ReadFile(filepath.Join(s.SysDir, "block", fmt.Sprintf("nbd%d", index), "backend"))
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(b), "\n")
}

// shows reports whether the kernel shows st's device connected with st's
// backend: the connection this volume's stage made, and no other (a
// device number is soon reused once disconnected).
func (s *Source) shows(st State) bool {
	return st.Backend != "" && st.Index >= 0 && st.Device == fmt.Sprintf("/dev/nbd%d", st.Index) && s.backendAt(st.Index) == st.Backend
}

// blockSize is the device's logical block size for tr: the server's
// preferred one when the kernel can use it (a power of two from 512 to
// the page size, which Negotiate checked for the power) and it divides
// the size; else 4096 when that does, else 512.
func blockSize(tr *Transmission) uint64 {
	size := uint64(tr.Export.Size)
	if bs := uint64(tr.BlockSize); bs >= 512 && bs <= uint64(os.Getpagesize()) && size%bs == 0 && uint64(tr.MinBlockSize) <= bs {
		return bs
	}
	if size%4096 == 0 {
		return 4096
	}
	return 512
}

// connect negotiates t's export, records the intent (the backend, chosen
// now, so that an undo after a crash finds the device by it) and has the
// mounter hand the socket to the kernel. A plain socket's copy here is
// closed then; a TLS volume's proxy stays with the volume's link, which
// watches for the connection's death from now on.
func (s *Source) connect(ctx context.Context, id string, t target, readOnly bool, rec source.Recorder) (State, error) {
	if err := s.kernelReady(); err != nil {
		return State{}, err
	}
	backend, err := mounter.NewNBDBackend(id)
	if err != nil {
		return State{}, err
	}
	d, err := s.dialer(t, s.timeout())
	if err != nil {
		return State{}, err
	}
	tr, err := d.Negotiate(ctx, t.export)
	if err != nil {
		return State{}, err
	}
	if tr.Export.ReadOnly && !readOnly {
		tr.Close()
		return State{}, fmt.Errorf("%s is read-only; stage it with a read-only access mode: %w", t, errdefs.ErrFailedPrecondition)
	}
	st := State{Index: -1, Pending: true, Backend: backend, Server: t.server, Export: t.export, Size: tr.Export.Size,
		BlockSize: blockSize(tr), TLS: t.tls, ReadOnly: readOnly}
	if err := source.SaveState(rec, st); err != nil {
		tr.Close()
		return State{}, err
	}
	flags := uint64(tr.Flags)
	if readOnly {
		flags |= nbdnl.FlagReadOnly
	}
	req := mounter.NBDRequest{SizeBytes: uint64(tr.Export.Size), BlockSize: st.BlockSize, ServerFlags: flags,
		Timeout: s.timeout(), DeadConnTimeout: s.deadConnTimeout(), Backend: backend}
	var dev mounter.Device
	err = s.Metrics.Step("nbd_connect", func() error {
		var err error
		dev, err = s.Devices.ConnectNBD(ctx, req, tr.Socket)
		return err
	})
	_ = tr.Socket.Close() // the kernel holds its own reference (the proxy runs on)
	if err == nil {
		st.Index, err = indexOf(dev.Path)
	}
	if err != nil {
		tr.Close()
		// The mounter may have connected the device before the call failed
		// (the caller's deadline): undo by the backend.
		if derr := s.Devices.DisconnectNBD(context.WithoutCancel(ctx), mounter.Device{}, backend); derr != nil {
			klog.FromContext(ctx).Error(derr, "Undoing a failed NBD connect", "backend", backend)
		}
		return State{}, fmt.Errorf("connect %s: %w", t, err)
	}
	if !tr.Proxied() {
		tr.Close()
		tr = nil
	}
	st.Device, st.Pending = dev.Path, false
	l := s.addLink(id, t, st, dev)
	if tr != nil {
		l.addProxy(tr)
	}
	klog.FromContext(ctx).V(2).Info("NBD device connected", "device", st.Device, "backend", backend, "server", t.server, "export", t.export,
		"size", st.Size, "blockSize", st.BlockSize, "tls", t.tls)
	return st, source.SaveState(rec, st)
}

// indexOf is N of /dev/nbdN.
func indexOf(dev string) (int, error) {
	var i int
	if _, err := fmt.Sscanf(dev, "/dev/nbd%d", &i); err != nil || i < 0 || dev != fmt.Sprintf("/dev/nbd%d", i) {
		return -1, fmt.Errorf("the mounter connected %q, which is not /dev/nbdN: %w", dev, errdefs.ErrUnavailable)
	}
	return i, nil
}

// disconnect stops the volume's reconnects, has the mounter disconnect
// the device connected with st's backend (found by the backend alone when
// the stage recorded only its intent) and stops the volume's proxy.
func (s *Source) disconnect(ctx context.Context, id string, st State) error {
	l := s.takeLink(id)
	defer l.close()
	var dev mounter.Device
	if s.shows(st) {
		d, err := blockdev.DeviceOf(s.SysDir, st.Device)
		if err == nil {
			dev = d
		}
	}
	err := s.Metrics.Step("nbd_disconnect", func() error { return s.Devices.DisconnectNBD(ctx, dev, st.Backend) })
	if err != nil {
		return fmt.Errorf("disconnect %s (backend %s): %w", st.Device, st.Backend, err)
	}
	if st.Index >= 0 && s.backendAt(st.Index) == st.Backend {
		klog.FromContext(ctx).Info("NBD device disconnected; the kernel lets it go once nothing holds it open", "device", st.Device)
	}
	return nil
}

// errGone: the kernel no longer shows the volume's device with its
// backend; there is no connection to replace (Adopt connects afresh).
var errGone = errors.New("the device is no longer connected with the volume's backend")
