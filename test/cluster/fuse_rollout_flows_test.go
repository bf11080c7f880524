//go:build clustertest

package cluster

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A pod's loop over a FUSE volume: each line of its log is "ok N" or
// "FAIL N <what went wrong>".
const (
	// sqReadLoop reads the squashfuse volume's file every 50 ms.
	sqReadLoop = `i=0; trap 'exit 0' TERM; while true; do i=$((i+1)); ` +
		`if out=$(cat /data/file 2>&1); then if [ "$out" = "$TOK" ]; then echo "ok $i"; else echo "FAIL $i read $out"; fi; ` +
		`else echo "FAIL $i $out"; fi; sleep 0.05; done`
	// rcWriteLoop writes a new file on the rclone volume, reads it back
	// and removes it, every 50 ms.
	rcWriteLoop = `i=0; trap 'exit 0' TERM; while true; do i=$((i+1)); ` +
		`if out=$( (echo "$i" > /data/loop-$i && cat /data/loop-$i && rm /data/loop-$i) 2>&1); then ` +
		`if [ "$out" = "$i" ]; then echo "ok $i"; else echo "FAIL $i read $out"; fi; else echo "FAIL $i $out"; fi; sleep 0.05; done`
)

// fuseDaemonsSurviveMounterRollout: while one pod reads a squashfuse
// volume (fd mode) and another writes and reads an rclone volume, each in
// a loop every 50 ms, the mounter's DaemonSet is rolled (a new pod, the old
// one's containers stopped by the runtime). No read or write may fail, the
// daemons must be the same processes afterwards, and the new mounter must
// say it adopted them (issue 34).
func fuseDaemonsSurviveMounterRollout(t *testing.T, e *env) {
	sqTok, _ := e.fuseSetup(t)
	sq := pod("sqloop", withClaim("sqfuse", "/data", true), withScript(sqReadLoop))
	sq["spec"].(obj)["containers"].([]obj)[0]["env"] = []obj{{"name": "TOK", "value": sqTok}}
	e.run(t, sq, pod("rcloop", withClaim("rclone", "/data", false), withScript(rcWriteLoop)))
	defer e.fuseTeardownPods(t, []string{"sqloop", "rcloop"}, "sqfuse", "rclone")
	for _, p := range []string{"sqloop", "rcloop"} {
		waitFor(t, 30*time.Second, p+" loops", func() error {
			ok, _, err := e.loopLog(p)
			if err == nil && ok < 10 {
				err = fmt.Errorf("%d good iterations", ok)
			}
			return err
		})
	}
	daemons := map[string]int{}
	starts := map[string]string{}
	for _, comm := range []string{"squashfuse", "rclone"} {
		daemons[comm] = e.daemonPID(t, comm)
		starts[comm] = startTime(daemons[comm])
	}
	t.Logf("daemons before the rollout (host PIDs): %v", daemons)
	old := e.podOf(t, mounterComponent)
	start := time.Now()
	must(t)(e.c.kubectl("-n", "kube-system", "rollout", "restart", "daemonset/mountplan-mounter"))
	must(t)(e.c.kubectl("-n", "kube-system", "rollout", "status", "daemonset/mountplan-mounter", "--timeout=180s"))
	t.Logf("mounter rolled in %v", time.Since(start).Round(10*time.Millisecond))
	waitFor(t, 60*time.Second, "the old mounter pod gone", func() error {
		if _, err := e.c.kubectl("-n", "kube-system", "get", "pod", old); err == nil {
			return fmt.Errorf("pod %s still exists", old)
		}
		return nil
	})
	sleep(3 * time.Second) // the loops run on against the new mounter
	for _, p := range []string{"sqloop", "rcloop"} {
		ok, fails, err := e.loopLog(p)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("pod %s: %d good iterations, %d failed", p, ok, len(fails))
		if len(fails) > 0 {
			t.Errorf("pod %s: %d of %d iterations failed across the rollout; the first: %s", p, len(fails), ok+len(fails), strings.Join(fails[:min(5, len(fails))], " | "))
		}
	}
	logs := must(t)(e.containerLogs(t, mounterComponent, mounterContainer))
	for comm, pid := range daemons {
		if got := startTime(pid); got == "" || got != starts[comm] {
			t.Errorf("the %s daemon (host PID %d) did not survive the rollout", comm, pid)
			continue
		}
		if cur := e.daemonPIDNoWait(comm); cur != pid {
			t.Errorf("the %s daemon is PID %d after the rollout, was %d", comm, cur, pid)
		}
		want := fmt.Sprintf("adopted FUSE daemon pid %d of volume", nodePID(pid))
		if !strings.Contains(logs, want) {
			t.Errorf("the new mounter's log does not say %q", want)
		}
	}
}

// loopLog counts a loop pod's good and failed iterations (its log).
func (e *env) loopLog(pod string) (ok int, fails []string, err error) {
	out, err := e.c.kubectl("-n", testNS, "logs", pod)
	if err != nil {
		return 0, nil, err
	}
	for _, l := range strings.Split(out, "\n") {
		switch {
		case strings.HasPrefix(l, "ok "):
			ok++
		case strings.HasPrefix(l, "FAIL "):
			fails = append(fails, l)
		}
	}
	return ok, fails, nil
}

// containerLogs is the log of a component's container (the pod of now).
func (e *env) containerLogs(t *testing.T, component, container string) (string, error) {
	t.Helper()
	return e.c.kubectl("-n", "kube-system", "logs", e.podOf(t, component), "-c", container)
}

// daemonPID is the host PID of the one process named comm on the first
// node, wherever its cgroup is.
func (e *env) daemonPID(t *testing.T, comm string) int {
	t.Helper()
	var pid int
	waitFor(t, 30*time.Second, "one "+comm+" process", func() error {
		if pid = e.daemonPIDNoWait(comm); pid <= 0 {
			return fmt.Errorf("not exactly one process named %s", comm)
		}
		return nil
	})
	return pid
}

func (e *env) daemonPIDNoWait(comm string) int {
	var pids []int
	for p, c := range e.c.procs() {
		if c == comm {
			pids = append(pids, p)
		}
	}
	if len(pids) != 1 {
		return 0
	}
	return pids[0]
}

// nodePID is a host PID as the first node's PID namespace (the mounter's,
// hostPID) numbers it: NSpid's second entry.
func nodePID(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f, ok := strings.CutPrefix(l, "NSpid:"); ok {
			ids := strings.Fields(f)
			if len(ids) > 1 {
				n, _ := strconv.Atoi(ids[1])
				return n
			}
		}
	}
	return 0
}

// fuseTeardownPods deletes the pods, then the FUSE volumes' claims and PVs.
func (e *env) fuseTeardownPods(t *testing.T, pods []string, vols ...string) {
	t.Helper()
	for _, p := range pods {
		e.c.deleteAndWait(t, "pod", p)
	}
	for _, n := range vols {
		e.c.deleteAndWait(t, "pvc", n)
		must(t)(e.c.kubectl("delete", "pv", n, "--wait=true", "--timeout=60s"))
	}
}
