// Package service puts a mounter.Node on a unix socket (mountplan-sidecar
// serve) and gives the plugin a client that implements mounter.Node over
// it: every privileged act of the plugin is one typed call here. Calls
// travel through internal/unixrpc (a JSON request and answer per call, file
// descriptors by SCM_RIGHTS); errors keep their errdefs sentinels across
// the socket, so errors.Is works on the client as in process.
package service

import (
	"context"
	"net"
	"os"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/unixrpc"
	"github.com/mountplan/mountplan/pkg/plan"
)

// The requests and answers of the calls that take or give more than one
// value of the mounter package's own types.
type (
	planReq struct {
		Mounts   []plan.Mount  `json:"mounts"`
		Consumer plan.Consumer `json:"consumer"`
	}
	keepReq struct {
		IDs    []loopdev.Identity `json:"ids"`
		Before time.Time          `json:"before"`
	}
	countResp struct {
		N int `json:"n"`
	}
	sizeResp struct {
		Size int64 `json:"size"`
	}
	fsReq struct {
		Device mounter.Device `json:"device"`
		FsType string         `json:"fsType,omitempty"`
		Unused bool           `json:"unused,omitempty"`
		// ReadOnly: StatDevice mounts the filesystem read-only.
		ReadOnly bool `json:"readOnly,omitempty"`
	}
	fsTypeResp struct {
		FsType string `json:"fsType"`
	}
	groupReq struct {
		Mounts []plan.Mount `json:"mounts"`
		GID    uint32       `json:"gid"`
	}
	imageReq struct {
		Image     string `json:"image"`
		BlockSize uint32 `json:"blockSize,omitempty"`
	}
	volumeReq struct {
		VolumeID string         `json:"volumeID"`
		Known    []daemon.Proc  `json:"known,omitempty"`
		Teardown bool           `json:"teardown,omitempty"`
		Device   mounter.Device `json:"device,omitempty"`
		Target   string         `json:"target,omitempty"`
	}
	targetReq struct {
		Path  string `json:"path"`
		Block bool   `json:"block,omitempty"`
	}
	pidReq struct {
		PID int `json:"pid"`
	}
	consumersReq struct {
		Consumers []plan.Consumer `json:"consumers"`
	}
	aliveResp struct {
		Alive []bool `json:"alive"`
	}
	createdResp struct {
		Created bool `json:"created"`
	}
	usageResp struct {
		Usage []mounter.DaemonUsage `json:"usage"`
	}
	daemonReq struct {
		Proc daemon.Proc `json:"proc"`
		Conn uint64      `json:"conn,omitempty"`
	}
	nbdReq struct {
		Request mounter.NBDRequest `json:"request"`
		Device  mounter.Device     `json:"device"`
		Backend string             `json:"backend"`
	}
	empty struct{}
)

// Serve serves n on l until ctx ends, then lets calls in flight see their
// context cancelled and returns.
func Serve(ctx context.Context, l net.Listener, n mounter.Node) error {
	return NewServer(klog.FromContext(ctx), n).Serve(ctx, l)
}

// NewServer registers every call of n.
func NewServer(logger klog.Logger, n mounter.Node) *unixrpc.Server {
	s := unixrpc.NewServer(logger)
	handle(s, "Mount", func(ctx context.Context, r planReq, _ []*os.File) (empty, error) {
		return empty{}, n.Mount(ctx, r.Mounts, r.Consumer)
	})
	handle(s, "Unmount", func(ctx context.Context, r planReq, _ []*os.File) (empty, error) {
		return empty{}, n.Unmount(ctx, r.Mounts, r.Consumer)
	})
	unixrpc.Handle(s, "HealFuse", func(ctx context.Context, h plan.Heal, _ []*os.File) (plan.HealResult, error) {
		return n.HealFuse(ctx, h)
	})
	registerDevices(s, n)
	registerNode(s, n)
	return s
}

// handle registers fn, which answers nothing but an error.
func handle[Req any](s *unixrpc.Server, method string, fn func(context.Context, Req, []*os.File) (empty, error)) {
	unixrpc.Handle(s, method, fn)
}

