//go:build clustertest

package cluster

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/test/testutil"
)

// Environment of the test, set by hack/cluster/test.sh (make test-cluster).
const (
	envPath   = "MOUNTPLAN_CLUSTER_PATH"          // bin directories of the cluster's programs
	envImages = "MOUNTPLAN_CLUSTER_IMAGES"        // directory of image archives (hack/cluster/images)
	envTag    = "MOUNTPLAN_CLUSTER_TAG"           // tag of the mountplan image in it
	envCRDs   = "MOUNTPLAN_CLUSTER_SNAPSHOT_CRDS" // external-snapshotter's config/crd directory
	envRoot   = "MOUNTPLAN_CLUSTER_ROOT"          // the cluster's directory (default below)
	envNodes  = "MOUNTPLAN_CLUSTER_NODES"         // how many nodes (default 3)
)

const defaultRoot = "/var/lib/mountplan-cluster"

func TestCluster(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.RequireCommands(t, "nsenter", "ip", "mkfs.ext4", "mksquashfs", "mkfs.erofs", "losetup")
	testenv.RequireFile(t, "/usr/lib/cni/bridge", "CNI plugins (Debian package containernetworking-plugins)")
	path := filepath.SplitList(os.Getenv(envPath))
	images, tag, crds := os.Getenv(envImages), os.Getenv(envTag), os.Getenv(envCRDs)
	if len(path) == 0 || images == "" || tag == "" || crds == "" {
		testenv.Missing(t, "%s, %s, %s and %s (run make test-cluster)", envPath, envImages, envTag, envCRDs)
	}
	root := os.Getenv(envRoot)
	if root == "" {
		root = defaultRoot
	}
	repo, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	cleanStale(t, root)
	before := takeSnapshot(t, root)
	// A containerd of the host's own may use the same namespace: the
	// cgroups found there now are not the cluster's to remove.
	hostCgroups, err := testutil.CgroupTree(criNamespace)
	if err != nil {
		t.Fatal(err)
	}
	hostCRIOCgroups := crioCgroups(t, nil)
	nodes := 3
	if v := os.Getenv(envNodes); v != "" {
		if nodes, err = strconv.Atoi(v); err != nil || nodes < 1 || nodes > 9 {
			t.Fatalf("%s=%q: want 1 to 9", envNodes, v)
		}
	}
	c := startCluster(t, root, path, nodes)
	var logs []*podLogs
	for _, n := range c.nodes() {
		logs = append(logs, keepPodLogs(n))
	}
	defer func() {
		for _, l := range logs {
			l.stop() // before the node's stop removes the pods' logs
		}
		left, err := c.stop()
		if err != nil {
			t.Error(err)
		}
		// runc removes a container's cgroups when it deletes it; those of
		// containers killed with their node (the reboots) outlive them.
		if err := testutil.RemoveCgroupTreeExcept(criNamespace, hostCgroups); err != nil {
			t.Errorf("leak: %v", err)
		}
		crioCgroups(t, hostCRIOCgroups)
		for _, l := range left {
			t.Errorf("leak: process still running in the node at its stop: %s", l)
		}
		after := takeSnapshot(t, root)
		for _, l := range before.diff(after) {
			t.Errorf("leak: %s", l)
		}
		if t.Failed() {
			t.Logf("logs kept under %s (the plugin's and the mounter's: pods/kube-system_mountplan-*)", c.cfg.path("logs"))
			return
		}
		if err := os.RemoveAll(root); err != nil {
			t.Error(err)
		}
	}()
	c.importImages(t, images)
	c.waitNodeReady(t)
	c.applySnapshotCRDs(t, crds)

	e := newEnv(t, c, repo, tag)
	start := time.Now()
	e.install(t)
	t.Logf("helm install to DaemonSet ready: %v", time.Since(start).Round(time.Millisecond))
	createNamespace(t, c, testNS, nodeName)

	if os.Getenv(envBench) == "1" {
		benchPodStartup(t, e)
		e.deleteEverything(t)
		return
	}
	var pending []string
	for _, f := range flows {
		if f.pending != "" && os.Getenv("MOUNTPLAN_CLUSTER_PENDING") != "1" {
			pending = append(pending, fmt.Sprintf("%s: %s", f.name, f.pending))
			continue
		}
		if !t.Run(f.name, func(t *testing.T) { f.run(t, e) }) {
			t.Logf("flow %s failed; logs under %s", f.name, c.cfg.path("logs"))
		}
	}
	for _, p := range pending {
		t.Logf("pending (not run): %s", p)
	}
	e.memory(t)
	holdOnFailure(t, c)
	e.deleteEverything(t)
}

// holdOnFailure keeps a failed cluster up for a look (MOUNTPLAN_CLUSTER_HOLD=1,
// by hand only) until <root>/release exists or 30 minutes pass.
func holdOnFailure(t *testing.T, c *Cluster) {
	if !t.Failed() || os.Getenv("MOUNTPLAN_CLUSTER_HOLD") != "1" {
		return
	}
	t.Logf("holding the cluster: KUBECONFIG=%s nsenter -t %d -n kubectl ...; touch %s to go on",
		c.cfg.path("pki", "admin.kubeconfig"), c.nodePID(), c.cfg.path("release"))
	for deadline := time.Now().Add(30 * time.Minute); time.Now().Before(deadline); time.Sleep(time.Second) {
		if _, err := os.Stat(c.cfg.path("release")); err == nil {
			return
		}
	}
}

// crioCgroups lists the cgroups of CRI-O's node: without QoS cgroups its
// pods have no parent, and CRI-O makes crio/ and crio-<id>/ and
// crio-conmon-<id>/ at the top of every hierarchy; runc removes a
// container's own, not its conmon's. With keep (the list before the
// cluster started: a CRI-O of the host's own) it removes the others.
func crioCgroups(t *testing.T, keep map[string]bool) map[string]bool {
	t.Helper()
	names, err := testutil.CgroupNames("crio*")
	if err != nil {
		t.Fatal(err)
	}
	all := map[string]bool{}
	for _, name := range names {
		if keep != nil {
			if err := testutil.RemoveCgroupTreeExcept(name, keep); err != nil {
				t.Errorf("leak: %v", err)
			}
			continue
		}
		tree, err := testutil.CgroupTree(name)
		if err != nil {
			t.Fatal(err)
		}
		maps.Copy(all, tree)
	}
	return all
}
