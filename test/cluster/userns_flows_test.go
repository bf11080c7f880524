//go:build clustertest

package cluster

import (
	"encoding/json"
	"strings"
	"testing"
)

// Pods with a user namespace (hostUsers: false, issue 36): root in such a
// pod is an unprivileged uid of the node, of a range kubelet picks per pod.
// Its volumes must be idmapped into that range, or the pod's root sees the
// volume's files owned by nobody and cannot write them.

// hostUIDMap is /proc/self/uid_map without a user namespace of its own.
const hostUIDMap = "0 0 4294967295"

// withoutHostUsers gives a pod a user namespace of its own.
func withoutHostUsers() podOpt {
	return func(spec, _ obj) { spec["hostUsers"] = false }
}

// usernsClassic: a claim of the chart's class (classic publish: kubelet's
// bind, idmapped by the runtime) on a containerd node and on the CRI-O
// node.
func usernsClassic(t *testing.T, e *env) {
	e.nodesNamespace(t)
	for _, n := range e.usernsNodes(t) {
		t.Run(n.cfg.name(), func(t *testing.T) { e.usernsOwners(t, storageClass, n) })
	}
}

// usernsNRI: the same for a claim of the NRI class, whose mounts reach the
// container through the mounter's hook (the hook asks for the idmap).
func usernsNRI(t *testing.T, e *env) {
	e.nodesNamespace(t)
	e.apply(t, e.nriStorageClass())
	for _, n := range e.usernsNodes(t) {
		t.Run(n.cfg.name(), func(t *testing.T) { e.usernsOwners(t, nriClass, n) })
	}
}

// usernsNodes are a worker running containerd and the one running CRI-O.
func (e *env) usernsNodes(t *testing.T) []*Cluster {
	t.Helper()
	var nodes []*Cluster
	for _, w := range e.c.workers {
		if !w.cfg.crio() {
			nodes = append(nodes, w)
			break
		}
	}
	if len(nodes) == 0 {
		nodes = append(nodes, e.c)
	}
	return append(nodes, e.crioWorker(t))
}

// uidMap is a pod's /proc/self/uid_map on one line, spaces collapsed.
func (e *env) uidMap(t *testing.T, pod string) string {
	t.Helper()
	return strings.Join(strings.Fields(must(t)(e.c.podExec(pod, "cat", "/proc/self/uid_map"))), " ")
}

// owners are "uid:gid" of files in a pod, one line each.
func (e *env) owners(t *testing.T, pod string, files ...string) string {
	t.Helper()
	return strings.TrimSpace(must(t)(e.c.podExec(pod, append([]string{"stat", "-c", "%n %u:%g"}, files...)...)))
}

func wantOwners(files ...string) string {
	var l []string
	for _, f := range files {
		l = append(l, f+" 0:0")
	}
	return strings.Join(l, "\n")
}

