//go:build clustertest

package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	storagev1 "k8s.io/api/storage/v1"

	"github.com/mountplan/mountplan/internal/topology"
)

const gib = int64(1) << 30

// capacityTracking: the node's provisioner publishes a CSIStorageCapacity
// for the chart's StorageClass and the node's topology segment, holding
// the free bytes of the state dir's filesystem and owned by the node
// DaemonSet. A pod whose new claim is bigger than that stays Pending with
// the scheduler's reason, and no CreateVolume is ever asked for its claim;
// a claim that fits is provisioned and bound.
func capacityTracking(t *testing.T, e *env) {
	room := e.waitCapacityMatchesFree(t, e.c)

	// More than the node's room, yet less than its filesystem's size where
	// that is larger: the plugin would make such a sparse image if asked,
	// so only the scheduler keeps the claim off the node.
	big := fmt.Sprintf("%dGi", room/gib+32)
	e.c.deleteAtEnd(t, "pvc", "toobig", "fits")
	e.c.deleteAtEnd(t, "pod", "toobig", "fits")
	e.apply(t, pvc("toobig", storageClass, big), pod("toobig", withClaim("toobig", "/data", false)))
	e.apply(t, pvc("fits", storageClass, "64Mi"))
	e.run(t, pod("fits", withClaim("fits", "/data", false)))
	e.write(t, "fits", "/data/token")
	if phase := strings.TrimSpace(must(t)(e.c.kubectl("-n", testNS, "get", "pvc", "fits", "-o", "jsonpath={.status.phase}"))); phase != "Bound" {
		t.Errorf("claim fits is %s, want Bound", phase)
	}

	waitFor(t, 90*time.Second, "pod toobig unschedulable for want of storage", func() error {
		out, err := e.c.kubectl("-n", testNS, "get", "pod", "toobig", "-o",
			`jsonpath={.status.phase} {.status.conditions[?(@.type=="PodScheduled")].reason}: {.status.conditions[?(@.type=="PodScheduled")].message}`)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(out, "Pending Unschedulable") || !strings.Contains(out, "did not have enough free storage") {
			return fmt.Errorf("pod toobig: %s", out)
		}
		return nil
	})
	events := must(t)(e.c.kubectl("-n", testNS, "get", "events", "--field-selector", "involvedObject.kind=Pod,involvedObject.name=toobig,reason=FailedScheduling",
		"-o", "jsonpath={.items[*].message}"))
	if !strings.Contains(events, "did not have enough free storage") {
		t.Errorf("the scheduler's FailedScheduling events for toobig do not name the storage: %q", events)
	}
	t.Logf("a %s claim on a node with %d MiB of room: %s", big, room>>20, events)
	// The fits claim was provisioned while the scheduler refused toobig
	// over and over: if the provisioner were ever to try toobig, it would
	// have had that long.
	e.checkNeverProvisioned(t, testNS, "toobig", "fits", nodeName)

	e.c.deleteAndWait(t, "pod", "toobig", "fits")
	e.c.deleteAndWait(t, "pvc", "toobig", "fits")
}

// waitCapacityMatchesFree waits until the CSIStorageCapacity of the chart's
// StorageClass and the node's segment holds the free bytes of the state
// dir's filesystem (df's Avail), within a GiB: the provisioner asks every
// minute and after each volume it makes or deletes, and other work on the
// machine moves the free bytes meanwhile. It checks the object's owner and
// returns its capacity.
func (e *env) waitCapacityMatchesFree(t *testing.T, n *Cluster) int64 {
	t.Helper()
	var room int64
	waitFor(t, 3*time.Minute, "a CSIStorageCapacity with the state dir's free bytes on "+n.cfg.name(), func() error {
		c, err := e.nodeCapacity(n.cfg.name())
		if err != nil {
			return err
		}
		free := e.stateFree(t, n)
		room = c.Capacity.Value()
		if d := room - free; d > gib || d < -gib {
			return fmt.Errorf("%s holds %d bytes, the state dir's filesystem has %d free", c.Name, room, free)
		}
		if c.MaximumVolumeSize != nil {
			t.Errorf("%s has maximumVolumeSize %v: the scheduler takes it for the room", c.Name, c.MaximumVolumeSize)
		}
		owners := c.OwnerReferences
		if len(owners) != 1 || owners[0].Kind != "DaemonSet" || owners[0].Name != "mountplan-node" || owners[0].Controller == nil || !*owners[0].Controller {
			t.Errorf("%s is owned by %+v, want the DaemonSet mountplan-node alone", c.Name, owners)
		}
		t.Logf("%s: %d MiB for class %s on node %s; the state dir's filesystem has %d MiB free", c.Name, room>>20, c.StorageClassName, n.cfg.name(), free>>20)
		return nil
	})
	return room
}

