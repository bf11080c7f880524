//go:build clustertest

package cluster

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
)

// nriGrowClass is an NRI class that allows expansion.
const nriGrowClass = "mountplan-nri-grow"

// nriSidecarsAndExpand: one NRI claim shared by an init container, a native
// sidecar (an init container that keeps running) and the main container.
// The init container's write is there for the others; the sidecar and the
// main container see one filesystem (the sidecar's appends reach the main
// container); the claim grows online while both run and both see the new
// size (the mounter grows the filesystem through a private mount of the
// same superblock, since nothing is mounted on the node; xfs, since ext4's
// online growth needs CAP_SYS_RESOURCE, which this machine's containers
// lack: see expandExt4); the sidecar,
// restarted by kubelet, gets the volume back (its new generation's writes
// reach the main container), and the plugin counts the running containers
// as consumers, the dead sidecar's claim released.
func nriSidecarsAndExpand(t *testing.T, e *env) {
	e.apply(t, obj{"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": obj{"name": nriGrowClass},
		"provisioner": e.driverName, "parameters": obj{"nri": "true", "csi.storage.k8s.io/fstype": "xfs"}, "volumeBindingMode": "WaitForFirstConsumer",
		"reclaimPolicy": "Delete", "allowVolumeExpansion": true})
	e.apply(t, pvc("nside", nriGrowClass, "300Mi"))
	mount := []obj{{"name": "v", "mountPath": "/data"}}
	ctr := func(name, script string) obj {
		return obj{"name": name, "image": busyboxImage, "imagePullPolicy": "Never", "command": []string{"sh", "-c", script}, "volumeMounts": mount}
	}
	initc := ctr("init", "echo init > /data/init && sync")
	// The sidecar appends its generation (a fresh random number per start)
	// until /data/stop appears, which it removes before it exits: kubelet
	// restarts a native sidecar whatever its exit code.
	sidecar := ctr("sidecar", `gen=$(od -An -N4 -tu4 /dev/urandom | tr -d ' '); trap 'exit 0' TERM
while [ ! -e /data/stop ]; do echo $gen >> /data/sidecar; sync; sleep 0.2; done; rm /data/stop; exit 1`)
	sidecar["restartPolicy"] = "Always"
	main := ctr("c", "trap 'exit 0' TERM; while true; do sleep 1; done")
	e.run(t, obj{"apiVersion": "v1", "kind": "Pod", "metadata": obj{"name": "nside", "namespace": testNS},
		"spec": obj{"initContainers": []obj{initc, sidecar}, "containers": []obj{main}, "terminationGracePeriodSeconds": 2,
			"volumes": []obj{{"name": "v", "persistentVolumeClaim": obj{"claimName": "nside"}}}}})
	e.nriPV(t, "nside")
	for _, c := range []string{"sidecar", "c"} {
		e.wantFSInContainer(t, "nside", c, "/data", "xfs", "/dev/loop")
	}
	if got := e.inContainer(t, "nside", "c", "cat", "/data/init"); strings.TrimSpace(got) != "init" {
		t.Errorf("the main container reads %q in the init container's file", got)
	}
	first := e.sidecarGenerations(t, 1)[0]
	e.wantContainerConsumers(t, "nside", 2)

	before := map[string]int{}
	for _, c := range []string{"sidecar", "c"} {
		before[c] = e.dfKiB(t, "nside", c, "/data")
	}
	e.resize(t, "nside", "600Mi")
	e.waitCapacity(t, "nside", "600Mi")
	for _, c := range []string{"sidecar", "c"} {
		if after := e.dfKiB(t, "nside", c, "/data"); after < before[c]+250*1024 {
			t.Errorf("container %s: filesystem %d KiB after the resize, was %d", c, after, before[c])
		}
	}

	restarts := e.restartCount(t, "nside", "sidecar")
	e.inContainer(t, "nside", "c", "touch", "/data/stop")
	waitFor(t, 90*time.Second, "the sidecar restarted", func() error {
		if n := e.restartCount(t, "nside", "sidecar"); n <= restarts {
			return fmt.Errorf("sidecar restartCount %d", n)
		}
		return nil
	})
	gens := e.sidecarGenerations(t, 2)
	if gens[0] != first {
		t.Errorf("sidecar generations %v, want %s first", gens, first)
	}
	e.wantFSInContainer(t, "nside", "sidecar", "/data", "xfs", "/dev/loop")
	e.wantContainerConsumers(t, "nside", 2)
	e.c.deleteAndWait(t, "pod", "nside")
	e.c.deleteAndWait(t, "pvc", "nside")
}

