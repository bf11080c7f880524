//go:build clustertest

package cluster

import (
	"archive/tar"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/mountplan/mountplan/test/testutil"
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

// importImages loads every image archive of dir into each node's runtime's
// k8s.io namespace, the nodes at once.
func (c *Cluster) importImages(t *testing.T, dir string) {
	t.Helper()
	archives, err := filepath.Glob(filepath.Join(dir, "*.tar"))
	if err != nil || len(archives) == 0 {
		t.Fatalf("no image archives in %s (make test-cluster builds them with hack/cluster/images)", dir)
	}
	start := time.Now()
	var g errgroup.Group
	for _, n := range c.nodes() {
		g.Go(func() error {
			for _, a := range archives {
				if err := n.importImage(a); err != nil {
					return fmt.Errorf("import %s on %s: %w", a, n.cfg.name(), err)
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d images imported on %d nodes in %v", len(archives), len(c.nodes()), time.Since(start).Round(time.Millisecond))
}

// importImage imports an image archive (docker-archive, as
// hack/cluster/images writes them) into the node's runtime: containerd's
// k8s.io namespace, or CRI-O's storage (skopeo, under the name the
// archive's manifest gives).
func (c *Cluster) importImage(archive string) error {
	if c.cfg.crio() {
		name, err := archiveName(archive)
		if err != nil {
			return err
		}
		o := c.cfg.crioOptions()
		return testutil.ImportIntoCRIO(o, testutil.CRIOEnv(o.Dir), "docker-archive:"+archive, name)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	_, err := c.inNode(ctx, nil, "ctr", "--address", c.cfg.runtimeSocket(), "-n", "k8s.io",
		"images", "import", "--no-unpack=false", archive)
	return err
}

// archiveName is the one name (RepoTags) of a docker-archive's image.
func archiveName(archive string) (string, error) {
	f, err := os.Open(archive)
	if err != nil {
		return "", err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err != nil {
			return "", fmt.Errorf("%s: no manifest.json: %w", archive, err)
		}
		if h.Name != "manifest.json" {
			continue
		}
		var m []struct{ RepoTags []string }
		if err := json.NewDecoder(tr).Decode(&m); err != nil {
			return "", fmt.Errorf("%s: manifest.json: %w", archive, err)
		}
		if len(m) != 1 || len(m[0].RepoTags) != 1 {
			return "", fmt.Errorf("%s: manifest.json names %v, want one image with one name", archive, m)
		}
		return m[0].RepoTags[0], nil
	}
}

// createNamespace creates a namespace whose pods the scheduler puts only on
// the given node (the PodNodeSelector admission plugin's annotation), or
// anywhere when node is "".
func createNamespace(t *testing.T, c *Cluster, name, node string) {
	t.Helper()
	ann := ""
	if node != "" {
		ann = fmt.Sprintf(`, "annotations": {"scheduler.alpha.kubernetes.io/node-selector": "kubernetes.io/hostname=%s"}`, node)
	}
	if err := c.apply(fmt.Sprintf(`{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": %q%s}}`, name, ann)); err != nil {
		t.Fatal(err)
	}
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

// waitNodeReady waits for every node's Ready condition.
func (c *Cluster) waitNodeReady(t *testing.T) {
	t.Helper()
	for _, n := range c.nodes() {
		waitFor(t, 2*time.Minute, "node "+n.cfg.name()+" Ready", func() error {
			out, err := c.kubectl("get", "node", n.cfg.name(), "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
			if err != nil {
				return err
			}
			if strings.TrimSpace(out) != "True" {
				return fmt.Errorf("Ready=%q", out)
			}
			return nil
		})
	}
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
	if _, err := c.helm("upgrade", "--install", "mountplan", chart, "--namespace", "kube-system", "-f", f,
		"--wait", "--timeout", "4m"); err != nil {
		// What kept the pods from Ready, in the test's own output (a CI
		// log keeps nothing of the cluster's files).
		pods, _ := c.kubectl("get", "pods", "-A", "-o", "wide")
		events, _ := c.kubectl("get", "events", "-A", "--field-selector", "type=Warning")
		t.Fatalf("%v\npods:\n%s\nwarning events:\n%s", err, pods, events)
	}
}

// qualified splits a pod's name as the helpers take it: "ns/name" for a
// pod of another namespace than the flows', "name" for one of testNS.
func qualified(pod string) (ns, name string) {
	if ns, name, ok := strings.Cut(pod, "/"); ok {
		return ns, name
	}
	return testNS, pod
}

// podExec runs a command in a pod's container.
func (c *Cluster) podExec(pod string, cmd ...string) (string, error) {
	ns, name := qualified(pod)
	return c.kubectl(append([]string{"-n", ns, "exec", name, "--"}, cmd...)...)
}

// waitPod waits until a pod is Ready.
func (c *Cluster) waitPod(t *testing.T, pod string) {
	t.Helper()
	ns, name := qualified(pod)
	if _, err := c.kubectl("-n", ns, "wait", "--for=condition=Ready", "pod/"+name, "--timeout=120s"); err != nil {
		desc, _ := c.kubectl("-n", ns, "describe", "pod", name)
		t.Fatalf("pod %s not Ready: %v\n%s", pod, err, lastLines(desc, 25))
	}
}

// deleteAndWait deletes objects of the test namespace and waits until
// they are gone.
func (c *Cluster) deleteAndWait(t *testing.T, kind string, names ...string) {
	t.Helper()
	c.deleteInAndWait(t, testNS, kind, names...)
}

// deleteInAndWait is deleteAndWait in namespace ns.
func (c *Cluster) deleteInAndWait(t *testing.T, ns, kind string, names ...string) {
	t.Helper()
	must(t)(c.kubectl(deleteArgs(ns, kind, names)...))
}

// deleteArgs deletes objects of namespace ns and waits until they are
// gone.
func deleteArgs(ns, kind string, names []string) []string {
	return append([]string{"-n", ns, "delete", kind, "--wait=true", "--timeout=120s", "--ignore-not-found"}, names...)
}

// deleteAtEnd deletes objects of the test namespace when the flow ends,
// passed or not: a failed flow's pods and claims would otherwise stay on
// the shared cluster and fail the flows after it.
func (c *Cluster) deleteAtEnd(t *testing.T, kind string, names ...string) {
	t.Cleanup(func() {
		if out, err := c.kubectl(deleteArgs(testNS, kind, names)...); err != nil {
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