// usernsOwners: on node, a fresh claim of class; a hostUsers: false pod
// (its uid_map not the host's) writes a file and a directory as root and
// sees them as 0:0; a second one (another uid range) appends to both;
// a pod without a user namespace sees them owned by 0.
func (e *env) usernsOwners(t *testing.T, class string, n *Cluster) {
	node := n.cfg.name()
	claim := "userns-" + strings.TrimPrefix(class, "mountplan-") + "-" + node
	q := nodesNS + "/"
	e.apply(t, inNodesNS(pvc(claim, class, "32Mi")))
	p1, p2, p3 := claim+"-a", claim+"-b", claim+"-host"
	e.run(t, inNodesNS(pod(p1, withClaim(claim, "/data", false), onNode(node), withoutHostUsers())))
	m1 := e.uidMap(t, q+p1)
	t.Logf("%s on %s: uid_map %q", p1, node, m1)
	if m1 == hostUIDMap {
		t.Fatalf("%s has no user namespace of its own: uid_map %q", p1, m1)
	}
	if out, err := e.c.podExec(q+p1, "sh", "-c", "id -u && mkdir /data/dir && echo one > /data/dir/file && echo one > /data/file && sync"); err != nil {
		t.Fatalf("root of %s writes to its claim: %v\n%s\n%s: %s", p1, err, out, "/data", e.owners(t, q+p1, "/data"))
	}
	files := []string{"/data", "/data/dir", "/data/dir/file", "/data/file"}
	if got, want := e.owners(t, q+p1, files...), wantOwners(files...); got != want {
		t.Errorf("in %s (a user namespace):\n%s\nwant\n%s", p1, got, want)
	}

	e.run(t, inNodesNS(pod(p2, withClaim(claim, "/data", false), onNode(node), withoutHostUsers())))
	m2 := e.uidMap(t, q+p2)
	t.Logf("%s on %s: uid_map %q", p2, node, m2)
	if m2 == hostUIDMap || m2 == m1 {
		t.Fatalf("%s: uid_map %q, want one of its own (%s has %q)", p2, m2, p1, m1)
	}
	if out, err := e.c.podExec(q+p2, "sh", "-c", "echo two >> /data/file && echo two >> /data/dir/file && echo two > /data/dir/new && sync"); err != nil {
		t.Fatalf("root of %s appends: %v\n%s", p2, err, out)
	}
	files = append(files, "/data/dir/new")
	if got, want := e.owners(t, q+p2, files...), wantOwners(files...); got != want {
		t.Errorf("in %s (another user namespace):\n%s\nwant\n%s", p2, got, want)
	}

	e.c.deleteInAndWait(t, nodesNS, "pod", p1, p2)
	e.run(t, inNodesNS(pod(p3, withClaim(claim, "/data", true), onNode(node))))
	if m := e.uidMap(t, q+p3); m != hostUIDMap {
		t.Errorf("%s (hostUsers unset): uid_map %q, want %q", p3, m, hostUIDMap)
	}
	if got, want := e.owners(t, q+p3, files...), wantOwners(files...); got != want {
		t.Errorf("in %s (no user namespace):\n%s\nwant\n%s", p3, got, want)
	}
	for f, want := range map[string]string{"/data/file": "one\ntwo", "/data/dir/file": "one\ntwo", "/data/dir/new": "two"} {
		if got := strings.TrimSpace(must(t)(e.c.podExec(q+p3, "cat", f))); got != want {
			t.Errorf("%s in %s: %q, want %q", f, p3, got, want)
		}
	}
	e.c.deleteInAndWait(t, nodesNS, "pod", p3)
	e.c.deleteInAndWait(t, nodesNS, "pvc", claim)
}

// usernsRawBlock: a block claim in a pod with a user namespace. Kubernetes
// (1.37) refuses the pod itself: its API validation forbids volumeDevices
// when hostUsers is false, so no such pod reaches kubelet, a runtime or
// the plugin, whatever the node. The flow holds the refusal: should a
// release allow it, the flow fails, and the device must then be shown
// usable by the pod's root (written and read back).
func usernsRawBlock(t *testing.T, e *env) {
	e.nodesNamespace(t)
	c := inNodesNS(pvc("userns-blk", storageClass, "32Mi"))
	c["spec"].(obj)["volumeMode"] = "Block"
	e.apply(t, c)
	p := inNodesNS(pod("userns-blk", withBlockClaim("userns-blk", "/dev/xvda"), withoutHostUsers()))
	b, err := json.Marshal(p)
	if err != nil {
		t.Fatal(err)
	}
	err = e.c.apply(string(b))
	if err == nil {
		t.Fatalf("the API server accepts a pod with hostUsers: false and a block claim: show its root writes the device and reads it back")
	}
	if want := "volumeDevices: Forbidden: when `hostUsers` is false"; !strings.Contains(err.Error(), want) {
		t.Fatalf("creating a pod with hostUsers: false and a block claim: %v, want the API's refusal (%q)", err, want)
	}
	t.Logf("refused by the API server: %v", err)
	e.c.deleteInAndWait(t, nodesNS, "pvc", "userns-blk")
}
