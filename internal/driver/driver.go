// Package driver serves the CSI Identity, Controller and Node services and
// mountplan's NodePrepare extension on one gRPC server. It validates
// requests, takes per-volume locks, keeps the journal, and delegates device
// work to the volume sources and mount work to a mounter. Errors are mapped
// to gRPC codes in one place: the unary interceptor (see server.go).
//
// A file per service, each RPC an orchestrator read top to bottom:
// identity.go, controller.go (capacity.go: GetCapacity; health.go: the
// controller's volume health; snapshots.go and snapshotref.go: its
// snapshot RPCs and the node a snapshot ID names), node.go, prepare.go
// (NodePrepare) and nri.go (what NRI mode adds to publish and prepare).
// Background work: reconcile.go, reattach.go, reboot.go (what a new boot
// keeps of the last one's records; node.go's stage, unstage and unpublish
// hand it what an ended boot left, and it drops a volume through node.go's
// saveOrForget and destroyEphemeral: the two files call each other). The
// steps they share lie below them: copy.go (images copied for snapshots
// and clones), provision.go (sizes and images of the volumes the plugin
// makes), plan.go (a volume's plan: built, checked, performed), kubelet.go
// (the paths kubelet sends), pod.go (the pod kubelet names in
// volume_context), stats.go, sources.go (what the driver asks of a volume
// source, and what it offers one), records.go (every record and lock, and
// the lookups in a record), validate.go (request fields), listing.go (page
// tokens), volumes.go (the operator's listing of volumes and their
// consumers, internal/volview), server.go (the gRPC server and its
// interceptor).
package driver

import (
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/metrics"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/topology"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Options configure a Driver.
type Options struct {
	DriverName string
	NodeID     string
	Version    string
	StateDir   string
	// KubeletDir is kubelet's root directory (default /var/lib/kubelet):
	// every staging and target path a CO sends must lie under it.
	KubeletDir string
	Config     *config.Config
	// Node is the mounter: every privileged act (devices, mounts, daemons,
	// looking into other processes) is asked of it. Required.
	Node mounter.Node
	// Mounter, when set, performs plans instead of Node (tests).
	Mounter mounter.Interface
	// Metrics, when not nil, records RPC latencies and device steps.
	Metrics *metrics.Metrics
	// Sources are the volume kinds, by volume_context type. The driver
	// asks each for what it can do besides the Source interface: make its
	// volumes' images (source.Provisioner), copy them (source.Snapshotter;
	// one source at most), and so on.
	Sources map[string]source.Source
	// DefaultType is the type of a volume whose attributes or parameters
	// name none; it must be one of Sources.
	DefaultType string
	// NRI lets volumes ask for NRI mode (attribute nri: "true"): the
	// mounter's NRI hook gives them to containers through the runtime.
	NRI bool
	// BootID returns the ID of the running boot (default
	// journal.CurrentBoot; tests inject one).
	BootID func() (string, error)
	// RebootGrace is how long after a reboot the records of volumes that
	// kubelet has not staged or published again are kept (default
	// DefaultRebootGrace); see docs/state.md, "After a reboot".
	RebootGrace time.Duration
}

// Driver implements the services. Create it with New.
type Driver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer
	api.UnimplementedNodePrepareServer

	opts    Options
	node    mounter.Node
	records *records
	sources map[string]source.Source
	// snapshotter keeps the snapshots: the one source that is a
	// source.Snapshotter, nil when none is.
	snapshotter source.Snapshotter
	policy      plan.Policy
	kubelet     kubeletDir
	ready       atomic.Bool
	// mounterProbe is Probe's view of a mounter in another process.
	mounterProbe mounterProbe
	// rebootedFrom is the boot the node had left when this process
	// started, "" when it started in the boot it last ran in.
	rebootedFrom string
}

// New builds a driver over the state dir. It touches no device: Reconcile
// does that, and Probe says not-ready until it has. If the node rebooted
// since the state dir's last run, it marks every record's runtime part as
// of an ended boot first (detectReboot).
func New(opts Options) (*Driver, error) {
	if opts.DriverName == "" || opts.NodeID == "" || opts.StateDir == "" {
		return nil, fmt.Errorf("driver: name, node id and state dir are required: %w", errdefs.ErrInvalidArgument)
	}
	if opts.Config == nil {
		opts.Config = &config.Config{DefaultFsType: "ext4"}
	}
	stateDir, err := filepath.Abs(opts.StateDir)
	if err != nil {
		return nil, err
	}
	opts.StateDir = stateDir
	kubelet, err := newKubeletDir(opts.KubeletDir)
	if err != nil {
		return nil, err
	}
	recs, err := openRecords(stateDir)
	if err != nil {
		return nil, err
	}
	if opts.Node == nil {
		return nil, fmt.Errorf("driver: a mounter (Node) is required: %w", errdefs.ErrInvalidArgument)
	}
	if opts.Mounter == nil {
		opts.Mounter = opts.Node
	}
	if opts.BootID == nil {
		opts.BootID = journal.CurrentBoot
	}
	if opts.RebootGrace <= 0 {
		opts.RebootGrace = DefaultRebootGrace
	}
	if _, ok := opts.Sources[opts.DefaultType]; !ok {
		return nil, fmt.Errorf("driver: the default volume type %q is no source's: %w", opts.DefaultType, errdefs.ErrInvalidArgument)
	}
	d := &Driver{
		opts:    opts,
		node:    opts.Node,
		records: recs,
		sources: maps.Clone(opts.Sources),
		policy:  opts.Config.PlanPolicy(stateDir),
		kubelet: kubelet,
	}
	for _, typ := range slices.Sorted(maps.Keys(d.sources)) {
		s := d.sources[typ]
		if hu, ok := s.(source.HostUser); ok {
			hu.SetHost(d)
		}
		if sn, ok := s.(source.Snapshotter); ok {
			if d.snapshotter != nil {
				return nil, fmt.Errorf("driver: two sources keep snapshots (%s is the second); one may: %w", typ, errdefs.ErrInvalidArgument)
			}
			d.snapshotter = sn
		}
	}
	if err := d.detectReboot(klog.Background()); err != nil {
		return nil, fmt.Errorf("driver: %w", err)
	}
	return d, nil
}

// Register adds every service to s.
func (d *Driver) Register(s *grpc.Server) {
	csi.RegisterIdentityServer(s, d)
	csi.RegisterControllerServer(s, d)
	csi.RegisterNodeServer(s, d)
	api.RegisterNodePrepareServer(s, d)
}

// StagedByType counts staged volumes by type, for the metrics gauge.
func (d *Driver) StagedByType() map[string]int {
	vols, _ := d.records.List()
	out := map[string]int{}
	for _, v := range vols {
		if v.Staged() {
			out[v.Type]++
		}
	}
	return out
}

// Ready reports whether the startup reconcile has finished.
func (d *Driver) Ready() bool { return d.ready.Load() }

func (d *Driver) topology() *csi.Topology {
	return &csi.Topology{Segments: map[string]string{topology.Key: d.opts.NodeID}}
}
