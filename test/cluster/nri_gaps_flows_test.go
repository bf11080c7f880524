//go:build clustertest

package cluster

import (
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
