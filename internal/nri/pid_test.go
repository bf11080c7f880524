package nri

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// fakeProc writes a /proc with the processes given: PID -> parent PID and
// the lines of its cgroup file.
func fakeProc(t *testing.T, procs map[int]struct {
	ppid   int
	cgroup string
}) string {
	t.Helper()
	root := t.TempDir()
	for pid, p := range procs {
		dir := filepath.Join(root, strconv.Itoa(pid))
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		// The fields of a real /proc/PID/stat after the parent's PID.
		stat := fmt.Sprintf("%d (sleep) S %d 1 1 0 -1 4194304 98 0 0 0 0 0 0 0 20 0 1 0 1204035 3133440 375 18446744073709551615 1 1 1 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 1 1 1 1 1 1 1 0\n", pid, p.ppid)
		if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte(p.cgroup), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func ctrIn(id, cgroupsPath string, pid uint32) *nriapi.Container {
	return &nriapi.Container{Id: id, Pid: pid, Linux: &nriapi.LinuxContainer{CgroupsPath: cgroupsPath}}
}

// TestPidsOfWithoutTheRuntimesPID: CRI-O gives NRI plugins no PID; the
// container's first process is found in its cgroup (cgroupfs and systemd
// forms of the path, v1 and v2 files, its monitor's cgroup not taken for
// it, a child of its first process not taken either), and a PID the
// runtime gives is taken as it is.
func TestPidsOfWithoutTheRuntimesPID(t *testing.T) {
	type p = struct {
		ppid   int
		cgroup string
	}
	proc := fakeProc(t, map[int]p{
		100: {1, "12:pids:/kubepods/pod1/crio-conmon-abc\n0::/\n"},                              // the monitor
		101: {100, "12:pids:/kubepods/pod1/crio-abc\n4:memory:/kubepods/pod1/crio-abc\n0::/\n"}, // its first process
		102: {101, "12:pids:/kubepods/pod1/crio-abc\n0::/\n"},                                   // a child of it
		103: {1, "0::/../../kubepods.slice/kubepods-pod2.slice/crio-def.scope\n"},               // systemd, seen from a cgroup namespace
		104: {1, "0::/kubepods/pod3/crio-abcd\n"},                                               // another container, an ID with abc's as its prefix
	})
	ctrs := []*nriapi.Container{
		ctrIn("abc", "/kubepods/pod1/crio-abc", 0),
		ctrIn("def", "kubepods-pod2.slice:crio:def", 0),
		ctrIn("ghi", "/kubepods/pod4/crio-ghi", 555),
		ctrIn("gone", "/kubepods/pod5/crio-gone", 0),
	}
	pids, err := pidsOf(proc, ctrs)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int{"abc": 101, "def": 103, "ghi": 555}
	if len(pids) != len(want) {
		t.Errorf("pids %v, want %v", pids, want)
	}
	for id, pid := range want {
		if pids[id] != pid {
			t.Errorf("container %s: PID %d, want %d (all: %v)", id, pids[id], pid, pids)
		}
	}

	if pid, err := pidOf(proc, ctrs[0]); pid != 101 || err != nil {
		t.Errorf("pidOf abc: %d, %v; want 101", pid, err)
	}
	if pid, err := pidOf(proc, ctrs[3]); pid != 0 || !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("pidOf a container with no process: %d, %v; want FailedPrecondition", pid, err)
	}
}

func TestCgroupLeaf(t *testing.T) {
	for in, want := range map[string]string{
		"/kubepods/besteffort/pod1/crio-abc":      "crio-abc",
		"kubepods-besteffort-pod1.slice:crio:abc": "crio-abc.scope",
		"kubepods.slice:cri-containerd:abc":       "cri-containerd-abc.scope",
		"system.slice::abc.scope":                 "abc.scope",
		"/k8s.io/abc":                             "abc",
		"":                                        "",
	} {
		if got := cgroupLeaf(in); got != want {
			t.Errorf("cgroupLeaf(%q) = %q, want %q", in, got, want)
		}
	}
}

// BenchmarkPidsOf is the cost CRI-O's missing PID adds to a
// StartContainer: one pass over this machine's /proc, every process's
// cgroup file read (a container no process is in: the whole pass).
func BenchmarkPidsOf(b *testing.B) {
	ctr := ctrIn("none", "/bench/crio-none", 0)
	for b.Loop() {
		if _, err := pidsOf("/proc", []*nriapi.Container{ctr}); err != nil {
			b.Fatal(err)
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*")
	b.ReportMetric(float64(len(procs)), "procs")
}