func registerDevices(s *unixrpc.Server, n mounter.Node) {
	unixrpc.Handle(s, "AttachLoop", func(ctx context.Context, r mounter.LoopRequest, _ []*os.File) (mounter.Loop, error) {
		return n.AttachLoop(ctx, r)
	})
	unixrpc.Handle(s, "AdoptLoop", func(ctx context.Context, id loopdev.Identity, _ []*os.File) (mounter.Loop, error) {
		return n.AdoptLoop(ctx, id)
	})
	handle(s, "DetachLoop", func(ctx context.Context, id loopdev.Identity, _ []*os.File) (empty, error) {
		return empty{}, n.DetachLoop(ctx, id)
	})
	unixrpc.Handle(s, "ResizeLoop", func(ctx context.Context, id loopdev.Identity, _ []*os.File) (sizeResp, error) {
		size, err := n.ResizeLoop(ctx, id)
		return sizeResp{size}, err
	})
	unixrpc.Handle(s, "KeepLoops", func(ctx context.Context, r keepReq, _ []*os.File) (countResp, error) {
		released, err := n.KeepLoops(ctx, r.IDs, r.Before)
		return countResp{released}, err
	})
	unixrpc.Handle(s, "Detect", func(ctx context.Context, r fsReq, _ []*os.File) (fsTypeResp, error) {
		t, err := n.Detect(ctx, r.Device)
		return fsTypeResp{t}, err
	})
	handle(s, "Format", func(ctx context.Context, r fsReq, _ []*os.File) (empty, error) {
		return empty{}, n.Format(ctx, r.Device, r.FsType)
	})
	handle(s, "GrowFS", func(ctx context.Context, r fsReq, _ []*os.File) (empty, error) {
		return empty{}, n.GrowFS(ctx, r.Device, r.FsType, r.Unused)
	})
	handle(s, "Freeze", func(ctx context.Context, r fsReq, _ []*os.File) (empty, error) {
		return empty{}, n.Freeze(ctx, r.Device, r.FsType)
	})
	handle(s, "Thaw", func(ctx context.Context, r fsReq, _ []*os.File) (empty, error) {
		return empty{}, n.Thaw(ctx, r.Device, r.FsType)
	})
	handle(s, "ApplyGroup", func(ctx context.Context, r groupReq, _ []*os.File) (empty, error) {
		return empty{}, n.ApplyGroup(ctx, r.Mounts, r.GID)
	})
	handle(s, "ReplayLog", func(ctx context.Context, r imageReq, _ []*os.File) (empty, error) {
		return empty{}, n.ReplayLog(ctx, r.Image, r.BlockSize)
	})
	unixrpc.Handle(s, "ConnectNBD", func(ctx context.Context, r nbdReq, files []*os.File) (mounter.Device, error) {
		return n.ConnectNBD(ctx, r.Request, oneFile(files))
	})
	handle(s, "ReconnectNBD", func(ctx context.Context, r nbdReq, files []*os.File) (empty, error) {
		return empty{}, n.ReconnectNBD(ctx, r.Device, r.Backend, oneFile(files))
	})
	handle(s, "DisconnectNBD", func(ctx context.Context, r nbdReq, _ []*os.File) (empty, error) {
		return empty{}, n.DisconnectNBD(ctx, r.Device, r.Backend)
	})
	unixrpc.Handle(s, "LoginISCSI", func(ctx context.Context, r mounter.ISCSILogin, _ []*os.File) (mounter.ISCSISession, error) {
		return n.LoginISCSI(ctx, r)
	})
	handle(s, "LogoutISCSI", func(ctx context.Context, r mounter.ISCSILogout, _ []*os.File) (empty, error) {
		return empty{}, n.LogoutISCSI(ctx, r)
	})
}

