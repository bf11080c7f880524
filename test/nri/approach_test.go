package nri_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	nriapi "github.com/containerd/nri/pkg/api"

	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/endpoint"
	"github.com/mountplan/mountplan/pkg/mounter"
	"github.com/mountplan/mountplan/pkg/nri"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/test/testutil"
)

func TestMain(m *testing.M) { testutil.Main(m) }

// staticVolumes answers every claim with one plan, fetched once from the
// plugin: the prototype measures what the two ways of performing a plan
// cost at container start, not the plugin's bookkeeping.
type staticVolumes struct{ p nri.Prepared }

func (s staticVolumes) Prepare(context.Context, nri.Claim) (nri.Prepared, error) { return s.p, nil }
func (s staticVolumes) Release(context.Context, string, nri.Claim) error         { return nil }

// BenchmarkApproaches is the measurement behind docs/nri.md: container
// start latency (CRI CreateContainer + StartContainer through crictl) with
// a plain host directory bind (no hook), with the plan turned into OCI
// mounts at CreateContainer (ModeAdjust), and with the mounter performing
// it inside the container's namespace at StartContainer (ModeMount).
// Medians of 20 starts each, interleaved.
//
//	go test -run '^$' -bench Approaches -benchtime 1x ./test/nri
func BenchmarkApproaches(b *testing.B) {
	testutil.RequireRoot(b)
	// Children get Pdeathsig from the thread that starts them; the
	// in-process mounter ends the threads it enters namespaces on, which
	// must never be this one.
	runtime.LockOSThread()
	testutil.NoLeaks(b)
	cri := testutil.StartCRI(b)
	pluginBin, _ := testutil.BuildBinaries(b)
	p := testutil.StartPlugin(b, pluginBin, "--v=2")
	conn, err := endpoint.Dial(p.Endpoint)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	ctl, node, np := csi.NewControllerClient(conn), csi.NewNodeClient(conn), api.NewNodePrepareClient(conn)
	ctx := context.Background()
	mountCap := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}}
	vol, err := ctl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "bench", CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap}})
	if err != nil {
		b.Fatal(err)
	}
	id := vol.GetVolume().GetVolumeId()
	staging := filepath.Join(b.TempDir(), "staging")
	if _, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap}); err != nil {
		b.Fatal(err)
	}
	defer func() {
		if _, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
			b.Error(err)
		}
		if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			b.Error(err)
		}
	}()
	// The plan, asked for once on behalf of this process.
	resp, err := np.NodePrepareVolume(ctx, &api.NodePrepareVolumeRequest{VolumeId: id, StagingTargetPath: staging,
		VolumeCapability: mountCap, Consumer: &api.Consumer{Pid: int64(os.Getpid()), MountPoint: "/data"}})
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		if _, err := np.NodeUnprepareVolume(ctx, &api.NodeUnprepareVolumeRequest{VolumeId: id,
			Consumer: &api.Consumer{Pid: int64(os.Getpid()), MountPoint: "/data"}}); err != nil {
			b.Error(err)
		}
	}()
	prepared := nri.Prepared{VolumeID: id, Mounts: plan.FromProto(resp.GetMounts())}

	target := filepath.Join(b.TempDir(), "target")
	if err := os.Mkdir(target, 0o755); err != nil {
		b.Fatal(err)
	}
	hook := func(mode nri.Mode) *timedHook {
		return &timedHook{Hook: nri.NewHook(nri.Options{Volumes: staticVolumes{prepared}, Mode: mode,
			Mounter:  &mounter.Executor{Policy: plan.Policy{Roots: []string{p.StateDir}, ImageRoots: []string{filepath.Join(p.StateDir, "images")}}},
			IsTarget: func(m *nriapi.Mount) bool { return m.Source == target }})}
	}
	modes := []struct {
		name string
		hook *timedHook
	}{{"no hook (host dir bind)", nil}, {"adjust: OCI mounts at CreateContainer", hook(nri.ModeAdjust)}, {"mount: setns+move_mount at StartContainer", hook(nri.ModeMount)}}

	pod := cri.RunPod(b, "bench")
	const n = 20
	times := make([][]time.Duration, len(modes))
	for i := range n + 1 { // the first round warms up
		for m, mode := range modes {
			stop := func() {}
			if mode.hook != nil {
				stop = runHook(b, cri, mode.hook)
			}
			d, fsType := startOnce(b, cri, pod, fmt.Sprintf("c%d-%d", m, i), target)
			stop()
			want := "ext4"
			if mode.hook == nil {
				want = "" // the host directory's own filesystem
			}
			if want != "" && fsType != want {
				b.Fatalf("%s: /data in the container is %q, want %s", mode.name, fsType, want)
			}
			if i > 0 {
				times[m] = append(times[m], d)
			}
		}
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\n| container start (create+start via crictl), median of %d | ms | p90 ms | in CreateContainer, ms | in StartContainer, ms |\n|---|---|---|---|---|\n", n)
	for m, mode := range modes {
		med, p90 := quantiles(times[m])
		hookCreate, hookStart := "-", "-"
		if h := mode.hook; h != nil {
			c, _ := quantiles(h.create[1:])
			s, _ := quantiles(h.start[1:])
			hookCreate, hookStart = fmt.Sprintf("%.2f", ms(c)), fmt.Sprintf("%.2f", ms(s))
		}
		fmt.Fprintf(&sb, "| %s | %.1f | %.1f | %s | %s |\n", mode.name, ms(med), ms(p90), hookCreate, hookStart)
		b.ReportMetric(ms(med), "ms-median-"+strings.Fields(mode.name)[0])
	}
	b.Log(sb.String())
}