// nodeCapacity is the one CSIStorageCapacity of the driver for the chart's
// StorageClass and a node's topology segment.
func (e *env) nodeCapacity(node string) (*storagev1.CSIStorageCapacity, error) {
	list, err := e.capacities()
	if err != nil {
		return nil, err
	}
	var mine []*storagev1.CSIStorageCapacity
	for i := range list {
		c := &list[i]
		if c.StorageClassName == storageClass && c.NodeTopology != nil &&
			c.NodeTopology.MatchLabels[topology.Key] == node && len(c.NodeTopology.MatchLabels) == 1 {
			mine = append(mine, c)
		}
	}
	if len(mine) != 1 || mine[0].Capacity == nil {
		return nil, fmt.Errorf("%d CSIStorageCapacity objects for class %s on node %s (of %d): %+v", len(mine), storageClass, node, len(list), mine)
	}
	return mine[0], nil
}

// capacities lists the driver's CSIStorageCapacity objects in every namespace.
func (e *env) capacities() ([]storagev1.CSIStorageCapacity, error) {
	out, err := e.c.kubectl("get", "csistoragecapacities", "-A", "-l", "csi.storage.k8s.io/drivername="+driverName, "-o", "json")
	if err != nil {
		return nil, err
	}
	var list storagev1.CSIStorageCapacityList
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		return nil, fmt.Errorf("csistoragecapacities: %w", err)
	}
	return list.Items, nil
}

// stateFree is df's Avail of a node's state dir's filesystem.
func (e *env) stateFree(t *testing.T, n *Cluster) int64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(n.seen(e.c.cfg.path("state")), &st); err != nil {
		t.Fatal(err)
	}
	return int64(st.Bavail) * st.Bsize
}

// checkNeverProvisioned: no CreateVolume reached any node's plugin for
// claim (its volume's name, pvc-<uid>, is in no request a plugin logged),
// no node was selected for it, no provisioning event and no PV name it.
// The claim provisioned (on node), whose CreateVolume must be in that
// node's log, shows that the logs are the right ones.
func (e *env) checkNeverProvisioned(t *testing.T, ns, claim, provisioned, node string) {
	t.Helper()
	uid := func(c string) string {
		return strings.TrimSpace(must(t)(e.c.kubectl("-n", ns, "get", "pvc", c, "-o", "jsonpath={.metadata.uid}")))
	}
	for _, n := range e.c.nodes() {
		log := must(t)(e.c.kubectl("-n", "kube-system", "logs", e.podOn(t, nodeComponent, n.cfg.name()), "-c", pluginContainer))
		if name := "pvc-" + uid(provisioned); n.cfg.name() == node && !strings.Contains(log, name) {
			t.Fatalf("the plugin's log on %s has no request for %s (claim %s): it is not the log of the node's CreateVolume calls", node, name, provisioned)
		}
		if name := "pvc-" + uid(claim); strings.Contains(log, name) {
			t.Errorf("the plugin on %s got a request for %s (claim %s), which no node has room for", n.cfg.name(), name, claim)
		}
	}
	out := must(t)(e.c.kubectl("-n", ns, "get", "pvc", claim, "-o",
		`jsonpath={.status.phase} {.metadata.annotations.volume\.kubernetes\.io/selected-node}`))
	if strings.TrimSpace(out) != "Pending" {
		t.Errorf("claim %s: phase and selected node %q, want Pending and none", claim, out)
	}
	if r := provisioningEvents(t, e, ns, claim); len(r) > 0 {
		t.Errorf("claim %s has provisioning events: its provisioning was attempted (%v)", claim, r)
	}
	pvs := must(t)(e.c.kubectl("get", "pv", "-o", `jsonpath={range .items[*]}{.spec.claimRef.namespace}/{.spec.claimRef.name}{"\n"}{end}`))
	if slices.Contains(strings.Fields(pvs), ns+"/"+claim) {
		t.Errorf("a PV is bound to claim %s", claim)
	}
}