func registerNode(s *unixrpc.Server, n mounter.Node) {
	unixrpc.Handle(s, "BuildChain", func(ctx context.Context, r mounter.ChainRequest, _ []*os.File) (mounter.Chain, error) {
		return n.BuildChain(ctx, r)
	})
	handle(s, "TeardownChain", func(ctx context.Context, r volumeReq, _ []*os.File) (empty, error) {
		return empty{}, n.TeardownChain(ctx, r.VolumeID)
	})
	unixrpc.Handle(s, "IdentifyNamespace", func(ctx context.Context, r pidReq, _ []*os.File) (plan.Namespace, error) {
		return n.IdentifyNamespace(ctx, r.PID)
	})
	unixrpc.Handle(s, "LiveNamespaces", func(ctx context.Context, r consumersReq, _ []*os.File) (aliveResp, error) {
		alive, err := n.LiveNamespaces(ctx, r.Consumers)
		return aliveResp{alive}, err
	})
	unixrpc.Handle(s, "StatFS", func(ctx context.Context, c plan.Consumer, _ []*os.File) (fsutil.Usage, error) {
		return n.StatFS(ctx, c)
	})
	unixrpc.Handle(s, "StatDevice", func(ctx context.Context, r fsReq, _ []*os.File) (fsutil.Usage, error) {
		return n.StatDevice(ctx, r.Device, r.ReadOnly)
	})
	unixrpc.Handle(s, "MakeDeviceNode", func(ctx context.Context, r volumeReq, _ []*os.File) (createdResp, error) {
		created, err := n.MakeDeviceNode(ctx, r.Target, r.Device)
		return createdResp{created}, err
	})
	registerTargets(s, n)
	unixrpc.Handle(s, "StartDaemon", func(ctx context.Context, r mounter.DaemonRequest, _ []*os.File) (mounter.DaemonInfo, error) {
		return n.StartDaemon(ctx, r)
	})
	handle(s, "WaitDaemon", func(ctx context.Context, r daemonReq, _ []*os.File) (empty, error) {
		return empty{}, n.WaitDaemon(ctx, r.Proc)
	})
	unixrpc.Handle(s, "DaemonStatus", func(ctx context.Context, r daemonReq, _ []*os.File) (mounter.DaemonStatus, error) {
		return n.DaemonStatus(ctx, r.Proc, r.Conn)
	})
	handle(s, "StopDaemons", func(ctx context.Context, r volumeReq, _ []*os.File) (empty, error) {
		return empty{}, n.StopDaemons(ctx, r.VolumeID, r.Known, r.Teardown)
	})
	if u, ok := n.(mounter.DaemonUsages); ok {
		unixrpc.Handle(s, "DaemonUsage", func(ctx context.Context, _ empty, _ []*os.File) (usageResp, error) {
			all, err := u.DaemonUsage(ctx)
			return usageResp{all}, err
		})
	}
}

// registerTargets registers the calls on the plugin's target paths
// (mounter.Targets): the plugin sees no kubelet dir.
func registerTargets(s *unixrpc.Server, n mounter.Node) {
	unixrpc.Handle(s, "MakeTarget", func(ctx context.Context, r targetReq, _ []*os.File) (createdResp, error) {
		created, err := n.MakeTarget(ctx, r.Path, r.Block)
		return createdResp{created}, err
	})
	unixrpc.Handle(s, "TargetState", func(ctx context.Context, r targetReq, _ []*os.File) (mounter.Target, error) {
		return n.TargetState(ctx, r.Path)
	})
	handle(s, "RemoveTarget", func(ctx context.Context, r targetReq, _ []*os.File) (empty, error) {
		return empty{}, n.RemoveTarget(ctx, r.Path)
	})
	unixrpc.Handle(s, "StatTarget", func(ctx context.Context, r targetReq, _ []*os.File) (fsutil.Usage, error) {
		return n.StatTarget(ctx, r.Path)
	})
}

// oneFile is the one descriptor a call carries; nil when it carries none
// (the handler then refuses the call).
func oneFile(files []*os.File) *os.File {
	if len(files) != 1 {
		return nil
	}
	return files[0]
}
