// Command leancsi is the bench's lean CSI node server: the floor of a
// publish cycle plus the transport kubelet imposes, and nothing else.
//
// It serves grpc-go on a unix socket as mountplan-plugin does
// (internal/endpoint), with Identity, Node (STAGE_UNSTAGE) and the
// NodePrepare extension, each call doing only its system calls, its state
// in memory:
//
//   - NodeStageVolume attaches the image named by the volume context's
//     "image" to a loop device as the bench's floor does (loopdev.Attach: a
//     number it detached before, else LOOP_CTL_GET_FREE; LOOP_CONFIGURE with
//     direct I/O where the backing filesystem allows it, autoclear);
//   - NodePublishVolume makes target_path (mkdir(2), as the CSI spec has
//     the SP create it, kubelet making only its parent) and mount(2)s that
//     device ext4 nosuid,nodev there;
//   - NodeUnpublishVolume umount2(2)s it and removes target_path (rmdir(2):
//     the spec has the SP delete what it created);
//   - NodeUnstageVolume clears the device (LOOP_CLR_FD) and closes it;
//   - NodePrepareVolume answers the plan of the staged device (one ext4
//     mount nosuid,nodev), which the caller performs in the consumer's
//     namespace; NodeUnprepareVolume does nothing.
//
// No journal, no identity or path checks, no interceptor, no log line per
// call: whatever mountplan-plugin spends above this server's time on the
// same cycle is its own (issue 23). Calls are serialised by one mutex: the
// bench makes one at a time.
//
//	leancsi --endpoint unix:///run/lean.sock
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/loopdev"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
)

// imageKey is the volume context key that names the image to attach.
const imageKey = "image"

func main() {
	ep := flag.String("endpoint", "", "unix:///absolute/path of the socket to serve on")
	flag.Parse()
	if err := run(*ep); err != nil {
		fmt.Fprintln(os.Stderr, "leancsi:", err)
		os.Exit(1)
	}
}

func run(ep string) error {
	lis, err := endpoint.Listen(ep)
	if err != nil {
		return err
	}
	s := &server{staged: map[string]*loopdev.Device{}}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, s)
	csi.RegisterNodeServer(srv, s)
	api.RegisterNodePrepareServer(srv, s)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		srv.GracefulStop()
	}()
	err = srv.Serve(lis)
	return errors.Join(err, s.detachAll())
}

type server struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedNodeServer
	api.UnimplementedNodePrepareServer

	mu     sync.Mutex
	staged map[string]*loopdev.Device // by volume ID
}

// detachAll clears the devices still staged when the server stops.
func (s *server) detachAll() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for id, d := range s.staged {
		errs = append(errs, d.Detach())
		delete(s.staged, id)
	}
	return errors.Join(errs...)
}

func (s *server) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: "lean.bench.mountplan.io", VendorVersion: "0"}, nil
}

func (s *server) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

func (s *server) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{}, nil
}

func (s *server) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{
		Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME}},
	}}}, nil
}

func (s *server) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	image := req.GetVolumeContext()[imageKey]
	if image == "" {
		return nil, status.Errorf(codes.InvalidArgument, "volume context has no %q", imageKey)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.staged[req.GetVolumeId()]; ok {
		return &csi.NodeStageVolumeResponse{}, nil
	}
	d, err := loopdev.Attach(ctx, image, loopdev.Options{DirectIO: true, Autoclear: true})
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	s.staged[req.GetVolumeId()] = d
	return &csi.NodeStageVolumeResponse{}, nil
}

func (s *server) NodePublishVolume(_ context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, ok := s.staged[req.GetVolumeId()]
	if !ok {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged", req.GetVolumeId())
	}
	target := req.GetTargetPath()
	if err := unix.Mkdir(target, 0o750); err != nil && !errors.Is(err, unix.EEXIST) {
		return nil, status.Errorf(codes.Internal, "mkdir %s: %v", target, err)
	}
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV)
	if req.GetReadonly() {
		flags |= unix.MS_RDONLY
	}
	if err := unix.Mount(d.Path, target, "ext4", flags, ""); err != nil {
		return nil, status.Errorf(codes.Internal, "mount %s at %s: %v", d.Path, target, errors.Join(err, unix.Rmdir(target)))
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (s *server) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	target := req.GetTargetPath()
	err := unix.Unmount(target, 0)
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) { // not mounted, or gone: done
		return nil, status.Errorf(codes.Internal, "umount2 %s: %v", target, err)
	}
	if err := unix.Rmdir(target); err != nil && !errors.Is(err, unix.ENOENT) {
		return nil, status.Errorf(codes.Internal, "rmdir %s: %v", target, err)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (s *server) NodeUnstageVolume(_ context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, ok := s.staged[req.GetVolumeId()]
	if !ok {
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if err := d.Detach(); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	delete(s.staged, req.GetVolumeId())
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (s *server) NodePrepareVolume(_ context.Context, req *api.NodePrepareVolumeRequest) (*api.NodePrepareVolumeResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, ok := s.staged[req.GetVolumeId()]
	if !ok {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged", req.GetVolumeId())
	}
	return &api.NodePrepareVolumeResponse{
		Mounts:   []*api.Mount{{Type: "ext4", Source: d.Path, Options: []string{"nosuid", "nodev"}}},
		Consumer: req.GetConsumer(), VolumeId: req.GetVolumeId(),
	}, nil
}

func (s *server) NodeUnprepareVolume(context.Context, *api.NodeUnprepareVolumeRequest) (*api.NodeUnprepareVolumeResponse, error) {
	return &api.NodeUnprepareVolumeResponse{}, nil
}
