//go:build linux

package nri

// Finding F9 of issue 33: the hook stat'ed paths a pod controls (its
// containers' bind sources, its block devices' paths) in the runtime's
// event, and the runtime drops a plugin that does not answer in time, for
// the whole node. A pod with a classic sshfs volume whose server stopped
// answering, plus one NRI volume, got the hook dropped at every try.

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/internal/blocking/blockingtest"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/pkg/plan"
)

// hungEnv is a node with a pod that has an NRI volume (bound to the
// guard) and FUSE filesystems whose daemons never answer: a classic CSI
// volume of the same pod and a hostPath elsewhere.
type hungEnv struct {
	h    *Hook
	vols *releasingVolumes
	pod  *nriapi.PodSandbox
	// nri is the NRI volume's target, classic a classic volume's of the
	// same pod, hostPath a directory elsewhere, inDev one below /dev: the
	// last three on FUSE filesystems that never answer.
	nri, classic, hostPath, inDev string
	nriPlan                       plan.Mount
	hung                          []*blockingtest.Hung
}

// The NRI block volumes' devices, whose plans name a device node on a
// hung filesystem: below /dev, and through /dev/.. elsewhere.
const (
	blockMajor, blockInDev, blockLeavesDev = 7, 4242, 4243
)

func newHungEnv(t *testing.T) *hungEnv {
	state, kubelet := hookDirs(t)
	scratch := filepath.Dir(state)
	e := &hungEnv{
		pod:      &nriapi.PodSandbox{Id: "sandbox", Uid: "uid-pod", Name: "p", Namespace: "ns"},
		nri:      podTarget(kubelet, "uid-pod", "pv-nri"),
		classic:  podTarget(kubelet, "uid-pod", "pv-sshfs"),
		hostPath: filepath.Join(scratch, "hostpath"),
		nriPlan:  plan.Mount{Type: "tmpfs", Source: "vol", Options: []string{"nosuid", "nodev"}},
	}
	mkdirs(t, e.nri, e.classic, e.hostPath)
	inDev, err := os.MkdirTemp("/dev", "mountplan-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(inDev) }) // once the mount is gone
	e.inDev = inDev
	e.vols = &releasingVolumes{hostileVolumes: hostileVolumes{
		byTarget: map[string][]plan.Mount{e.nri: {e.nriPlan}},
		block: map[[2]uint32][]plan.Mount{
			{blockMajor, blockInDev}:     {{Type: plan.TypeBind, Source: filepath.Join(e.inDev, "vol")}},
			{blockMajor, blockLeavesDev}: {{Type: plan.TypeBind, Source: "/dev/.." + filepath.Join(e.hostPath, "vol")}},
		},
	}}
	e.h = NewHook(e.vols, &hostileMounter{}, state, kubelet)
	startGuard(t, e.h)
	bindGuard(t, state, e.nri)
	for _, dir := range []string{e.classic, e.hostPath, e.inDev} {
		e.hung = append(e.hung, blockingtest.HungFuse(t, dir))
	}
	return e
}

func bindOf(src, dst string) *nriapi.Mount {
	return &nriapi.Mount{Source: src, Destination: dst, Type: "bind", Options: []string{"rbind", "rprivate", "rw"}}
}

// hungRow is a container of the pod: its NRI volume at /data and
// something on a filesystem that never answers.
type hungRow struct {
	name string
	ctr  func(e *hungEnv) *nriapi.Container
	// want is the container's failure, naming the path; nil: the
	// container gets its NRI volume, and the rest as the runtime has it.
	want error
	path func(e *hungEnv) string
}

// blockAt is a container's block device d at path.
func blockAt(path string, major, minor int64) *nriapi.LinuxContainer {
	return &nriapi.LinuxContainer{Devices: []*nriapi.LinuxDevice{{Type: "b", Path: path, Major: major, Minor: minor}}}
}

var hungRows = []hungRow{
	{name: "a classic volume of the pod's whose server hangs", ctr: func(e *hungEnv) *nriapi.Container {
		return &nriapi.Container{Mounts: []*nriapi.Mount{bindOf(e.nri, "/data"), bindOf(e.classic, "/classic")}}
	}, want: errdefs.ErrUnavailable, path: func(e *hungEnv) string { return e.classic }},
	{name: "a hostPath on a hung filesystem", ctr: func(e *hungEnv) *nriapi.Container {
		return &nriapi.Container{Mounts: []*nriapi.Mount{bindOf(e.nri, "/data"), bindOf(e.hostPath, "/host")}}
	}},
	{name: "a block device at a path through a hung filesystem", ctr: func(e *hungEnv) *nriapi.Container {
		return &nriapi.Container{Mounts: []*nriapi.Mount{bindOf(e.nri, "/data")}, Linux: blockAt(filepath.Join(e.hostPath, "dev"), 8, 16)}
	}},
	{name: "a block device below /dev on a hung filesystem", ctr: func(e *hungEnv) *nriapi.Container {
		return &nriapi.Container{Mounts: []*nriapi.Mount{bindOf(e.nri, "/data")}, Linux: blockAt(filepath.Join(e.inDev, "dev"), 8, 16)}
	}},
	{name: "a block volume whose plan names a device below /dev on a hung filesystem", ctr: func(e *hungEnv) *nriapi.Container {
		return &nriapi.Container{Mounts: []*nriapi.Mount{bindOf(e.nri, "/data")}, Linux: blockAt("/dev/mountplan-test-vol", blockMajor, blockInDev)}
	}, want: errdefs.ErrUnavailable, path: func(e *hungEnv) string { return filepath.Join(e.inDev, "vol") }},
	{name: "a block volume whose plan names a device through /dev/..", ctr: func(e *hungEnv) *nriapi.Container {
		return &nriapi.Container{Mounts: []*nriapi.Mount{bindOf(e.nri, "/data")}, Linux: blockAt("/dev/mountplan-test-vol", blockMajor, blockLeavesDev)}
	}, want: errdefs.ErrInvalidArgument, path: func(e *hungEnv) string { return "/dev/.." + e.hostPath }},
}

// TestHookNeverWaitsOnAHungFilesystem (issue 33, F9): CreateContainer and
// StartContainer of a container with an NRI volume and something on a
// filesystem that never answers return by the hook's deadline, with the
// container's NRI volume or with an error that names the path; and once
// the filesystems are aborted nothing of the calls is left.
func TestHookNeverWaitsOnAHungFilesystem(t *testing.T) {
	e := newHungEnv(t)
	goroutines := runtime.NumGoroutine()
	for i, row := range hungRows {
		t.Run(row.name, func(t *testing.T) {
			ctr := row.ctr(e)
			ctr.Id, ctr.PodSandboxId, ctr.Name = "ctr-"+string(rune('a'+i)), e.pod.Id, "app"
			var adj *nriapi.ContainerAdjustment
			create := func(ctx context.Context) (err error) {
				adj, _, err = e.h.CreateContainer(ctx, e.pod, ctr)
				return err
			}
			ok, err := returns(t, e.h, "CreateContainer", create)
			if !ok {
				return
			}
			if row.want != nil {
				wantRefused(t, e, adj, err, row.want, row.path(e), ctr.Id)
				// kubelet tries again, with the call before still under way.
				if ok, err := returns(t, e.h, "CreateContainer, again", create); ok {
					wantRefused(t, e, adj, err, row.want, row.path(e), ctr.Id)
				}
				return
			}
			if err != nil {
				t.Fatalf("CreateContainer: %v, want the NRI volume and the rest as the runtime has it", err)
			}
			wantRuntimeMount(t, adj, nil, e.nriPlan)
			// StartContainer of the container created so.
			ctr.Annotations = applyAnnotations(ctr.GetAnnotations(), adj)
			ctr.Pid = uint32(os.Getpid())
			if ok, err := returns(t, e.h, "StartContainer", func(ctx context.Context) error {
				return e.h.StartContainer(ctx, e.pod, ctr)
			}); ok && err != nil {
				t.Errorf("StartContainer: %v", err)
			}
		})
	}
	// Nothing is left once the filesystems answer (ENOTCONN).
	for _, hung := range e.hung {
		if err := hung.Abort(); err != nil {
			t.Error(err)
		}
	}
	e.h.wait()
	if n := settledGoroutines(goroutines); n > goroutines {
		t.Errorf("%d goroutines once the hung filesystems were aborted, %d before the containers", n, goroutines)
	}
	for _, hung := range e.hung {
		if ms := mountnstest.MountsUnder(t, 0, hung.Dir); len(ms) != 0 {
			t.Errorf("%d mounts left at %s", len(ms), hung.Dir)
		}
	}
}

// returns calls event with the runtime's context and reports its answer,
// or fails the test when it has not answered three times the hook's
// deadline after it was called (the runtime would have dropped the hook
// long before).
func returns(t *testing.T, h *Hook, name string, event func(context.Context) error) (answered bool, err error) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- event(context.Background()) }()
	bound := 3 * h.timeout()
	select {
	case err := <-done:
		return true, err
	case <-time.After(bound):
		t.Errorf("%s had not returned %v after it was called (the hook's deadline is %v): it waits on a filesystem that never answers", name, bound, h.timeout())
		return false, nil
	}
}

// wantRefused asserts the container's creation failed on path with want,
// with nothing for the runtime and the NRI claim released.
func wantRefused(t *testing.T, e *hungEnv, adj *nriapi.ContainerAdjustment, err, want error, path, id string) {
	t.Helper()
	if !errors.Is(err, want) || !strings.Contains(err.Error(), path) || adj != nil {
		t.Fatalf("CreateContainer = %v, %v; want no adjustment and %v naming %s", describe(adj), err, want, path)
	}
	t.Logf("refused: %v", err)
	e.h.wait()
	e.vols.mu.Lock()
	defer e.vols.mu.Unlock()
	for _, c := range e.vols.released {
		if c.ContainerID == id && c.VolumeID == "vol:"+e.nri {
			return
		}
	}
	t.Errorf("released %+v, want the NRI claim of %s", e.vols.released, id)
}

// settledGoroutines waits a few seconds for the goroutine count to fall to
// want (calls the kernel ends after an abort return a little later) and
// returns it.
func settledGoroutines(want int) int {
	n := runtime.NumGoroutine()
	for deadline := time.Now().Add(10 * time.Second); n > want && time.Now().Before(deadline); n = runtime.NumGoroutine() {
		time.Sleep(20 * time.Millisecond)
	}
	return n
}