// inContainer runs a command in one container of a pod of the test namespace.
func (e *env) inContainer(t *testing.T, pod, ctr string, cmd ...string) string {
	t.Helper()
	return must(t)(e.c.kubectl(append([]string{"-n", testNS, "exec", pod, "-c", ctr, "--"}, cmd...)...))
}

// wantFSInContainer checks what is mounted at dir in one container.
func (e *env) wantFSInContainer(t *testing.T, pod, ctr, dir, fsType, sourcePrefix string) {
	t.Helper()
	fs, src := mountAt(e.inContainer(t, pod, ctr, "cat", "/proc/self/mountinfo"), dir)
	if fs != fsType || !strings.HasPrefix(src, sourcePrefix) {
		t.Errorf("%s in container %s of %s is %s from %s, want %s from %s*", dir, ctr, pod, fs, src, fsType, sourcePrefix)
	}
}

// dfKiB is the size of the filesystem at path in one container.
func (e *env) dfKiB(t *testing.T, pod, ctr, path string) int {
	t.Helper()
	out := e.inContainer(t, pod, ctr, "df", "-k", path)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	f := strings.Fields(lines[len(lines)-1])
	if len(f) < 2 {
		t.Fatalf("df: %s", out)
	}
	n, err := strconv.Atoi(f[1])
	if err != nil {
		t.Fatalf("df: %s", out)
	}
	return n
}

// restartCount is the restart count of a (native sidecar) init container.
func (e *env) restartCount(t *testing.T, pod, ctr string) int {
	t.Helper()
	out := must(t)(e.c.kubectl("-n", testNS, "get", "pod", pod, "-o",
		fmt.Sprintf(`jsonpath={.status.initContainerStatuses[?(@.name=="%s")].restartCount}`, ctr)))
	n, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("restartCount of %s: %q", ctr, out)
	}
	return n
}

// sidecarGenerations waits until the main container reads at least n
// generations of the sidecar in /data/sidecar, and returns them in order.
func (e *env) sidecarGenerations(t *testing.T, n int) []string {
	t.Helper()
	var gens []string
	waitFor(t, 60*time.Second, fmt.Sprintf("%d sidecar generations in /data/sidecar", n), func() error {
		out, err := e.c.kubectl("-n", testNS, "exec", "nside", "-c", "c", "--", "cat", "/data/sidecar")
		if err != nil {
			return err
		}
		gens = gens[:0]
		for _, l := range strings.Fields(out) {
			if len(gens) == 0 || gens[len(gens)-1] != l {
				gens = append(gens, l)
			}
		}
		if len(gens) < n {
			return fmt.Errorf("generations %v", gens)
		}
		return nil
	})
	return gens
}

