//go:build clustertest

package cluster

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/internal/testenv"
)

// crioPending keeps NRIOnCRIO from running when no node runs CRI-O.
func crioPending() string {
	if crioWanted() {
		return ""
	}
	return "no node runs CRI-O: " + envCRIO + "=0 (see crioWanted)"
}

// crioWorker is the worker that runs CRI-O.
func (e *env) crioWorker(t *testing.T) *Cluster {
	t.Helper()
	for _, w := range e.c.workers {
		if w.cfg.crio() {
			return w
		}
	}
	testenv.Missing(t, "a cluster of %d nodes or more: node %d runs CRI-O (%s=%d)", crioNode, crioNode, envNodes, len(e.c.nodes()))
	return nil
}

// nriOnCRIO: on the node whose runtime is CRI-O, a pod's claim of the NRI
// class reaches its container through the mounter's hook there: the
// volume in the container, the guard at kubelet's target in the node's
// mount table and nothing of the volume mounted beside it; the container
// recorded with its namespace (CRI-O gives NRI plugins no PID: the hook
// finds the container's process in its cgroup); subPaths mounted in the
// container at its start, which needs that process too. A pod deleted, its
// claims are released; the next pod finds the data. The chart is the same on every
// node: only the runtime differs.
func nriOnCRIO(t *testing.T, e *env) {
	n := e.crioWorker(t)
	e.nodesNamespace(t)
	e.apply(t, e.nriStorageClass())
	e.apply(t, inNodesNS(pvc("crio", nriClass, "64Mi")))
	e.run(t, inNodesNS(pod("crio1", withClaim("crio", "/data", false), onNode(n.cfg.name()))))
	if got := e.podNode(t, nodesNS+"/crio1"); got != n.cfg.name() {
		t.Fatalf("crio1 runs on %s, want %s", got, n.cfg.name())
	}
	e.wantFSInPod(t, nodesNS+"/crio1", "/data", "ext4", "/dev/loop")
	tok := e.write(t, nodesNS+"/crio1", "/data/token")

	pv := e.pvOf(t, nodesNS+"/crio")
	mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", n.nodePID()))
	if err != nil {
		t.Fatal(err)
	}
	var atTarget []string
	for _, l := range strings.Split(string(mi), "\n") {
		if strings.Contains(l, "/"+pv+"/mount ") {
			atTarget = append(atTarget, l)
		}
		if strings.Contains(l, " - ext4 /dev/loop") && strings.Contains(l, "/kubelet/") {
			t.Errorf("the volume is mounted in the CRI-O node's mount table: %s", l)
		}
	}
	if len(atTarget) != 1 || !strings.Contains(atTarget[0], " - "+guard.FSType+" ") {
		t.Errorf("kubelet's target of %s in the CRI-O node's mount table: %q, want the guard alone", pv, atTarget)
	}
	consumers := func(want int) {
		t.Helper()
		waitFor(t, 30*time.Second, fmt.Sprintf("%d container consumers of %s on %s", want, pv, n.cfg.name()), func() error {
			ids, err := e.containerConsumersOn(n, pv)
			if err != nil {
				return err
			}
			if len(ids) != want {
				return fmt.Errorf("%d container consumers: %v", len(ids), ids)
			}
			return nil
		})
	}
	consumers(1)

	// subPaths: the mounter mounts them in the container at its start,
	// which needs the container's process (found in its cgroup).
	sub := token()
	must(t)(e.c.podExec(nodesNS+"/crio1", "sh", "-c", "mkdir -p /data/dir && echo "+sub+" > /data/dir/token"))
	e.run(t, inNodesNS(pod("crio-sub", onNode(n.cfg.name()), func(spec, ctr obj) {
		addVolume(spec, obj{"name": "v", "persistentVolumeClaim": obj{"claimName": "crio"}})
		addMount(ctr, obj{"name": "v", "mountPath": "/sub", "subPath": "dir"})
		addMount(ctr, obj{"name": "v", "mountPath": "/new", "subPath": "made/here"})
	})))
	e.expect(t, nodesNS+"/crio-sub", "/sub/token", sub)
	made := e.write(t, nodesNS+"/crio-sub", "/new/file")
	e.expect(t, nodesNS+"/crio1", "/data/made/here/file", made)
	consumers(3) // crio1's container, and one per mount point of crio-sub's

	deletePod := func(name string) {
		t.Helper()
		must(t)(e.c.kubectl("-n", nodesNS, "delete", "pod", name, "--wait=true", "--timeout=120s"))
	}
	deletePod("crio-sub")
	consumers(1)
	deletePod("crio1")
	consumers(0)
	e.run(t, inNodesNS(pod("crio2", withClaim("crio", "/data", false), onNode(n.cfg.name()))))
	e.expect(t, nodesNS+"/crio2", "/data/token", tok)
	consumers(1)
	deletePod("crio2")
	consumers(0)
}
