package service

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/unixrpc"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Client is the plugin's mounter: every call goes to the mounter's socket.
type Client struct {
	c *unixrpc.Client
}

var _ mounter.Node = (*Client)(nil)

// NewClient returns a client of the mounter serving at socket path.
// Nothing is dialed before the first call.
func NewClient(path string) *Client { return &Client{c: unixrpc.NewClient(path)} }

// OnRestart runs fn whenever the mounter answers from a new process: the
// loop devices nothing mounted were cleared with the old one's descriptors
// (unless it took them back), so the plugin reconciles.
func (c *Client) OnRestart(fn func()) { c.c.OnRestart(fn) }

// Close closes idle connections.
func (c *Client) Close() error { return c.c.Close() }

func call[Req, Resp any](ctx context.Context, c *Client, method string, req Req, files ...*os.File) (Resp, error) {
	out, err := unixrpc.Call[Req, Resp](ctx, c.c, method, req, files...)
	if err != nil {
		return out, fmt.Errorf("mounter: %w", err)
	}
	return out, nil
}

func do[Req any](ctx context.Context, c *Client, method string, req Req, files ...*os.File) error {
	_, err := call[Req, empty](ctx, c, method, req, files...)
	return err
}

func (c *Client) Mount(ctx context.Context, mounts []plan.Mount, consumer plan.Consumer) error {
	return do(ctx, c, "Mount", planReq{Mounts: mounts, Consumer: consumer})
}

func (c *Client) Unmount(ctx context.Context, mounts []plan.Mount, consumer plan.Consumer) error {
	return do(ctx, c, "Unmount", planReq{Mounts: mounts, Consumer: consumer})
}

func (c *Client) HealFuse(ctx context.Context, h plan.Heal) (plan.HealResult, error) {
	return call[plan.Heal, plan.HealResult](ctx, c, "HealFuse", h)
}

func (c *Client) AttachLoop(ctx context.Context, req mounter.LoopRequest) (mounter.Loop, error) {
	return call[mounter.LoopRequest, mounter.Loop](ctx, c, "AttachLoop", req)
}

func (c *Client) AdoptLoop(ctx context.Context, id loopdev.Identity) (mounter.Loop, error) {
	return call[loopdev.Identity, mounter.Loop](ctx, c, "AdoptLoop", id)
}

func (c *Client) DetachLoop(ctx context.Context, id loopdev.Identity) error {
	return do(ctx, c, "DetachLoop", id)
}

func (c *Client) ResizeLoop(ctx context.Context, id loopdev.Identity) (int64, error) {
	r, err := call[loopdev.Identity, sizeResp](ctx, c, "ResizeLoop", id)
	return r.Size, err
}

func (c *Client) KeepLoops(ctx context.Context, ids []loopdev.Identity, before time.Time) (int, error) {
	r, err := call[keepReq, countResp](ctx, c, "KeepLoops", keepReq{IDs: ids, Before: before})
	return r.N, err
}

func (c *Client) Detect(ctx context.Context, d mounter.Device) (string, error) {
	r, err := call[fsReq, fsTypeResp](ctx, c, "Detect", fsReq{Device: d})
	return r.FsType, err
}

func (c *Client) Format(ctx context.Context, d mounter.Device, fsType string) error {
	return do(ctx, c, "Format", fsReq{Device: d, FsType: fsType})
}

func (c *Client) GrowFS(ctx context.Context, d mounter.Device, fsType string, unused bool) error {
	return do(ctx, c, "GrowFS", fsReq{Device: d, FsType: fsType, Unused: unused})
}

func (c *Client) Freeze(ctx context.Context, d mounter.Device, fsType string) error {
	return do(ctx, c, "Freeze", fsReq{Device: d, FsType: fsType})
}

func (c *Client) Thaw(ctx context.Context, d mounter.Device, fsType string) error {
	return do(ctx, c, "Thaw", fsReq{Device: d, FsType: fsType})
}

func (c *Client) ApplyGroup(ctx context.Context, mounts []plan.Mount, gid uint32) error {
	return do(ctx, c, "ApplyGroup", groupReq{Mounts: mounts, GID: gid})
}

func (c *Client) ReplayLog(ctx context.Context, image string, blockSize uint32) error {
	return do(ctx, c, "ReplayLog", imageReq{Image: image, BlockSize: blockSize})
}

func (c *Client) BuildChain(ctx context.Context, req mounter.ChainRequest) (mounter.Chain, error) {
	return call[mounter.ChainRequest, mounter.Chain](ctx, c, "BuildChain", req)
}

func (c *Client) TeardownChain(ctx context.Context, volumeID string) error {
	return do(ctx, c, "TeardownChain", volumeReq{VolumeID: volumeID})
}

func (c *Client) IdentifyNamespace(ctx context.Context, pid int) (plan.Namespace, error) {
	return call[pidReq, plan.Namespace](ctx, c, "IdentifyNamespace", pidReq{PID: pid})
}

// maxPerCall keeps a LiveNamespaces request within the mounter's bound.
const maxPerCall = 1024

