//go:build clustertest

package cluster

// The container runtime restarts while NRI pods write (issue 24): containerd
// (on the first node; CRI-O on the node that runs it) is killed (SIGKILL)
// and held down by the node (nodeConfig.holdPath) while a pod is created,
// then released; then killed once more and let come back at once. Running
// containers and their shims (conmon under CRI-O) outlive the runtime, so their
// volumes (mounted in their own namespaces) and their writes must go on;
// the mounter's hook loses its NRI connection (and stops the guard) and
// must register again, re-learn its claims at Synchronize and give the pod
// created meanwhile its volume, never the guard's directory.

import (
	"bufio"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// runtimeHold is how long the runtime is held down.
const runtimeHold = 15 * time.Second

// containerdKilledNRI: see the top of the file; on the first node.
func containerdKilledNRI(t *testing.T, e *env) {
	restartFlow{e: e, n: e.c, ns: testNS}.run(t)
}

// crioKilledNRI is containerdKilledNRI on the node whose runtime is CRI-O,
// which gives NRI plugins no PID at Synchronize either: the hook finds
// each running container's process in its cgroup to re-learn its claims.
func crioKilledNRI(t *testing.T, e *env) {
	n := e.crioWorker(t)
	e.nodesNamespace(t)
	restartFlow{e: e, n: n, ns: nodesNS}.run(t)
}

// restartFlow is the flow on one node: its runtime is killed, the
// flow's pods and claims are in namespace ns, its pods pinned to the node.
type restartFlow struct {
	e  *env
	n  *Cluster
	ns string
}

// q qualifies a pod's name with the flow's namespace.
func (f restartFlow) q(name string) string { return f.ns + "/" + name }

// in moves an object built by pvc or pod to the flow's namespace.
func (f restartFlow) in(o obj) obj {
	o["metadata"].(obj)["namespace"] = f.ns
	return o
}

// pod is a pod of the flow, on its node.
func (f restartFlow) pod(name string, opts ...podOpt) obj {
	return f.in(pod(name, append(opts, onNode(f.n.cfg.name()))...))
}

// pvc is a claim of the NRI class in the flow's namespace.
func (f restartFlow) pvc(name string) obj { return f.in(pvc(name, nriClass, "64Mi")) }

// pvOf is the volume of a claim of the flow.
func (f restartFlow) pvOf(t *testing.T, claim string) string {
	t.Helper()
	return f.e.pvOf(t, f.q(claim))
}

// polled hands the claims' volumes to the poller of the NRI flows, which
// watches the first node's mount table: on another node it has nothing to
// see.
func (f restartFlow) polled(t *testing.T, claims ...string) {
	t.Helper()
	if f.n != f.e.c {
		return
	}
	for _, c := range claims {
		f.e.nriPV(t, f.q(c))
	}
}

func (f restartFlow) run(t *testing.T) {
	e, rt := f.e, f.n.cfg.runtimeName()
	e.apply(t, e.nriStorageClass()) // the class as NRIPVC makes it (the flow may run without it)
	e.apply(t, f.pvc("rk1"), f.pvc("rk2"))
	e.run(t, f.syncWriter("rkw1", "rk1"), f.syncWriter("rkw2", "rk2"))
	f.polled(t, "rk1", "rk2")
	writers := map[string]*runningWriter{}
	sleep(time.Second) // a few writes
	for _, w := range []string{"rkw1", "rkw2"} {
		rw := &runningWriter{}
		rw.pid, rw.id = f.podInit(t, w)
		e.checkWrites(t, f.q(w), &rw.last)
		writers[w] = rw
	}
	f.wantClaimConsumers(t, "rk1", "rkw1")
	f.wantClaimConsumers(t, "rk2", "rkw2")

	// Down for a while; a pod of an existing claim (the writer's) and of a
	// new one is created meanwhile.
	o := f.outage(t, runtimeHold, writers, func() {
		e.apply(t, f.pvc("rk3"),
			f.pod("rknew", withClaim("rk1", "/shared", false), withClaim("rk3", "/data", false)))
		sleep(runtimeHold - 3*time.Second) // most of the outage, still held: kubelet has tried
		if phase := strings.TrimSpace(must(t)(e.c.kubectl("-n", f.ns, "get", "pod", "rknew", "-o", "jsonpath={.status.phase}"))); phase == "Running" {
			t.Errorf("rknew is Running while %s is down", rt)
		}
	})
	f.waitPodLong(t, "rknew", 4*time.Minute)
	ready := time.Now()
	o.log(t, rt, "held down")
	t.Logf("%s restart: the pod created during the outage Ready %v after the release (%v after %s serves again, %v after the hook registered)",
		rt, ready.Sub(o.released).Round(10*time.Millisecond), ready.Sub(o.serving).Round(10*time.Millisecond), rt, ready.Sub(o.registered).Round(10*time.Millisecond))
	if ev, err := e.c.kubectl("-n", f.ns, "get", "events", "--field-selector", "involvedObject.name=rknew",
		"-o", `go-template={{range .items}}{{.lastTimestamp}} {{.reason}} x{{.count}}: {{.message}}{{"\n"}}{{end}}`); err == nil {
		t.Logf("rknew's events (the release at %s):\n%s", o.released.UTC().Format(time.TimeOnly), ev)
	}
	f.wantSynchronized(t, o)
	f.wantWritersKept(t, writers, o)

	// The new pod has its volumes: the writer's (its log) and the new
	// claim's filesystem (lost+found), each a file system of a loop device,
	// and what it writes is seen by other pods of the same claims.
	e.wantFSInPod(t, f.q("rknew"), "/data", "ext4", "/dev/loop")
	e.wantFSInPod(t, f.q("rknew"), "/shared", "ext4", "/dev/loop")
	must(t)(e.c.podExec(f.q("rknew"), "test", "-d", "/data/lost+found"))
	if n, err := strconv.Atoi(strings.TrimSpace(must(t)(e.c.podExec(f.q("rknew"), "sh", "-c", "wc -l < /shared/log")))); err != nil || n < o.atRelease["rkw1"] {
		t.Errorf("rknew's /shared/log has %d lines (%v), rkw1 had written %d by the release", n, err, o.atRelease["rkw1"])
	}
	e.expect(t, f.q("rkw1"), "/data/marker", e.write(t, f.q("rknew"), "/shared/marker"))
	tok := e.write(t, f.q("rknew"), "/data/token")
	e.run(t, f.pod("rkcheck", withClaim("rk3", "/data", false)))
	e.expect(t, f.q("rkcheck"), "/data/token", tok)
	f.polled(t, "rk3")
	f.wantClaimConsumers(t, "rk1", "rkw1", "rknew")
	f.wantClaimConsumers(t, "rk2", "rkw2")
	f.wantClaimConsumers(t, "rk3", "rknew", "rkcheck")

	// Killed again and back at once. How soon the hook registers again
	// is logged, not asserted (a timing on a loaded machine; the reset of
	// its reconnect backoff after a registration, which keeps it short, is
	// internal/nri's TestReconnectStartsOverAfterARegistration).
	o2 := f.outage(t, 0, writers, func() {})
	o2.log(t, rt, "not held")
	f.wantSynchronized(t, o2)
	f.wantWritersKept(t, writers, o2)
	f.wantClaimConsumers(t, "rk1", "rkw1", "rknew")
	f.wantClaimConsumers(t, "rk2", "rkw2")
	f.wantClaimConsumers(t, "rk3", "rknew", "rkcheck")
	e.write(t, f.q("rkcheck"), "/data/token") // the runtime creates exec processes again

	// Gone with their pods: no consumer, then no record.
	vols := []string{f.pvOf(t, "rk1"), f.pvOf(t, "rk2"), f.pvOf(t, "rk3")}
	e.c.deleteInAndWait(t, f.ns, "pod", "rknew", "rkcheck", "rkw1", "rkw2")
	for _, c := range []string{"rk1", "rk2", "rk3"} {
		f.wantClaimConsumers(t, c)
	}
	e.c.deleteInAndWait(t, f.ns, "pvc", "rk1", "rk2", "rk3")
	waitFor(t, 90*time.Second, "the records of the flow's volumes removed", func() error {
		for _, v := range vols {
			if _, err := os.Stat(f.n.seen(e.c.cfg.path("state", "volumes", v+".json"))); err == nil {
				return fmt.Errorf("record of %s left", v)
			}
		}
		return nil
	})
}

// syncWriter is writer with an fsync of the file after each line.
func (f restartFlow) syncWriter(name, claim string) obj {
	return f.pod(name, withClaim(claim, "/data", false), withScript(
		"trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); { echo $i >> /data/log && sync /data/log; } || echo $i >> /tmp/failed; sleep 0.1; done"))
}

// runningWriter is a writer pod's container: its first process (host PID),
// its ID and the last count checkWrites saw.
type runningWriter struct {
	pid  int
	id   string
	last int
}

// outage is what restartFlow.outage measured.
type outage struct {
	killed, released, serving, registered time.Time
	hold                                  time.Duration
	atKill, atRelease                     map[string]int // lines in each writer's log
}

func (o outage) log(t *testing.T, runtime, how string) {
	t.Helper()
	t.Logf("%s killed (%s %v): serving again %v after the kill (%v after the release); the hook registered %v after the kill, %v after it served; lines written during the outage: %v (at the kill: %v)",
		runtime, how, o.hold, o.serving.Sub(o.killed).Round(10*time.Millisecond), o.serving.Sub(o.released).Round(10*time.Millisecond),
		o.registered.Sub(o.killed).Round(10*time.Millisecond), o.registered.Sub(o.serving).Round(10*time.Millisecond), o.duringOutage(), o.atKill)
}

func (o outage) duringOutage() map[string]int {
	d := map[string]int{}
	for w, n := range o.atRelease {
		d[w] = n - o.atKill[w]
	}
	return d
}

// outage kills the node's runtime (SIGKILL), keeps the node from
// restarting it for hold, runs during meanwhile, and waits until the
// runtime serves again and the mounter's hook has registered with it.
// The writers' logs are counted through their containers' roots, which
// needs no runtime.
func (f restartFlow) outage(t *testing.T, hold time.Duration, writers map[string]*runningWriter, during func()) outage {
	t.Helper()
	o := outage{hold: hold}
	rt := f.n.cfg.runtimeName()
	pid := f.n.pidOf(t, rt)
	held := f.n.cfg.holdPath(rt)
	if hold > 0 {
		if err := os.WriteFile(held, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(held) // a failure below must not leave the node without a runtime
	}
	o.atKill = writtenLines(t, writers)
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	o.killed = time.Now()
	waitFor(t, 10*time.Second, rt+" gone", func() error {
		if unix.Kill(pid, 0) == nil {
			return fmt.Errorf("%s %d still there", rt, pid)
		}
		return nil
	})
	during()
	if hold > 0 {
		time.Sleep(time.Until(o.killed.Add(hold)))
		if slices.Contains(slices.Collect(maps.Values(f.n.procs())), rt) {
			t.Fatalf("%s restarted while held down", rt)
		}
		o.atRelease = writtenLines(t, writers)
		if err := os.Remove(held); err != nil {
			t.Fatal(err)
		}
	}
	o.released = time.Now()
	waitFor(t, 60*time.Second, rt+" serving again", func() error {
		c, err := net.DialTimeout("unix", f.n.cfg.runtimeSocket(), time.Second)
		if err == nil {
			c.Close()
		}
		return err
	})
	o.serving = time.Now()
	if hold == 0 {
		o.atRelease = writtenLines(t, writers)
	}
	waitFor(t, 90*time.Second, "the mounter's hook registered with the new "+rt, func() error {
		at, _, err := f.mounterLogAfter(o.killed, "Registered with the runtime")
		o.registered = at
		return err
	})
	// kubelet's connection to the runtime comes back on gRPC's reconnect
	// backoff, which can outlast the hook's (it answers Unavailable,
	// "connection refused", meanwhile); exec and the checks after need it.
	waitFor(t, 60*time.Second, "kubelet's exec through the new "+rt, func() error {
		for name := range writers {
			if out, err := f.e.c.podExec(f.q(name), "true"); err != nil {
				return fmt.Errorf("%v: %s", err, out)
			}
		}
		return nil
	})
	return o
}

// writtenLines counts the lines of each writer's log, read through its
// container's root (/proc/PID/root).
func writtenLines(t *testing.T, writers map[string]*runningWriter) map[string]int {
	t.Helper()
	n := map[string]int{}
	for name, w := range writers {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/root/data/log", w.pid))
		if err != nil {
			t.Fatalf("%s's log through its container's root: %v", name, err)
		}
		n[name] = strings.Count(string(b), "\n")
	}
	return n
}

// wantWritersKept: each writer's container is the one from before (same
// process, no restart), its volume still ext4 of a loop device, it wrote
// during the outage, and no write failed or went missing.
func (f restartFlow) wantWritersKept(t *testing.T, writers map[string]*runningWriter, o outage) {
	t.Helper()
	for name, w := range writers {
		if pid, id := f.podInit(t, name); pid != w.pid || id != w.id {
			t.Errorf("%s runs container %s (pid %d), was %s (pid %d)", name, id, pid, w.id, w.pid)
		}
		if n := strings.TrimSpace(must(t)(f.e.c.kubectl("-n", f.ns, "get", "pod", name, "-o", "jsonpath={.status.containerStatuses[0].restartCount}"))); n != "0" {
			t.Errorf("%s restarted %s times", name, n)
		}
		if d := o.atRelease[name] - o.atKill[name]; d <= 0 && o.hold > 0 {
			t.Errorf("%s wrote nothing during the %v outage (%d lines at the kill, %d at the release)", name, o.hold, o.atKill[name], o.atRelease[name])
		}
		f.e.wantFSInPod(t, f.q(name), "/data", "ext4", "/dev/loop")
		f.e.checkWrites(t, f.q(name), &w.last)
	}
}

// wantSynchronized: after registering, the hook synchronized with the
// runtime (the log line comes at Synchronize's end, after the claims of
// every container were re-learned).
func (f restartFlow) wantSynchronized(t *testing.T, o outage) {
	t.Helper()
	waitFor(t, 30*time.Second, "the hook's Synchronize after its registration", func() error {
		_, line, err := f.mounterLogAfter(o.registered.Add(-time.Millisecond), "Synchronized with the runtime")
		if err == nil {
			t.Logf("after the restart: %s", line)
		}
		return err
	})
}

// podInit finds a pod's container (its ID from the pod's status) and the
// host PID of its first process (by its cgroup, see containerCgroup, and
// PID 1 in its namespace).
func (f restartFlow) podInit(t *testing.T, pod string) (pid int, id string) {
	t.Helper()
	waitFor(t, 30*time.Second, "the first process of pod "+pod, func() error {
		out, err := f.e.c.kubectl("-n", f.ns, "get", "pod", pod, "-o", "jsonpath={.status.containerStatuses[0].containerID}")
		if err != nil {
			return err
		}
		if _, id, _ = strings.Cut(strings.TrimSpace(out), "://"); id == "" {
			return fmt.Errorf("no container ID in %q", out)
		}
		var pids []int
		for p := range f.n.procs() {
			cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", p))
			st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", p))
			if strings.Contains(string(cg), f.n.cfg.containerCgroup(id)) && nsPID(string(st)) == 1 {
				pids = append(pids, p)
			}
		}
		if len(pids) != 1 {
			return fmt.Errorf("%d first processes of container %s: %v", len(pids), id, pids)
		}
		pid = pids[0]
		return nil
	})
	return pid, id
}

// nsPID is a process's PID in its own PID namespace, from its status.
func nsPID(status string) int {
	for _, l := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(l, "NSpid:"); ok {
			f := strings.Fields(v)
			if len(f) > 0 {
				n, _ := strconv.Atoi(f[len(f)-1])
				return n
			}
		}
	}
	return 0
}

// wantClaimConsumers waits until the plugin's record of a claim's volume
// names exactly the containers of pods as its consumers: a claim of a
// container that is gone is leaked, one of a running container dropped.
func (f restartFlow) wantClaimConsumers(t *testing.T, claim string, pods ...string) {
	t.Helper()
	var want []string
	for _, p := range pods {
		_, id := f.podInit(t, p)
		want = append(want, id)
	}
	slices.Sort(want)
	vol := f.pvOf(t, claim)
	waitFor(t, 30*time.Second, fmt.Sprintf("the consumers of %s: the containers of %v", claim, pods), func() error {
		got, err := f.e.containerConsumersOn(f.n, vol)
		if err != nil {
			return err
		}
		slices.Sort(got)
		if !slices.Equal(got, want) {
			return fmt.Errorf("consumers %v, want %v", got, want)
		}
		return nil
	})
}

// waitPodLong waits for a pod's Ready condition for up to d.
func (f restartFlow) waitPodLong(t *testing.T, pod string, d time.Duration) {
	t.Helper()
	waitFor(t, d, "pod "+pod+" Ready", func() error {
		out, err := f.e.c.kubectl("-n", f.ns, "get", "pod", pod, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "True" {
			desc, _ := f.e.c.kubectl("-n", f.ns, "describe", "pod", pod)
			return fmt.Errorf("Ready=%q\n%s", out, lastLines(desc, 12))
		}
		return nil
	})
}

// criLogLine is a line of a container's log as the runtime writes it:
// time, stream, full or partial, the line.
var criLogLine = regexp.MustCompile(`^(\S+) (?:stdout|stderr) [FP] (.*)$`)

// mounterLogAfter finds the first line of the node's mounter containers'
// logs (kubelet's log directory, as the runtime writes them) stamped after
// since that contains what; it returns the line's time.
func (f restartFlow) mounterLogAfter(since time.Time, what string) (time.Time, string, error) {
	files, _ := filepath.Glob(f.n.cfg.path("log", "pods", "kube-system_mountplan-mounter-*", mounterContainer, "*.log"))
	first, line := time.Time{}, ""
	for _, f := range files {
		fh, err := os.Open(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
		for sc.Scan() {
			m := criLogLine.FindStringSubmatch(sc.Text())
			if m == nil || !strings.Contains(m[2], what) {
				continue
			}
			at, err := time.Parse(time.RFC3339Nano, m[1])
			if err == nil && at.After(since) && (first.IsZero() || at.Before(first)) {
				first, line = at, m[2]
			}
		}
		fh.Close()
	}
	if first.IsZero() {
		return first, "", fmt.Errorf("no %q in the mounter's log (%d files) after %s", what, len(files), since.Format(time.RFC3339Nano))
	}
	return first, line, nil
}
