package chart_test

import (
	"path/filepath"
	"testing"
)

// TestSnapshotter: with snapshots.enabled the node pods run csi-snapshotter
// in its node-deployment mode beside the plugin's socket, the ServiceAccount
// may do what external-snapshotter's RBAC asks and read a restore's
// VolumeSnapshot, and a VolumeSnapshotClass names the driver; without it
// none of that is rendered.
func TestSnapshotter(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		enabled := r.value(t, "snapshots.enabled") == true
		if !enabled {
			if r.hasContainer("csi-snapshotter") || r.vsc != nil {
				t.Error("snapshots disabled, yet csi-snapshotter or a VolumeSnapshotClass is rendered")
			}
			if allows(r.role, "snapshot.storage.k8s.io", "volumesnapshotcontents", "update") {
				t.Error("snapshots disabled, yet the ClusterRole may update VolumeSnapshotContents")
			}
			return
		}
		c := r.container(t, "csi-snapshotter")
		sock := socketPath(t, csiEndpoint)
		wantArg(t, c, "--csi-address", sock)
		r.mountAt(t, c, filepath.Dir(sock))
		wantArg(t, c, "--node-deployment", "")
		envFromNodeName(t, c, "NODE_NAME")
		need := []struct {
			resource string
			verbs    []string
		}{
			{"volumesnapshotclasses", []string{"get", "list", "watch"}},
			{"volumesnapshotcontents", []string{"get", "list", "watch", "update", "patch"}},
			{"volumesnapshotcontents/status", []string{"update", "patch"}},
			{"volumesnapshots", []string{"get", "list"}},
		}
		for _, n := range need {
			for _, verb := range n.verbs {
				if !allows(r.role, "snapshot.storage.k8s.io", n.resource, verb) {
					t.Errorf("ClusterRole %s does not allow %s %s", r.role.Name, verb, n.resource)
				}
			}
		}
		if r.value(t, "snapshots.volumeSnapshotClass.create") != true {
			if r.vsc != nil {
				t.Error("volumeSnapshotClass.create false, yet a VolumeSnapshotClass is rendered")
			}
			return
		}
		if r.vsc == nil {
			t.Fatal("no VolumeSnapshotClass")
		}
		if want := r.value(t, "driverName"); r.vsc.Driver != want {
			t.Errorf("VolumeSnapshotClass driver %q, want %v", r.vsc.Driver, want)
		}
		if want := r.value(t, "snapshots.volumeSnapshotClass.name"); r.vsc.Name != want {
			t.Errorf("VolumeSnapshotClass name %q, want %v", r.vsc.Name, want)
		}
		if want := r.value(t, "snapshots.volumeSnapshotClass.deletionPolicy"); r.vsc.DeletionPolicy != want {
			t.Errorf("VolumeSnapshotClass deletionPolicy %q, want %v", r.vsc.DeletionPolicy, want)
		}
		isDefault := r.vsc.Annotations["snapshot.storage.kubernetes.io/is-default-class"] == "true"
		if isDefault != (r.value(t, "snapshots.volumeSnapshotClass.isDefault") == true) {
			t.Errorf("VolumeSnapshotClass default annotation %v, want %v", isDefault, !isDefault)
		}
	})
}