func (c *Client) LiveNamespaces(ctx context.Context, cs []plan.Consumer) ([]bool, error) {
	out := make([]bool, 0, len(cs))
	for start := 0; start < len(cs); start += maxPerCall {
		r, err := call[consumersReq, aliveResp](ctx, c, "LiveNamespaces", consumersReq{Consumers: cs[start:min(start+maxPerCall, len(cs))]})
		if err != nil {
			return nil, err
		}
		out = append(out, r.Alive...)
	}
	if len(out) != len(cs) {
		return nil, fmt.Errorf("mounter: %d answers for %d namespaces: %w", len(out), len(cs), errdefs.ErrUnavailable)
	}
	return out, nil
}

// Ping asks the mounter for an answer and nothing else: LiveNamespaces of
// no consumer, which looks at nothing (no new call for a health check: a
// mounter one version older answers it too). Its error is the transport's
// (ErrUnavailable: nobody serves the socket) or ctx's.
func (c *Client) Ping(ctx context.Context) error {
	_, err := call[consumersReq, aliveResp](ctx, c, "LiveNamespaces", consumersReq{})
	return err
}

var _ mounter.Pinger = (*Client)(nil)

func (c *Client) StatFS(ctx context.Context, consumer plan.Consumer) (fsutil.Usage, error) {
	return call[plan.Consumer, fsutil.Usage](ctx, c, "StatFS", consumer)
}

func (c *Client) StatDevice(ctx context.Context, d mounter.Device, readOnly bool) (fsutil.Usage, error) {
	return call[fsReq, fsutil.Usage](ctx, c, "StatDevice", fsReq{Device: d, ReadOnly: readOnly})
}

func (c *Client) MakeDeviceNode(ctx context.Context, target string, d mounter.Device) (bool, error) {
	r, err := call[volumeReq, createdResp](ctx, c, "MakeDeviceNode", volumeReq{Target: target, Device: d})
	return r.Created, err
}

func (c *Client) MakeTarget(ctx context.Context, p string, block bool) (bool, error) {
	r, err := call[targetReq, createdResp](ctx, c, "MakeTarget", targetReq{Path: p, Block: block})
	return r.Created, err
}

func (c *Client) TargetState(ctx context.Context, p string) (mounter.Target, error) {
	return call[targetReq, mounter.Target](ctx, c, "TargetState", targetReq{Path: p})
}

func (c *Client) RemoveTarget(ctx context.Context, p string) error {
	return do(ctx, c, "RemoveTarget", targetReq{Path: p})
}

func (c *Client) StatTarget(ctx context.Context, p string) (fsutil.Usage, error) {
	return call[targetReq, fsutil.Usage](ctx, c, "StatTarget", targetReq{Path: p})
}

func (c *Client) StartDaemon(ctx context.Context, req mounter.DaemonRequest) (mounter.DaemonInfo, error) {
	return call[mounter.DaemonRequest, mounter.DaemonInfo](ctx, c, "StartDaemon", req)
}

func (c *Client) WaitDaemon(ctx context.Context, p daemon.Proc) error {
	return do(ctx, c, "WaitDaemon", daemonReq{Proc: p})
}

func (c *Client) DaemonStatus(ctx context.Context, p daemon.Proc, conn uint64) (mounter.DaemonStatus, error) {
	return call[daemonReq, mounter.DaemonStatus](ctx, c, "DaemonStatus", daemonReq{Proc: p, Conn: conn})
}

func (c *Client) StopDaemons(ctx context.Context, volumeID string, known []daemon.Proc, teardown bool) error {
	return do(ctx, c, "StopDaemons", volumeReq{VolumeID: volumeID, Known: known, Teardown: teardown})
}

// DaemonUsage asks the mounter what each volume's daemon uses (a metrics
// scrape).
func (c *Client) DaemonUsage(ctx context.Context) ([]mounter.DaemonUsage, error) {
	r, err := call[empty, usageResp](ctx, c, "DaemonUsage", empty{})
	return r.Usage, err
}

// ConnectNBD passes sock to the mounter as a descriptor (SCM_RIGHTS); the
// caller keeps its own and may close it once the call returns.
func (c *Client) ConnectNBD(ctx context.Context, req mounter.NBDRequest, sock *os.File) (mounter.Device, error) {
	return call[nbdReq, mounter.Device](ctx, c, "ConnectNBD", nbdReq{Request: req}, present(sock)...)
}

func (c *Client) ReconnectNBD(ctx context.Context, d mounter.Device, backend string, sock *os.File) error {
	return do(ctx, c, "ReconnectNBD", nbdReq{Device: d, Backend: backend}, present(sock)...)
}

// present is f as the descriptors of a call: none for nil (the mounter
// then refuses the call for want of one).
func present(f *os.File) []*os.File {
	if f == nil {
		return nil
	}
	return []*os.File{f}
}

func (c *Client) DisconnectNBD(ctx context.Context, d mounter.Device, backend string) error {
	return do(ctx, c, "DisconnectNBD", nbdReq{Device: d, Backend: backend})
}

func (c *Client) LoginISCSI(ctx context.Context, l mounter.ISCSILogin) (mounter.ISCSISession, error) {
	return call[mounter.ISCSILogin, mounter.ISCSISession](ctx, c, "LoginISCSI", l)
}

func (c *Client) LogoutISCSI(ctx context.Context, l mounter.ISCSILogout) error {
	return do(ctx, c, "LogoutISCSI", l)
}