// provisioningEvents are the reasons of a claim's events that say its
// provisioning was attempted.
func provisioningEvents(t *testing.T, e *env, ns, claim string) []string {
	t.Helper()
	reasons := strings.Fields(must(t)(e.c.kubectl("-n", ns, "get", "events", "--field-selector",
		"involvedObject.kind=PersistentVolumeClaim,involvedObject.name="+claim, "-o", "jsonpath={.items[*].reason}")))
	return slices.DeleteFunc(reasons, func(r string) bool {
		return !slices.Contains([]string{"ExternalProvisioning", "Provisioning", "ProvisioningFailed", "ProvisioningSucceeded"}, r)
	})
}

// checkNoCapacityLeft: once the chart is uninstalled, the garbage collector
// removes the CSIStorageCapacity objects the DaemonSet owned.
func (e *env) checkNoCapacityLeft(t *testing.T) {
	t.Helper()
	waitFor(t, 90*time.Second, "no CSIStorageCapacity of the driver after the uninstall", func() error {
		list, err := e.capacities()
		if err != nil {
			return err
		}
		if len(list) != 0 {
			var names []string
			for _, c := range list {
				names = append(names, c.Namespace+"/"+c.Name)
			}
			return fmt.Errorf("left: %v", names)
		}
		return nil
	})
}

// goneNode is a node that was in the cluster and is gone for good: what it
// left in the API is made by hand as its components would have made it.
const goneNode = "mp-gone"

