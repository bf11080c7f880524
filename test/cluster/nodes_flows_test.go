//go:build clustertest

package cluster

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/testenv"
)

// nodesNS is the namespace of the flows that place pods on several nodes:
// unlike testNS, it keeps its pods on no node of its own.
const nodesNS = "mp-nodes"

// inNodesNS moves an object built by pvc, pod or statefulSet to nodesNS.
func inNodesNS(o obj) obj {
	o["metadata"].(obj)["namespace"] = nodesNS
	return o
}

// onNode puts a pod on a node (the scheduler's nodeSelector, not nodeName:
// the scheduler still checks the pod's claims against the node).
func onNode(node string) podOpt {
	return func(spec, _ obj) { spec["nodeSelector"] = obj{"kubernetes.io/hostname": node} }
}

// notOnNode keeps a pod off a node.
func notOnNode(node string) podOpt {
	return func(spec, _ obj) {
		spec["affinity"] = obj{"nodeAffinity": obj{"requiredDuringSchedulingIgnoredDuringExecution": obj{
			"nodeSelectorTerms": []obj{{"matchExpressions": []obj{{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": []string{node}}}}}}}}
	}
}

// workers are the cluster's second and third nodes; a flow that needs them
// fails under CI=true on a smaller cluster.
func (e *env) workers(t *testing.T) (a, b *Cluster) {
	t.Helper()
	if len(e.c.workers) < 2 {
		testenv.Missing(t, "a cluster of 3 nodes or more (%s=%d)", envNodes, len(e.c.nodes()))
	}
	return e.c.workers[0], e.c.workers[1]
}

// nodesNamespace makes nodesNS for a flow and deletes it when the flow
// ends, passed or not; then no PV or snapshot content of it may be left,
// and the workers must hold nothing of its volumes.
func (e *env) nodesNamespace(t *testing.T) {
	t.Helper()
	createNamespace(t, e.c, nodesNS, "")
	t.Cleanup(func() {
		if out, err := e.c.kubectl("delete", "namespace", nodesNS, "--wait=true", "--timeout=180s"); err != nil {
			t.Errorf("delete namespace %s: %v\n%s", nodesNS, err, out)
		}
		waitFor(t, 2*time.Minute, "the volumes and snapshot contents of "+nodesNS+" deleted", func() error {
			var left []string
			for _, q := range []struct{ kind, ns string }{
				{"pv", "{.spec.claimRef.namespace}"},
				{"volumesnapshotcontent", "{.spec.volumeSnapshotRef.namespace}"},
			} {
				out, err := e.c.kubectl("get", q.kind, "-o", `jsonpath={range .items[*]}{.metadata.name} `+q.ns+`{"\n"}{end}`)
				if err != nil {
					return err
				}
				for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
					if name, ns, _ := strings.Cut(l, " "); ns == nodesNS {
						left = append(left, q.kind+"/"+name)
					}
				}
			}
			if len(left) > 0 {
				return fmt.Errorf("left: %v", left)
			}
			return nil
		})
		for _, w := range e.c.workers {
			e.checkCleanOn(t, w, true)
		}
	})
}

// podNode is the node a pod was scheduled to.
func (e *env) podNode(t *testing.T, pod string) string {
	t.Helper()
	ns, name := qualified(pod)
	return strings.TrimSpace(must(t)(e.c.kubectl("-n", ns, "get", "pod", name, "-o", "jsonpath={.spec.nodeName}")))
}

// claimNode is the node a claim's volume is pinned to (its PV's node
// affinity, which the plugin's topology makes).
func (e *env) claimNode(t *testing.T, ns, claim string) string {
	t.Helper()
	pv := strings.TrimSpace(must(t)(e.c.kubectl("-n", ns, "get", "pvc", claim, "-o", "jsonpath={.spec.volumeName}")))
	return strings.TrimSpace(must(t)(e.c.kubectl("get", "pv", pv, "-o",
		"jsonpath={.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].values[0]}")))
}

// capacityAcrossNodes: each worker's state dir is a small filesystem of its
// own (node A 512 MiB, node B 1 GiB), whose free bytes its provisioner
// publishes. A claim on A is written until A has less room than the next
// claim asks; the next pod, which may go to A or B, starts on B without a
// failed provisioning on A; a claim bigger than every node's room stays
// Pending with the scheduler's reason naming every node, and no node's
// plugin is ever asked for it.
func capacityAcrossNodes(t *testing.T, e *env) {
	a, b := e.workers(t)
	e.nodesNamespace(t)
	roomA, roomB := e.waitCapacityMatchesFree(t, a), e.waitCapacityMatchesFree(t, b)

	// The claim's own filesystem takes its share (ext4's journal, its
	// reserved blocks): the file is well below the claim's size.
	fill := roomA * 5 / 8 >> 20
	e.apply(t, inNodesNS(pvc("fill", storageClass, fmt.Sprintf("%dMi", roomA*7/8>>20))))
	e.run(t, inNodesNS(pod("fill", withClaim("fill", "/data", false), onNode(a.cfg.name()))))
	start := time.Now()
	must(t)(e.c.podExec(nodesNS+"/fill", "dd", "if=/dev/zero", "of=/data/fill", "bs=1M", fmt.Sprint("count=", fill), "conv=fsync"))
	next := roomA / 2 >> 20
	if next<<20 >= roomB {
		t.Fatalf("node %s has %d MiB of room, node %s %d MiB: no claim fits B and not A", a.cfg.name(), roomA>>20, b.cfg.name(), roomB>>20)
	}
	waitFor(t, 3*time.Minute, "node "+a.cfg.name()+"'s capacity below the next claim's size", func() error {
		c, err := e.nodeCapacity(a.cfg.name())
		if err != nil {
			return err
		}
		if c.Capacity.Value() >= next<<20 {
			return fmt.Errorf("%s holds %d MiB", c.Name, c.Capacity.Value()>>20)
		}
		t.Logf("%d MiB written on %s: its capacity went from %d to %d MiB in %v", fill, a.cfg.name(), roomA>>20, c.Capacity.Value()>>20, time.Since(start).Round(time.Second))
		return nil
	})

	// The first node's room is the host's: the pod keeps off it, so that
	// only the workers' rooms decide.
	e.apply(t, inNodesNS(pvc("next", storageClass, fmt.Sprintf("%dMi", next))))
	e.run(t, inNodesNS(pod("next", withClaim("next", "/data", false), notOnNode(nodeName))))
	if got := e.podNode(t, nodesNS+"/next"); got != b.cfg.name() {
		t.Errorf("pod next (a %d MiB claim) runs on %s, want %s (the only node with room)", next, got, b.cfg.name())
	}
	if got := e.claimNode(t, nodesNS, "next"); got != b.cfg.name() {
		t.Errorf("claim next's volume is on %s, want %s", got, b.cfg.name())
	}
	if r := provisioningEvents(t, e, nodesNS, "next"); slices.Contains(r, "ProvisioningFailed") {
		t.Errorf("claim next had a failed provisioning: %v", r)
	}
	e.write(t, nodesNS+"/next", "/data/token")

	// Bigger than every node's room, the host's too.
	var most int64
	for _, n := range e.c.nodes() {
		c, err := e.nodeCapacity(n.cfg.name())
		if err != nil {
			t.Fatal(err)
		}
		most = max(most, c.Capacity.Value())
	}
	huge := fmt.Sprintf("%dGi", most/gib+32)
	e.apply(t, inNodesNS(pvc("huge", storageClass, huge)), inNodesNS(pod("huge", withClaim("huge", "/data", false))))
	want := fmt.Sprintf("%d node(s) did not have enough free storage", len(e.c.nodes()))
	waitFor(t, 90*time.Second, "pod huge unschedulable on every node for want of storage", func() error {
		out, err := e.c.kubectl("-n", nodesNS, "get", "pod", "huge", "-o",
			`jsonpath={.status.phase} {.status.conditions[?(@.type=="PodScheduled")].reason}: {.status.conditions[?(@.type=="PodScheduled")].message}`)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(out, "Pending Unschedulable") || !strings.Contains(out, want) {
			return fmt.Errorf("pod huge: %s", out)
		}
		t.Logf("a %s claim on %d nodes with at most %d MiB of room: %s", huge, len(e.c.nodes()), most>>20, out)
		return nil
	})
	e.checkNeverProvisioned(t, nodesNS, "huge", "next", b.cfg.name())
}

// snapshotsStayOnTheirNode: a snapshot of a claim on node B lives on B
// (its ID names B); a claim restored from it for a pod on B is made there
// and holds the snapshot's data; one restored for a pod pinned to node A
// is refused by A's plugin (ResourceExhausted naming B, as CSI says of a
// topology it cannot provision in), stays Pending and leaves nothing on
// A, and the same claim then serves a pod placed on B (issue 37: NotFound
// left it A's for good, the deadlock of csi-driver-host-path #651). A
// restore whose pod is placed nowhere in particular is sent back by every
// node without the snapshot; the scheduler does not learn where it is.
func snapshotsStayOnTheirNode(t *testing.T, e *env) {
	a, b := e.workers(t)
	e.nodesNamespace(t)
	e.apply(t, inNodesNS(pvc("src", storageClass, "64Mi")))
	e.run(t, inNodesNS(pod("src", withClaim("src", "/data", false), onNode(b.cfg.name()))))
	tok := e.write(t, nodesNS+"/src", "/data/token")
	e.apply(t, obj{"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
		"metadata": obj{"name": "snap", "namespace": nodesNS},
		"spec":     obj{"volumeSnapshotClassName": snapshotClass, "source": obj{"persistentVolumeClaimName": "src"}}})
	e.waitSnapshotReady(t, nodesNS+"/snap")

	restore := func(name string) obj {
		c := inNodesNS(pvc(name, storageClass, "64Mi"))
		c["spec"].(obj)["dataSource"] = obj{"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"}
		return c
	}
	e.apply(t, restore("here"))
	e.run(t, inNodesNS(pod("here", withClaim("here", "/data", false), onNode(b.cfg.name()))))
	e.expect(t, nodesNS+"/here", "/data/token", tok)
	if got := e.claimNode(t, nodesNS, "here"); got != b.cfg.name() {
		t.Errorf("the restore on the snapshot's node is pinned to %s, want %s", got, b.cfg.name())
	}

	e.apply(t, restore("there"), inNodesNS(pod("there", withClaim("there", "/data", false), onNode(a.cfg.name()))))
	waitFor(t, 2*time.Minute, "the restore on "+a.cfg.name()+" refused there", func() error {
		msgs := must(t)(e.c.kubectl("-n", nodesNS, "get", "events", "--field-selector",
			"involvedObject.kind=PersistentVolumeClaim,involvedObject.name=there,reason=ProvisioningFailed", "-o", "jsonpath={.items[*].message}"))
		if !strings.Contains(msgs, "ResourceExhausted") || !strings.Contains(msgs, "lives on node "+b.cfg.name()) {
			return fmt.Errorf("claim there's ProvisioningFailed events: %q", msgs)
		}
		t.Logf("a restore asked on %s, the snapshot being on %s: %s", a.cfg.name(), b.cfg.name(), lastLines(msgs, 1))
		return nil
	})
	if out := strings.TrimSpace(must(t)(e.c.kubectl("-n", nodesNS, "get", "pvc", "there", "-o", "jsonpath={.status.phase}/{.spec.volumeName}"))); out != "Pending/" {
		t.Errorf("claim there: %q, want Pending with no volume", out)
	}
	e.checkCleanOn(t, a, true)

	// The claim is not stuck to A: each refusal had it rescheduled (its
	// selected node taken away), so the same claim serves a pod placed on
	// the snapshot's node afterwards. With NotFound it stayed A's for good
	// (csi-driver-host-path #651) and had to be made again.
	e.c.deleteInAndWait(t, nodesNS, "pod", "there")
	start := time.Now()
	e.run(t, inNodesNS(pod("there", withClaim("there", "/data", false), onNode(b.cfg.name()))))
	e.expect(t, nodesNS+"/there", "/data/token", tok)
	t.Logf("the claim refused on %s, its pod placed on %s: Running with the snapshot's data after %s",
		a.cfg.name(), b.cfg.name(), time.Since(start).Round(time.Second))

	// A restore whose pod the scheduler places where it likes: each node
	// without the snapshot sends the claim back. The scheduler does not
	// learn from it (it kept its first choice in every run here), so such
	// a pod waits until it is placed on the snapshot's node.
	e.apply(t, restore("free"), inNodesNS(pod("free", withClaim("free", "/data", false))))
	var tried string
	waitFor(t, 2*time.Minute, "the unpinned restore sent back twice", func() error {
		msgs := must(t)(e.c.kubectl("-n", nodesNS, "get", "events", "--field-selector",
			"involvedObject.kind=PersistentVolumeClaim,involvedObject.name=free,reason=ProvisioningFailed", "-o", "jsonpath={range .items[*]}{.count} {.message}{\"\\n\"}{end}"))
		if phase := strings.TrimSpace(must(t)(e.c.kubectl("-n", nodesNS, "get", "pod", "free", "-o", "jsonpath={.status.phase}"))); phase == "Running" {
			tried = " (the scheduler's first choice was the snapshot's node)"
			return nil
		}
		n := 0
		for _, l := range strings.Split(strings.TrimSpace(msgs), "\n") {
			var c int
			if _, err := fmt.Sscan(l, &c); err == nil && strings.Contains(l, "lives on node "+b.cfg.name()) {
				n += c
			}
		}
		if n < 2 {
			return fmt.Errorf("%d refusals naming %s: %q", n, b.cfg.name(), msgs)
		}
		tried = firstNodeTried(msgs)
		return nil
	})
	t.Logf("an unpinned restore of a snapshot on %s%s", b.cfg.name(), tried)
}

// firstNodeTried names the node of the first "not on <node>" refusal of a
// claim's ProvisioningFailed events, if any.
func firstNodeTried(msgs string) string {
	_, rest, ok := strings.Cut(msgs, ", not on ")
	if !ok {
		return " (the scheduler's first choice was the snapshot's node)"
	}
	node, _, _ := strings.Cut(rest, ":")
	return "; the scheduler first tried " + node
}
