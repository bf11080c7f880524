//go:build clustertest

package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// operatorVolumes: what an operator sees on a node with a loop volume, an
// overlay chain, a FUSE volume and an NRI volume in use, each in a pod of
// its own: `mountplan-sidecar volumes`, run in the mounter's container
// against the plugin's metrics port, lists each volume with its source, device or
// daemon, stage and health, and each consumer with its pod, checked
// against the kernel (every one present, the NRI container's too). The table goes to the test log.
func operatorVolumes(t *testing.T, e *env) {
	// A loop volume (the default class) and an NRI volume.
	e.apply(t, obj{"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": obj{"name": nriClass},
		"provisioner": e.driverName, "parameters": obj{"nri": "true"}, "volumeBindingMode": "WaitForFirstConsumer", "reclaimPolicy": "Delete"})
	e.apply(t, pvc("vl-loop", storageClass, "32Mi"), pvc("vl-nri", nriClass, "32Mi"))
	// A chain over a squashfs image, and a squashfuse volume.
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "base"), []byte(token()+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sq := e.c.cfg.path("srv", "images", "vl.sqfs")
	hostRun(t, "mksquashfs", dir, sq, "-quiet", "-noappend")
	e.apply(t, staticVolume("vl-chain", "64Mi", obj{"type": "loop", "image": sq, "overlay": "true"}, "ReadWriteOnce"),
		boundClaim("vl-chain", "64Mi", "ReadWriteOnce"))
	e.fuseSetup(t)
	e.run(t, pod("vl-loop", withClaim("vl-loop", "/data", false)), pod("vl-nri", withClaim("vl-nri", "/data", false)),
		pod("vl-chain", withClaim("vl-chain", "/data", false)), pod("vl-fuse", withClaim("sqfuse", "/data", true)))
	e.nriPV(t, "vl-nri")

	want := map[string]struct{ pod, typ, consumer string }{}
	for _, w := range []struct{ claim, pod, typ, consumer string }{
		{"vl-loop", "vl-loop", "loop", "publish"},
		{"vl-nri", "vl-nri", "loop", "container"},
		{"vl-chain", "vl-chain", "loop", "publish"},
		{"sqfuse", "vl-fuse", "fuse", "publish"},
	} {
		want[e.volumeHandle(t, e.pvOf(t, w.claim))] = struct{ pod, typ, consumer string }{w.pod, w.typ, w.consumer}
	}
	// As docs/usage.md says: in the mounter's container, which sees the
	// node's processes (hostPID) and so every container's mount table;
	// the plugin's own has neither.
	ip := strings.TrimSpace(must(t)(e.c.kubectl("-n", "kube-system", "get", "pod", e.podOf(t, nodeComponent), "-o", "jsonpath={.status.podIP}")))
	url := fmt.Sprintf("--plugin-url=http://%s:%d", ip, metricsPort)
	table := must(t)(e.containerExec(t, mounterComponent, mounterContainer, "mountplan-sidecar", "volumes", url))
	t.Logf("mountplan-sidecar volumes, with a loop, an NRI, a chain and a FUSE volume in use:\n%s", table)
	out := must(t)(e.containerExec(t, mounterComponent, mounterContainer, "mountplan-sidecar", "volumes", url, "-o", "json"))
	var r struct {
		Volumes []struct {
			ID, Type, Source, Device, Stage string
			DaemonPID                       int `json:"daemonPID"`
			Health                          struct{ Status string }
			Consumers                       []struct {
				Kind   string
				Pod    *struct{ Namespace, Name, UID, Container string }
				Kernel struct {
					State     string
					Disagrees bool
				}
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("volumes -o json: %v\n%s", err, out)
	}
	seen := map[string]bool{}
	for _, v := range r.Volumes {
		w, ok := want[v.ID]
		if !ok {
			continue
		}
		seen[v.ID] = true
		if v.Type != w.typ || v.Stage != "staged" || v.Health.Status != "ok" || v.Source == "" {
			t.Errorf("volume %s (pod %s): type %q stage %q health %q source %q, want %s, staged, ok, a source", v.ID, w.pod, v.Type, v.Stage, v.Health.Status, v.Source, w.typ)
		}
		if (w.typ == "fuse") != (v.DaemonPID > 0) || (w.typ == "loop") != strings.HasPrefix(v.Device, "/dev/loop") {
			t.Errorf("volume %s (pod %s): device %q, daemon PID %d", v.ID, w.pod, v.Device, v.DaemonPID)
		}
		found := false
		for _, c := range v.Consumers {
			if c.Kernel.Disagrees || c.Kernel.State != "present" {
				t.Errorf("volume %s (pod %s): consumer %s: the kernel says %q (disagrees: %v), want present", v.ID, w.pod, c.Kind, c.Kernel.State, c.Kernel.Disagrees)
			}
			if c.Kind == w.consumer && c.Pod != nil && c.Pod.Namespace == testNS && c.Pod.Name == w.pod {
				found = true
			}
		}
		if !found {
			t.Errorf("volume %s: no %s consumer naming pod %s/%s in %+v", v.ID, w.consumer, testNS, w.pod, v.Consumers)
		}
	}
	for id, w := range want {
		if !seen[id] {
			t.Errorf("volume %s of pod %s is not listed", id, w.pod)
		}
	}
	kubectlPluginVolumes(t, e, want)
	e.c.deleteAndWait(t, "pod", "vl-loop", "vl-nri", "vl-chain", "vl-fuse")
	e.c.deleteAndWait(t, "pvc", "vl-loop", "vl-nri", "vl-chain")
	must(t)(e.c.kubectl("delete", "pv", "vl-chain", "--wait=true", "--timeout=60s"))
	e.fuseTeardown(t, "sqfuse", "rclone")
}

// kubectlPluginVolumes: the operator's `kubectl mountplan volumes -o json`,
// as docs/usage.md gives it, lists every volume of want under the node its
// pod runs on, asked through the API server's proxy (no pod IP, no
// port-forward); so does the same for that node alone, and a node that
// does not exist is an error naming it.
func kubectlPluginVolumes[W any](t *testing.T, e *env, want map[string]W) {
	t.Helper()
	kubectlMountplan := func(args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		return e.c.inNode(ctx, nil, "kubectl-mountplan", append([]string{"volumes", "-n", "kube-system"}, args...)...)
	}
	node := strings.TrimSpace(must(t)(e.c.kubectl("-n", testNS, "get", "pod", "vl-loop", "-o", "jsonpath={.spec.nodeName}")))
	for _, args := range [][]string{{"-o", "json"}, {node, "-o", "json"}} {
		out := must(t)(kubectlMountplan(args...))
		var listed []struct{ Node, ID string }
		if err := json.Unmarshal([]byte(out), &listed); err != nil {
			t.Fatalf("kubectl mountplan volumes %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		nodes := map[string]bool{}
		found := map[string]string{}
		for _, v := range listed {
			nodes[v.Node] = true
			if _, ok := want[v.ID]; ok {
				found[v.ID] = v.Node
			}
		}
		for id := range want {
			if found[id] != node {
				t.Errorf("kubectl mountplan volumes %s: volume %s listed on node %q, want %q", strings.Join(args, " "), id, found[id], node)
			}
		}
		if args[0] == node && (len(nodes) != 1 || !nodes[node]) {
			t.Errorf("kubectl mountplan volumes %s lists the nodes %v, want %s alone", strings.Join(args, " "), nodes, node)
		}
		t.Logf("kubectl mountplan volumes %s: %d volumes on %d nodes", strings.Join(args, " "), len(listed), len(nodes))
	}
	if out, err := kubectlMountplan("no-such-node"); err == nil || !strings.Contains(err.Error()+out, "no-such-node") {
		t.Errorf("kubectl mountplan volumes no-such-node: %v\n%s, want an error naming the node", err, out)
	}
}