// nodeRemovedForGood: a node deleted for good leaves a provisioned volume
// (pinned to it, with external-provisioner's finalizer, bound to a claim
// that a pod still asks for) and its CSIStorageCapacity; nothing in the
// cluster can delete them, since the provisioner that would ran on that
// node. `kubectl mountplan forget-node` shows them, refuses a node that
// still exists, and with --yes deletes them for real against the API
// server and its controllers, while the live node's claim, volume,
// capacity and data stay.
func nodeRemovedForGood(t *testing.T, e *env) {
	// Cleanups run last first: the pods, then the claims, then the gone
	// node's volume, whose finalizer no provisioner would ever remove.
	t.Cleanup(func() {
		_, _ = e.c.kubectl("patch", "pv", "pv-gone", "--type=merge", "-p", `{"metadata":{"finalizers":null}}`)
		_, _ = e.c.kubectl("delete", "pv", "pv-gone", "--ignore-not-found", "--wait=false")
		_, _ = e.c.kubectl("-n", "kube-system", "delete", "csistoragecapacity", "csisc-"+goneNode, "--ignore-not-found")
	})
	e.c.deleteAtEnd(t, "pvc", "live", "gone-claim")
	e.c.deleteAtEnd(t, "pod", "live", "gone-user")
	e.apply(t, pvc("live", storageClass, "64Mi"))
	e.run(t, pod("live", withClaim("live", "/data", false)))
	tok := e.write(t, "live", "/data/token")
	livePV := strings.TrimSpace(must(t)(e.c.kubectl("-n", testNS, "get", "pvc", "live", "-o", "jsonpath={.spec.volumeName}")))

	claim := pvc("gone-claim", storageClass, "64Mi")
	claim["spec"].(obj)["volumeName"] = "pv-gone"
	e.apply(t, obj{"apiVersion": "v1", "kind": "PersistentVolume",
		"metadata": obj{"name": "pv-gone", "finalizers": []string{"external-provisioner.volume.kubernetes.io/finalizer"},
			"annotations": obj{"pv.kubernetes.io/provisioned-by": driverName}},
		"spec": obj{"capacity": obj{"storage": "64Mi"}, "accessModes": []string{"ReadWriteOnce"},
			"persistentVolumeReclaimPolicy": "Delete", "storageClassName": storageClass,
			"claimRef": obj{"namespace": testNS, "name": "gone-claim"},
			"csi":      obj{"driver": driverName, "volumeHandle": "gone-vol", "fsType": "ext4"},
			"nodeAffinity": obj{"required": obj{"nodeSelectorTerms": []obj{{"matchExpressions": []obj{
				{"key": topology.Key, "operator": "In", "values": []string{goneNode}}}}}}}}},
		claim,
		pod("gone-user", withClaim("gone-claim", "/data", false)),
		obj{"apiVersion": "storage.k8s.io/v1", "kind": "CSIStorageCapacity",
			"metadata":         obj{"name": "csisc-" + goneNode, "namespace": "kube-system", "labels": obj{"csi.storage.k8s.io/drivername": driverName}},
			"storageClassName": storageClass, "capacity": "1Gi",
			"nodeTopology": obj{"matchLabels": obj{topology.Key: goneNode}}})
	waitFor(t, time.Minute, "claim gone-claim bound to pv-gone", func() error {
		if phase := strings.TrimSpace(must(t)(e.c.kubectl("-n", testNS, "get", "pvc", "gone-claim", "-o", "jsonpath={.status.phase}"))); phase != "Bound" {
			return fmt.Errorf("claim gone-claim is %q", phase)
		}
		return nil
	})

	forget := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		return e.c.inNode(ctx, nil, "kubectl-mountplan", append([]string{"forget-node"}, args...)...)
	}
	if out, err := forget(nodeName, "--yes"); err == nil || !strings.Contains(err.Error(), "still exists") {
		t.Errorf("forget-node of the live node %s: %v\n%s", nodeName, err, out)
	}
	shown := must(t)(forget(goneNode))
	t.Logf("kubectl mountplan forget-node %s:\n%s", goneNode, shown)
	for _, want := range []string{"persistentvolume pv-gone (64Mi, Bound), bound to claim " + testNS + "/gone-claim", "csistoragecapacity kube-system/csisc-" + goneNode, "--yes"} {
		if !strings.Contains(shown, want) {
			t.Errorf("forget-node %s does not show %q", goneNode, want)
		}
	}
	if strings.Contains(shown, livePV) {
		t.Errorf("forget-node %s shows the live node's volume %s", goneNode, livePV)
	}
	// Shown, not done: without --yes everything is still there.
	must(t)(e.c.kubectl("get", "pv", "pv-gone"))
	must(t)(e.c.kubectl("-n", testNS, "get", "pvc", "gone-claim"))

	done := must(t)(forget(goneNode, "--yes"))
	t.Logf("kubectl mountplan forget-node %s --yes:\n%s", goneNode, done)
	// The pod still asking for the claim was never scheduled, so claim
	// protection does not hold the claim for it (it does for a pod on a
	// node): claim, volume and capacity go at once, and the pod, Pending
	// for ever until now, can be made again by its owner.
	waitFor(t, time.Minute, "the gone node's volume, claim and capacity deleted", func() error {
		// What holds each one, if anything still does: its finalizers,
		// and a volume's phase (pv-protection lets go once it is no
		// longer Bound).
		const holds = "-o=jsonpath={.metadata.name} finalizers={.metadata.finalizers} phase={.status.phase} deleting={.metadata.deletionTimestamp}"
		for _, args := range [][]string{{"get", "pv", "pv-gone"}, {"-n", testNS, "get", "pvc", "gone-claim"}, {"-n", "kube-system", "get", "csistoragecapacity", "csisc-" + goneNode}} {
			if out, err := e.c.kubectl(append(args, "--ignore-not-found", holds)...); err != nil || strings.TrimSpace(out) != "" {
				return fmt.Errorf("still there: %s %v", out, err)
			}
		}
		return nil
	})
	e.c.deleteAndWait(t, "pod", "gone-user")
	if again := must(t)(forget(goneNode)); !strings.Contains(again, "left nothing") {
		t.Errorf("after --yes, forget-node %s still shows:\n%s", goneNode, again)
	}

	// The live node's claim, volume, capacity and data are untouched.
	if phase := strings.TrimSpace(must(t)(e.c.kubectl("-n", testNS, "get", "pvc", "live", "-o", "jsonpath={.status.phase}"))); phase != "Bound" {
		t.Errorf("the live claim is %q after forget-node, want Bound", phase)
	}
	must(t)(e.c.kubectl("get", "pv", livePV))
	if _, err := e.nodeCapacity(nodeName); err != nil {
		t.Errorf("the live node's capacity after forget-node: %v", err)
	}
	e.expect(t, "live", "/data/token", tok)
	e.c.deleteAndWait(t, "pod", "live")
	e.c.deleteAndWait(t, "pvc", "live")
}

