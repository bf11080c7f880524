//go:build clustertest

package cluster

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// snapshotClass is the chart's VolumeSnapshotClass (snapshots.enabled).
const snapshotClass = "mountplan-loop"

// snapshotRestoreClone: a VolumeSnapshot of a claim in use (the node's
// csi-snapshotter takes it, the filesystem frozen for the copy), a bigger
// claim restored from it and a claim cloned from the source afterwards,
// each read by a pod: the restore holds what was there at the snapshot, the
// clone what was there at the clone. Deleting the snapshot deletes its copy
// on the node.
func snapshotRestoreClone(t *testing.T, e *env) {
	before := e.shared["data"]
	e.apply(t, obj{"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
		"metadata": obj{"name": "snap", "namespace": testNS},
		"spec":     obj{"volumeSnapshotClassName": snapshotClass, "source": obj{"persistentVolumeClaimName": "data"}}})
	start := time.Now()
	e.waitSnapshotReady(t, "snap")
	t.Logf("snapshot of a 64 MiB claim in use ready in %v", time.Since(start).Round(time.Millisecond))
	if copies := e.snapshotCopies(t); len(copies) != 2 || filepath.Ext(copies[0]) != ".json" || filepath.Ext(copies[1]) != ".img" {
		t.Errorf("snapshots on the node: %v, want one record and its image", copies)
	}
	after := e.write(t, "a2", "/data/token")
	e.shared["data"] = after

	restored := pvc("restored", storageClass, "96Mi")
	restored["spec"].(obj)["dataSource"] = obj{"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"}
	cloned := pvc("cloned", storageClass, "64Mi")
	cloned["spec"].(obj)["dataSource"] = obj{"kind": "PersistentVolumeClaim", "name": "data"}
	e.apply(t, restored, cloned)
	e.run(t, pod("r1", withClaim("restored", "/data", false)), pod("c1", withClaim("cloned", "/data", false)))
	e.expect(t, "r1", "/data/token", before)
	e.expect(t, "c1", "/data/token", after)
	if src, got := e.fsSize(t, "a2", "/data"), e.fsSize(t, "r1", "/data"); got <= src {
		t.Errorf("restore of 96Mi has a filesystem of %d KiB, the 64Mi source %d KiB: not grown", got, src)
	}
	// A copy is a volume of its own: writes do not reach the source.
	e.write(t, "c1", "/data/token")
	e.expect(t, "a2", "/data/token", after)

	e.c.deleteAndWait(t, "pod", "r1", "c1")
	e.c.deleteAndWait(t, "pvc", "restored", "cloned")
	e.c.deleteAndWait(t, "volumesnapshot", "snap")
	waitFor(t, time.Minute, "the snapshot's content and its copy on the node deleted", func() error {
		out, err := e.c.kubectl("get", "volumesnapshotcontent", "-o", "name")
		if err != nil {
			return err
		}
		if left := strings.TrimSpace(out); left != "" {
			return fmt.Errorf("contents left: %s", left)
		}
		if copies := e.snapshotCopies(t); len(copies) != 0 {
			return fmt.Errorf("copies left on the node: %v", copies)
		}
		return nil
	})
}

// waitSnapshotReady waits until a VolumeSnapshot is ready to use.
// (name as qualified takes it).
func (e *env) waitSnapshotReady(t *testing.T, snapshot string) {
	t.Helper()
	ns, name := qualified(snapshot)
	waitFor(t, 2*time.Minute, snapshot+" ready to use", func() error {
		out, err := e.c.kubectl("-n", ns, "get", "volumesnapshot", name, "-o",
			"jsonpath={.status.readyToUse}/{.status.restoreSize}/{.status.error.message}")
		if err != nil {
			return err
		}
		if !strings.HasPrefix(out, "true/") {
			return fmt.Errorf("readyToUse/restoreSize/error: %q", out)
		}
		return nil
	})
}

// snapshotCopies lists the plugin's snapshot records and images on the node.
func (e *env) snapshotCopies(t *testing.T) []string {
	t.Helper()
	var all []string
	for _, pattern := range []string{e.c.cfg.path("state", "snapshots", "*.json"), e.c.cfg.path("state", "images", "snapshots", "*.img")} {
		m, err := filepath.Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, m...)
	}
	return all
}