// nriStatsAllStopped: kubelet's volume stats of an NRI claim whose only
// container has exited and waits out its CrashLoopBackOff. Nothing of the
// volume is mounted in any container then (kubelet keeps the pod's volumes
// between restarts), so the plugin measures it through the mounter's
// private mount of its device. kubelet's stats summary must hold the
// claim's bytes from a measurement taken while no container ran: after the
// container's last exit and before its next start.
func nriStatsAllStopped(t *testing.T, e *env) {
	e.c.deleteAtEnd(t, "pod", "nstop")
	e.c.deleteAtEnd(t, "pvc", "nstop")
	e.apply(t, e.nriStorageClass(), pvc("nstop", nriClass, "64Mi"))
	e.apply(t, pod("nstop", withClaim("nstop", "/data", false),
		withScript("dd if=/dev/urandom of=/data/blob bs=1M count=16 && sync && sleep 2; exit 1")))
	waitFor(t, 2*time.Minute, "pod nstop in CrashLoopBackOff", func() error {
		st := e.crashStatus(t, "nstop")
		if st.waiting != "CrashLoopBackOff" {
			return fmt.Errorf("container c: waiting %q, %d restarts", st.waiting, st.restarts)
		}
		return nil
	})
	e.nriPV(t, "nstop")

	var got volumeSummary
	waitFor(t, 3*time.Minute, "kubelet's stats of claim nstop taken while its container was stopped", func() error {
		v, err := e.summaryOf("nstop", "nstop")
		if err != nil {
			return err
		}
		// Read after the summary: the container must have exited before the
		// measurement and not have started again until after it. The
		// status's times are whole seconds, cut down: an exit shown at s
		// happened before s+1.
		st := e.crashStatus(t, "nstop")
		if st.finished.IsZero() || !v.Time.After(st.finished.Add(time.Second)) {
			return fmt.Errorf("stats taken at %v, container last exited at %v", v.Time, st.finished)
		}
		if st.waiting == "" && !st.started.After(v.Time) {
			return fmt.Errorf("stats taken at %v, container running since %v", v.Time, st.started)
		}
		got = v
		return nil
	})
	if got.UsedBytes < 16<<20 || got.CapacityBytes < 48<<20 || got.Inodes == 0 {
		t.Errorf("stats of claim nstop with its container stopped: used %d, capacity %d, inodes %d; want at least 16 MiB used of about 64 MiB",
			got.UsedBytes, got.CapacityBytes, got.Inodes)
	}
	t.Logf("kubelet's stats of nstop at %v, with no container running: %d bytes used of %d", got.Time, got.UsedBytes, got.CapacityBytes)
	e.c.deleteAndWait(t, "pod", "nstop")
	e.c.deleteAndWait(t, "pvc", "nstop")
}

// crashState is what the pod's status says of its container c.
type crashState struct {
	waiting           string // reason while waiting
	restarts          int
	finished, started time.Time // its last exit; its current run's start
}

func (e *env) crashStatus(t *testing.T, pod string) crashState {
	t.Helper()
	out := must(t)(e.c.kubectl("-n", testNS, "get", "pod", pod, "-o", "jsonpath={.status.containerStatuses[0]}"))
	var s struct {
		RestartCount int
		State        struct {
			Waiting *struct{ Reason string }
			Running *struct{ StartedAt time.Time }
		}
		LastState struct {
			Terminated *struct{ FinishedAt time.Time }
		}
	}
	if out != "" {
		if err := json.Unmarshal([]byte(out), &s); err != nil {
			t.Fatalf("status of %s: %v: %s", pod, err, out)
		}
	}
	st := crashState{restarts: s.RestartCount}
	if s.State.Waiting != nil {
		st.waiting = s.State.Waiting.Reason
	}
	if s.State.Running != nil {
		st.started = s.State.Running.StartedAt
	}
	if s.LastState.Terminated != nil {
		st.finished = s.LastState.Terminated.FinishedAt
	}
	return st
}

// volumeSummary is a volume's entry in kubelet's stats summary.
type volumeSummary struct {
	Time          time.Time
	UsedBytes     int64
	CapacityBytes int64
	Inodes        int64
	PVCRef        *struct{ Name, Namespace string }
}

// summaryOf reads kubelet's stats summary (through the API server) and
// returns the entry of a pod's volume that is the claim.
func (e *env) summaryOf(pod, claim string) (volumeSummary, error) {
	out, err := e.c.kubectl("get", "--raw", "/api/v1/nodes/"+nodeName+"/proxy/stats/summary")
	if err != nil {
		return volumeSummary{}, err
	}
	var s struct {
		Pods []struct {
			PodRef struct{ Name, Namespace string }
			Volume []volumeSummary
		}
	}
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		return volumeSummary{}, err
	}
	for _, p := range s.Pods {
		if p.PodRef.Name != pod || p.PodRef.Namespace != testNS {
			continue
		}
		for _, v := range p.Volume {
			if v.PVCRef != nil && v.PVCRef.Name == claim && v.PVCRef.Namespace == testNS {
				return v, nil
			}
		}
		return volumeSummary{}, fmt.Errorf("pod %s: no stats of claim %s among %d volumes", pod, claim, len(p.Volume))
	}
	return volumeSummary{}, fmt.Errorf("no stats of pod %s", pod)
}