// drainNodeLocal: the node of a StatefulSet's pod, which writes to a
// node-local claim, is drained. The pod is evicted and its successor stays
// Pending with the scheduler's reason (the one node that can hold the
// claim is cordoned, the others conflict with the volume's node affinity);
// the claim stays bound to its volume; once the node is uncordoned the pod
// runs there again and reads what the evicted one wrote. It runs in
// nodesNS, where the scheduler may put the pod on any node.
func drainNodeLocal(t *testing.T, e *env) {
	const sts = "drained"
	p := nodesNS + "/" + sts + "-0"
	e.nodesNamespace(t)
	e.apply(t, inNodesNS(statefulSet(sts, 1, "64Mi")))
	must(t)(e.c.kubectl("-n", nodesNS, "rollout", "status", "statefulset/"+sts, "--timeout=180s"))
	tok := e.write(t, p, "/data/token")
	node := e.podNode(t, p)
	t.Cleanup(func() { _, _ = e.c.kubectl("uncordon", node) })
	uid := func() string {
		return strings.TrimSpace(must(t)(e.c.kubectl("-n", nodesNS, "get", "pod", sts+"-0", "--ignore-not-found", "-o", "jsonpath={.metadata.uid}")))
	}
	before := uid()
	pv := strings.TrimSpace(must(t)(e.c.kubectl("-n", nodesNS, "get", "pvc", "data-"+sts+"-0", "-o", "jsonpath={.spec.volumeName}")))

	// Only this flow's pods: the cluster is shared with the other flows,
	// whose bare pods drain would refuse to evict (no controller to make
	// them again) and whose pods this flow has no business moving.
	out := must(t)(e.c.kubectl("drain", node, "--pod-selector", "app="+sts, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s"))
	t.Logf("kubectl drain %s:\n%s", node, lastLines(out, 6))
	waitFor(t, 90*time.Second, "the evicted pod's successor Pending for want of a node", func() error {
		now := uid()
		if now == "" || now == before {
			return fmt.Errorf("pod %s not made again yet (uid %q)", p, now)
		}
		st, err := e.c.kubectl("-n", nodesNS, "get", "pod", sts+"-0", "-o",
			`jsonpath={.status.phase} {.status.conditions[?(@.type=="PodScheduled")].reason}: {.status.conditions[?(@.type=="PodScheduled")].message}`)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(st, "Pending Unschedulable") || !strings.Contains(st, "1 node(s) were unschedulable") {
			return fmt.Errorf("pod %s: %s", p, st)
		}
		if others := len(e.c.nodes()) - 1; others > 0 && !strings.Contains(st, fmt.Sprintf("%d node(s) didn't match PersistentVolume's node affinity", others)) {
			return fmt.Errorf("pod %s: %s", p, st)
		}
		t.Logf("while %s is drained, pod %s: %s", node, p, st)
		return nil
	})
	if got := strings.TrimSpace(must(t)(e.c.kubectl("-n", nodesNS, "get", "pvc", "data-"+sts+"-0", "-o", "jsonpath={.status.phase} {.spec.volumeName}"))); got != "Bound "+pv {
		t.Errorf("claim data-%s-0 while its node is drained: %q, want Bound to %s", sts, got, pv)
	}

	must(t)(e.c.kubectl("uncordon", node))
	must(t)(e.c.kubectl("-n", nodesNS, "rollout", "status", "statefulset/"+sts, "--timeout=180s"))
	e.c.waitPod(t, p)
	e.expect(t, p, "/data/token", tok)
	if again := e.podNode(t, p); again != node {
		t.Errorf("pod %s runs on %s after the uncordon, want %s (its volume's node)", p, again, node)
	}
}
