//go:build clustertest

package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// testNS is the namespace of the flows' objects.
const testNS = "mp-test"

// must fails the test with a command's error: must(t)(c.kubectl(...)).
func must(t *testing.T) func(out string, err error) string {
	return func(out string, err error) string {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
}

// importImages loads every image archive of dir into the runtime's k8s.io
// namespace.
func (c *Cluster) importImages(t *testing.T, dir string) {
	t.Helper()
	archives, err := filepath.Glob(filepath.Join(dir, "*.tar"))
	if err != nil || len(archives) == 0 {
		t.Fatalf("no image archives in %s (make test-cluster builds them with hack/cluster/images)", dir)
	}
	start := time.Now()
	for _, a := range archives {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		_, err := c.inNode(ctx, nil, "ctr", "--address", c.cfg.path("run", "containerd.sock"), "-n", "k8s.io",
			"images", "import", "--no-unpack=false", a)
		cancel()
		if err != nil {
			t.Fatalf("import %s: %v", a, err)
		}
	}
	t.Logf("%d images imported in %v", len(archives), time.Since(start).Round(time.Millisecond))
}

// applySnapshotCRDs applies external-snapshotter's CRDs from dir and waits
// until the API serves them. The group snapshots' too, though the chart
// does not offer them: snapshot-controller v8.7 waits for them at start.
func (c *Cluster) applySnapshotCRDs(t *testing.T, dir string) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.storage.k8s.io_*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no snapshot CRDs in %s", dir)
	}
	args := []string{"apply"}
	var crds []string
	for _, f := range files {
		args = append(args, "-f", f)
		// <group>_<plural>.yaml names crd/<plural>.<group>
		group, plural, _ := strings.Cut(strings.TrimSuffix(filepath.Base(f), ".yaml"), "_")
		crds = append(crds, "crd/"+plural+"."+group)
	}
	must(t)(c.kubectl(args...))
	must(t)(c.kubectl(append([]string{"wait", "--for=condition=Established", "--timeout=60s"}, crds...)...))
}

// waitFor polls f until it returns nil or d passes.
func waitFor(t *testing.T, d time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v: %v", what, d, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// waitNodeReady waits for the node's Ready condition.
func (c *Cluster) waitNodeReady(t *testing.T) {
	t.Helper()
	waitFor(t, 2*time.Minute, "node Ready", func() error {
		out, err := c.kubectl("get", "node", nodeName, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "True" {
			return fmt.Errorf("Ready=%q", out)
		}
		return nil
	})
}

// helm runs helm against the cluster.
func (c *Cluster) helm(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	return c.inNode(ctx, nil, "helm", args...)
}

// helmInstall installs (or upgrades) the chart with a values file.
func (c *Cluster) helmInstall(t *testing.T, chart, values string) {
	t.Helper()
	f := c.cfg.path("values.yaml")
	if err := os.WriteFile(f, []byte(values), 0o644); err != nil {
		t.Fatal(err)
	}
	must(t)(c.helm("upgrade", "--install", "mountplan", chart, "--namespace", "kube-system", "-f", f,
		"--wait", "--timeout", "4m"))
}

// podExec runs a command in a pod's container.
func (c *Cluster) podExec(pod string, cmd ...string) (string, error) {
	return c.kubectl(append([]string{"-n", testNS, "exec", pod, "--"}, cmd...)...)
}

// waitPod waits until a pod is Ready.
func (c *Cluster) waitPod(t *testing.T, pod string) {
	t.Helper()
	if _, err := c.kubectl("-n", testNS, "wait", "--for=condition=Ready", "pod/"+pod, "--timeout=120s"); err != nil {
		desc, _ := c.kubectl("-n", testNS, "describe", "pod", pod)
		t.Fatalf("pod %s not Ready: %v\n%s", pod, err, lastLines(desc, 25))
	}
}

// deleteAndWait deletes objects and waits until they are gone.
func (c *Cluster) deleteAndWait(t *testing.T, kind string, names ...string) {
	t.Helper()
	must(t)(c.kubectl(deleteArgs(kind, names)...))
}

// deleteArgs deletes objects of the test namespace and waits until they
// are gone.
func deleteArgs(kind string, names []string) []string {
	return append([]string{"-n", testNS, "delete", kind, "--wait=true", "--timeout=120s", "--ignore-not-found"}, names...)
}

// deleteAtEnd deletes objects of the test namespace when the flow ends,
// passed or not: a failed flow's pods and claims would otherwise stay on
// the shared cluster and fail the flows after it.
func (c *Cluster) deleteAtEnd(t *testing.T, kind string, names ...string) {
	t.Cleanup(func() {
		if out, err := c.kubectl(deleteArgs(kind, names)...); err != nil {
			t.Errorf("cleaning up %s %v: %v\n%s", kind, names, err, out)
		}
	})
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