// timedHook measures how long the hook's CreateContainer and StartContainer
// handlers take.
type timedHook struct {
	*nri.Hook
	create, start []time.Duration
}

func (t *timedHook) CreateContainer(ctx context.Context, p *nriapi.PodSandbox, c *nriapi.Container) (*nriapi.ContainerAdjustment, []*nriapi.ContainerUpdate, error) {
	start := time.Now()
	defer func() { t.create = append(t.create, time.Since(start)) }()
	return t.Hook.CreateContainer(ctx, p, c)
}

func (t *timedHook) StartContainer(ctx context.Context, p *nriapi.PodSandbox, c *nriapi.Container) error {
	start := time.Now()
	defer func() { t.start = append(t.start, time.Since(start)) }()
	return t.Hook.StartContainer(ctx, p, c)
}

// runHook registers h with cri's NRI socket until the returned function is
// called.
func runHook(tb testing.TB, cri *testutil.CRI, h any) (stop func()) {
	tb.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	up := make(chan bool, 4)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = nri.Run(ctx, cri.NRISocket, h, func(ok bool) { up <- ok })
	}()
	select {
	case ok := <-up:
		if !ok {
			tb.Fatal("hook did not register")
		}
	case <-time.After(20 * time.Second):
		tb.Fatal("hook did not register within 20s")
	}
	return func() { cancel(); <-done }
}

// startOnce creates and starts a container binding target at /data, times
// it, reads /data's filesystem type from inside, and removes the container.
func startOnce(tb testing.TB, cri *testutil.CRI, pod *testutil.Pod, name, target string) (time.Duration, string) {
	tb.Helper()
	start := time.Now()
	id, err := pod.CreateContainer(name, testutil.ContainerSpec{Mounts: []testutil.CRIMount{{ContainerPath: "/data", HostPath: target}}})
	if err != nil {
		tb.Fatal(err)
	}
	if err := cri.StartContainer(id); err != nil {
		tb.Fatal(err)
	}
	d := time.Since(start)
	out, err := cri.Exec(id, "grep", " /data ", "/proc/self/mountinfo")
	if err != nil {
		tb.Fatalf("container %s: %v", name, err)
	}
	fsType := "" // of the top mount at /data, the last one listed
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if last := lines[len(lines)-1]; strings.Contains(last, " - ") {
		fsType = strings.Fields(last[strings.Index(last, " - ")+3:])[0]
	}
	if err := cri.StopContainer(id); err != nil {
		tb.Fatal(err)
	}
	if err := cri.RemoveContainer(id); err != nil {
		tb.Fatal(err)
	}
	return d, fsType
}

func quantiles(ds []time.Duration) (median, p90 time.Duration) {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2], s[len(s)*9/10]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
