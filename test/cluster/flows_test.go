//go:build clustertest

package cluster

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/healthevents"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
)

// flow is one scenario of the issue, run in order against the same
// cluster. A pending flow is listed, not run: what it needs is not done yet
// (MOUNTPLAN_CLUSTER_PENDING=1 runs it anyway, for whoever is doing it).
type flow struct {
	name    string
	pending string
	run     func(t *testing.T, e *env)
}

var flows = []flow{
	{name: "DynamicPVC", run: dynamicPVC},
	{name: "HelmTest", run: helmTest}, // helmtest_flows_test.go
	{name: "CapacityTracking", run: capacityTracking},
	{name: "NodeRemovedForGood", run: nodeRemovedForGood},
	{name: "DrainNodeLocal", run: drainNodeLocal},
	{name: "CapacityAcrossNodes", run: capacityAcrossNodes},           // nodes_flows_test.go
	{name: "SnapshotsStayOnTheirNode", run: snapshotsStayOnTheirNode}, // nodes_flows_test.go
	{name: "PluginUnprivileged", run: pluginUnprivileged},
	{name: "CompromisedPlugin", run: compromisedPlugin},
	{name: "PodRecreated", run: podRecreated},
	{name: "TwoPodsRWO_RWOPRefused", run: twoPodsRWO},
	{name: "SnapshotRestoreClone", run: snapshotRestoreClone},
	{name: "InlineEphemeral", run: inlineEphemeral},
	{name: "FSGroupNonRoot", run: fsGroupNonRoot},
	{name: "SubPath", run: subPath},
	{name: "ReadOnly", run: readOnly},
	{name: "RawBlock", run: rawBlock},
	{name: "XFSStorageClass", run: xfsClass},
	{name: "StaticPVAdminRoot", run: staticPV},
	{name: "ChainOverlay", run: chainOverlay},
	{name: "FUSE", run: fuseVolumes},
	{name: "ExpandOnline", run: expandOnline},
	{name: "ExpandOffline", run: expandOffline},
	{name: "ExpandExt4", run: expandExt4},
	{name: "UserNSClassic", run: usernsClassic},   // userns_flows_test.go
	{name: "UserNSRawBlock", run: usernsRawBlock}, // userns_flows_test.go
	// NRI mode (nri_flows_test.go), in this order.
	{name: "NRIPVC", run: nriPVC},
	{name: "NRIPodRecreated", run: nriPodRecreated},
	{name: "NRITwoPodsRWO_RWOPRefused", run: nriTwoPodsRWO},
	{name: "NRISubPath", run: nriSubPath},
	{name: "NRIFSGroupNonRoot", run: nriFSGroup},
	{name: "NRISidecarsAndExpandOnline", run: nriSidecarsAndExpand},
	{name: "NRIStatsAllStopped", run: nriStatsAllStopped},
	{name: "NRIOnCRIO", run: nriOnCRIO, pending: crioPending()},         // crio_flows_test.go
	{name: "ContainerdKilledNRI", run: containerdKilledNRI},             // runtime_restart_flows_test.go
	{name: "CRIOKilledNRI", run: crioKilledNRI, pending: crioPending()}, // runtime_restart_flows_test.go
	{name: "UserNSNRI", run: usernsNRI},                                 // userns_flows_test.go
	{name: "NRIWritesSurviveMounterRollout", run: nriRollout},
	{name: "KillFUSEDaemonAndMounter", run: killFUSE},
	{name: "FUSEDaemonsSurviveMounterRollout", run: fuseDaemonsSurviveMounterRollout}, // fuse_rollout_flows_test.go
	{name: "VolumeHealthInPodStatus", run: volumeHealthInPodStatus},
	{name: "OperatorVolumesListing", run: operatorVolumes},
	// Before the writer of the next two flows starts: a reboot restarts
	// every container (reboot_flows_test.go).
	{name: "NodeReboot", run: nodeReboot},
	{name: "NodeRebootMidWork", run: nodeRebootMidWork},
	{name: "NodeRebootAgedInline", run: nodeRebootAgedInline},
	{name: "WritesSurviveRestarts", run: writesSurviveRestarts},
	{name: "HelmUninstallInUseAndReinstall", run: helmUninstallInUse},
}

// dynamicPVC: a claim of the chart's StorageClass, provisioned on the node
// of its first pod, written and read back.
func dynamicPVC(t *testing.T, e *env) {
	e.apply(t, pvc("data", storageClass, "64Mi"))
	e.run(t, pod("a1", withClaim("data", "/data", false)))
	e.shared["data"] = e.write(t, "a1", "/data/token")
	out := must(t)(e.c.podExec("a1", "df", "-k", "/data"))
	if !strings.Contains(out, "/data") {
		t.Errorf("df /data: %s", out)
	}
}

// podRecreated: the pod deleted and a new one on the same claim finds the data.
func podRecreated(t *testing.T, e *env) {
	e.c.deleteAndWait(t, "pod", "a1")
	e.run(t, pod("a2", withClaim("data", "/data", false)))
	e.expect(t, "a2", "/data/token", e.shared["data"])
	e.shared["data"] = e.write(t, "a2", "/data/token")
}

// twoPodsRWO: two pods of one node share a ReadWriteOnce claim; a second
// pod of a ReadWriteOncePod claim is refused until the first is gone.
func twoPodsRWO(t *testing.T, e *env) {
	e.run(t, pod("a3", withClaim("data", "/data", false)))
	e.expect(t, "a3", "/data/token", e.shared["data"])
	tok := e.write(t, "a3", "/data/token")
	e.expect(t, "a2", "/data/token", tok)
	e.shared["data"] = tok
	e.c.deleteAndWait(t, "pod", "a3")

	e.apply(t, pvc("once", storageClass, "32Mi", "ReadWriteOncePod"))
	e.run(t, pod("o1", withClaim("once", "/data", false)))
	tok = e.write(t, "o1", "/data/token")
	e.apply(t, pod("o2", withClaim("once", "/data", false)))
	waitFor(t, 60*time.Second, "o2 refused for ReadWriteOncePod", func() error {
		out, err := e.c.kubectl("-n", testNS, "get", "pod", "o2", "-o",
			`jsonpath={.status.phase} {.status.conditions[?(@.type=="PodScheduled")].reason}: {.status.conditions[?(@.type=="PodScheduled")].message}`)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(out, "Pending Unschedulable") || !strings.Contains(out, "ReadWriteOncePod") {
			return fmt.Errorf("o2: %s", out)
		}
		return nil
	})
	// Refused, not lost: once o1 is gone, o2 runs and finds the data.
	e.c.deleteAndWait(t, "pod", "o1")
	e.c.waitPod(t, "o2")
	e.expect(t, "o2", "/data/token", tok)
	e.c.deleteAndWait(t, "pod", "o2")
	e.c.deleteAndWait(t, "pvc", "once")
}

// deleteEverything deletes every object of the flows, uninstalls the chart
// and checks inside the node that nothing of the volumes is left: journal
// records, images, mounts of the state dir and of kubelet's volume paths,
// loop devices backed by the state dir's files.
func (e *env) deleteEverything(t *testing.T) {
	t.Helper()
	must(t)(e.c.kubectl("delete", "namespace", testNS, "--wait=true", "--timeout=180s"))
	// Static PVs (Retain: the images are the admin's) that a failed flow
	// left behind are deleted as the flow would have, so that the checks
	// below still look at everything else.
	if out, err := e.c.kubectl("get", "pv", "-o", `jsonpath={range .items[?(@.spec.persistentVolumeReclaimPolicy=="Retain")]}{.metadata.name}{"\n"}{end}`); err == nil {
		if names := strings.Fields(out); len(names) > 0 {
			t.Logf("deleting static PVs a failed flow left: %v", names)
			must(t)(e.c.kubectl(append([]string{"delete", "pv", "--wait=true", "--timeout=120s"}, names...)...))
		}
	}
	waitFor(t, 2*time.Minute, "every PersistentVolume deleted", func() error {
		out, err := e.c.kubectl("get", "pv", "-o", "name")
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "" {
			return fmt.Errorf("left: %s", out)
		}
		return nil
	})
	if recs := e.records(t); len(recs) != 0 {
		t.Errorf("journal records left with no volume: %v", recs)
	}
	must(t)(e.c.helm("uninstall", "mountplan", "--namespace", "kube-system", "--wait", "--timeout", "3m"))
	e.checkNoCapacityLeft(t)
	waitFor(t, 2*time.Minute, "no pod left", func() error {
		out, err := e.c.kubectl("get", "pods", "-A", "-o", "name")
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "" {
			return fmt.Errorf("left: %s", out)
		}
		return nil
	})
	e.checkNodeClean(t)
}

// inlineEphemeral: a CSI inline volume lives and dies with its pod. Its
// record is told apart by kind: an earlier flow's claim may still be
// being deleted.
func inlineEphemeral(t *testing.T, e *env) {
	if n := e.ephemeralRecords(t); n != 0 {
		t.Fatalf("%d inline volumes' records before the pod", n)
	}
	e.run(t, pod("eph", withInline("32Mi", "/scratch")))
	e.write(t, "eph", "/scratch/token")
	if n := e.ephemeralRecords(t); n != 1 {
		t.Errorf("%d inline volumes' records with the pod running, want 1", n)
	}
	e.inlineHealthEvents(t, "eph", "scratch")
	e.c.deleteAndWait(t, "pod", "eph")
	waitFor(t, 30*time.Second, "the inline volume's record removed", func() error {
		if n := e.ephemeralRecords(t); n != 0 {
			return fmt.Errorf("%d inline volumes' records", n)
		}
		return nil
	})
}

// inlineHealthEvents: an inline volume has no claim, so its health Events
// (mountplan-resizer's) go to its pod. Its image is moved away (the
// plugin's finding: ImageGone) and back (healthy again): the pod gets a
// VolumeConditionAbnormal and then a VolumeConditionNormal Event naming
// the pod's volume.
func (e *env) inlineHealthEvents(t *testing.T, podName, volume string) {
	uid := strings.TrimSpace(must(t)(e.c.kubectl("-n", testNS, "get", "pod", podName, "-o", "jsonpath={.metadata.uid}")))
	img := loop.ImagePath(e.c.cfg.path("state"), model.KindEphemeral, healthevents.InlineHandle(uid, volume))
	restore := moveAway(t, img)
	defer restore()
	for _, w := range []struct{ reason, says string }{{"VolumeConditionAbnormal", "ImageGone"}, {"VolumeConditionNormal", "healthy again"}} {
		waitFor(t, time.Minute, w.reason+" event on the inline volume's pod", func() error {
			msg, err := e.eventsOn(w.reason, "Pod", podName, uid)
			if err != nil {
				return err
			}
			if !strings.Contains(msg, "inline volume "+volume) || !strings.Contains(msg, w.says) {
				return fmt.Errorf("event %s on pod %s: %q, want the inline volume %s and %q", w.reason, podName, msg, volume, w.says)
			}
			t.Logf("event %s on pod %s: %s", w.reason, podName, msg)
			return nil
		})
		restore()
	}
}

// withInline mounts a CSI inline volume of the driver at path.
func withInline(size, path string) podOpt {
	return func(spec, ctr obj) {
		addVolume(spec, obj{"name": "scratch", "csi": obj{"driver": driverName, "volumeAttributes": obj{"size": size}}})
		addMount(ctr, obj{"name": "scratch", "mountPath": path})
	}
}

// ephemeralRecords counts the journal records of inline volumes.
func (e *env) ephemeralRecords(t *testing.T) int {
	t.Helper()
	n := 0
	for _, f := range e.records(t) {
		b, err := os.ReadFile(f)
		if errors.Is(err, os.ErrNotExist) {
			continue // removed since the listing
		}
		var rec struct {
			Kind model.Kind `json:"kind"`
		}
		if err == nil {
			err = json.Unmarshal(b, &rec)
		}
		if err != nil {
			t.Fatalf("journal record %s: %v", f, err)
		}
		if rec.Kind == model.KindEphemeral {
			n++
		}
	}
	return n
}

// fsGroupNonRoot: a pod running as uid 1000 writes to a volume that kubelet
// gave to its fsGroup (CSIDriver fsGroupPolicy File).
func fsGroupNonRoot(t *testing.T, e *env) {
	e.apply(t, pvc("fsg", storageClass, "32Mi"))
	e.run(t, pod("fsg", withClaim("fsg", "/data", false), func(spec, _ obj) {
		spec["securityContext"] = obj{"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000, "runAsNonRoot": true}
	}))
	if out := strings.TrimSpace(must(t)(e.c.podExec("fsg", "id", "-u"))); out != "1000" {
		t.Fatalf("id -u = %s", out)
	}
	e.write(t, "fsg", "/data/token")
	if out := strings.TrimSpace(must(t)(e.c.podExec("fsg", "stat", "-c", "%g", "/data", "/data/token"))); out != "2000\n2000" {
		t.Errorf("groups of /data and the new file: %q, want 2000 for both", out)
	}
	e.c.deleteAndWait(t, "pod", "fsg")
	e.c.deleteAndWait(t, "pvc", "fsg")
}

// subPath: a directory of the volume mounted alone, and the whole volume
// next to it in the same pod.
func subPath(t *testing.T, e *env) {
	e.apply(t, pvc("sub", storageClass, "32Mi"))
	e.run(t, pod("sub", func(spec, ctr obj) {
		addVolume(spec, obj{"name": "v", "persistentVolumeClaim": obj{"claimName": "sub"}})
		addMount(ctr, obj{"name": "v", "mountPath": "/sub", "subPath": "dir/inner"})
		addMount(ctr, obj{"name": "v", "mountPath": "/all"})
	}))
	tok := e.write(t, "sub", "/sub/token")
	e.expect(t, "sub", "/all/dir/inner/token", tok)
	e.c.deleteAndWait(t, "pod", "sub")
	e.c.deleteAndWait(t, "pvc", "sub")
}

// readOnly: a claim mounted read-only (the pod's volume says so) is read,
// and a write fails with EROFS.
func readOnly(t *testing.T, e *env) {
	e.run(t, pod("ro", withClaim("data", "/data", true)))
	e.expect(t, "ro", "/data/token", e.shared["data"])
	out, err := e.c.podExec("ro", "sh", "-c", "echo x > /data/other")
	if err == nil || !strings.Contains(out+err.Error(), "Read-only file system") {
		t.Errorf("write to a read-only volume: %v %s", err, out)
	}
	e.c.deleteAndWait(t, "pod", "ro")
}

// rawBlock: a block claim is a device in the pod; bytes written to it are
// read back, also by the next pod.
func rawBlock(t *testing.T, e *env) {
	claim := pvc("blk", storageClass, "32Mi")
	claim["spec"].(obj)["volumeMode"] = "Block"
	e.apply(t, claim)
	withDevice := withBlockClaim("blk", "/dev/xvda")
	e.run(t, pod("blk1", withDevice))
	must(t)(e.c.podExec("blk1", "sh", "-c",
		"dd if=/dev/urandom of=/tmp/x bs=4096 count=64 2>/dev/null && dd if=/tmp/x of=/dev/xvda bs=4096 count=64 conv=fsync 2>/dev/null && md5sum < /tmp/x"))
	sum := strings.TrimSpace(must(t)(e.c.podExec("blk1", "sh", "-c", "md5sum < /tmp/x")))
	read := func(p string) string {
		return strings.TrimSpace(must(t)(e.c.podExec(p, "sh", "-c", "dd if=/dev/xvda bs=4096 count=64 2>/dev/null | md5sum")))
	}
	if got := read("blk1"); got != sum {
		t.Fatalf("device reads %s, wrote %s", got, sum)
	}
	e.c.deleteAndWait(t, "pod", "blk1")
	e.run(t, pod("blk2", withDevice))
	if got := read("blk2"); got != sum {
		t.Fatalf("the next pod reads %s, wrote %s", got, sum)
	}
	e.c.deleteAndWait(t, "pod", "blk2")
	e.c.deleteAndWait(t, "pvc", "blk")
}

// withBlockClaim gives the container a block claim's device at path.
func withBlockClaim(claim, path string) podOpt {
	return func(spec, ctr obj) {
		addVolume(spec, obj{"name": claim, "persistentVolumeClaim": obj{"claimName": claim}})
		ctr["volumeDevices"] = []obj{{"name": claim, "devicePath": path}}
	}
}

// xfsStorageClass is a StorageClass of the admin's asking for xfs.
func xfsStorageClass() obj {
	return obj{"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": obj{"name": "mountplan-xfs"},
		"provisioner": driverName, "parameters": obj{"type": "loop", "csi.storage.k8s.io/fstype": "xfs"},
		"volumeBindingMode": "WaitForFirstConsumer", "allowVolumeExpansion": true, "reclaimPolicy": "Delete"}
}

// xfsClass: a StorageClass of the admin's asking for xfs.
func xfsClass(t *testing.T, e *env) {
	e.apply(t, xfsStorageClass())
	e.apply(t, pvc("xfs", "mountplan-xfs", "300Mi"))
	e.run(t, pod("xfs", withClaim("xfs", "/data", false)))
	if out := strings.TrimSpace(must(t)(e.c.podExec("xfs", "stat", "-f", "-c", "%T", "/data"))); out != "xfs" {
		t.Errorf("filesystem type %q, want xfs", out)
	}
	e.shared["xfs"] = e.write(t, "xfs", "/data/token")
	// The pod stays for ExpandOnline.
}

// staticPV: an admin's ext4 image under config.imageRoots, as a static PV
// (issue 9 item 1: the root was not mounted into the plugin's container).
func staticPV(t *testing.T, e *env) {
	dir := t.TempDir()
	tok := token()
	if err := os.WriteFile(filepath.Join(dir, "tool"), []byte(tok+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := e.c.cfg.path("srv", "images", "tools.ext4")
	hostRun(t, "mkfs.ext4", "-q", "-F", "-d", dir, img, "32M")
	e.apply(t, staticVolume("tools", "32Mi", obj{"type": "loop", "image": img}, "ReadWriteOnce"), boundClaim("tools", "32Mi", "ReadWriteOnce"))
	e.run(t, pod("tools", withClaim("tools", "/tools", false)))
	e.expect(t, "tools", "/tools/tool", tok)
	e.write(t, "tools", "/tools/new")
	e.c.deleteAndWait(t, "pod", "tools")
	e.c.deleteAndWait(t, "pvc", "tools")
	must(t)(e.c.kubectl("delete", "pv", "tools", "--wait=true", "--timeout=60s"))
}

// staticVolume is a static PV of the driver (Retain: the image is the admin's).
func staticVolume(name, size string, attrs obj, mode string) obj {
	return obj{"apiVersion": "v1", "kind": "PersistentVolume", "metadata": obj{"name": name},
		"spec": obj{"capacity": obj{"storage": size}, "accessModes": []string{mode}, "storageClassName": "",
			"persistentVolumeReclaimPolicy": "Retain",
			"csi":                           obj{"driver": driverName, "volumeHandle": name, "volumeAttributes": attrs}}}
}

// boundClaim is a claim bound to the PV of the same name.
func boundClaim(name, size, mode string) obj {
	c := pvc(name, "", size, mode)
	c["spec"].(obj)["storageClassName"] = ""
	c["spec"].(obj)["volumeName"] = name
	return c
}

// chainOverlay: squashfs and erofs images under an admin root, each with a
// writable overlay: the base is read, writes land in the overlay.
func chainOverlay(t *testing.T, e *env) {
	dir := t.TempDir()
	tok := token()
	if err := os.WriteFile(filepath.Join(dir, "base"), []byte(tok+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sq, ero := e.c.cfg.path("srv", "images", "base.sqfs"), e.c.cfg.path("srv", "images", "base.erofs")
	hostRun(t, "mksquashfs", dir, sq, "-quiet", "-noappend")
	hostRun(t, "mkfs.erofs", ero, dir)
	for _, v := range []struct{ name, image string }{{"chain-sqfs", sq}, {"chain-erofs", ero}} {
		e.apply(t, staticVolume(v.name, "64Mi", obj{"type": "loop", "image": v.image, "overlay": "true"}, "ReadWriteOnce"),
			boundClaim(v.name, "64Mi", "ReadWriteOnce"))
		e.run(t, pod(v.name, withClaim(v.name, "/data", false)))
		e.expect(t, v.name, "/data/base", tok)
		e.write(t, v.name, "/data/upper")
		if out := strings.TrimSpace(must(t)(e.c.podExec(v.name, "awk", "$2 == \"/data\" { print $3 }", "/proc/mounts"))); out != "overlay" {
			t.Errorf("%s: filesystem %q at /data, want overlay", v.name, out)
		}
		e.c.deleteAndWait(t, "pod", v.name)
		e.c.deleteAndWait(t, "pvc", v.name)
		must(t)(e.c.kubectl("delete", "pv", v.name, "--wait=true", "--timeout=60s"))
	}
}

// fuseVolumes: a squashfuse volume whose image lies under the profile's
// root (item 1 again, now for the daemons in the mounter's container), and
// an rclone volume whose remote is configured by a Secret delivered as a
// node-stage secret.
func fuseVolumes(t *testing.T, e *env) {
	sqTok, rcTok := e.fuseSetup(t)
	e.run(t, pod("sqfuse", withClaim("sqfuse", "/data", true)), pod("rclone", withClaim("rclone", "/data", false)))
	e.expect(t, "sqfuse", "/data/file", sqTok)
	e.expect(t, "rclone", "/data/file", rcTok)
	tok := e.write(t, "rclone", "/data/file")
	waitFor(t, 10*time.Second, "the write through rclone on the remote", func() error {
		b, err := os.ReadFile(filepath.Join(e.c.cfg.path("srv", "fuse", "rclone"), "file"))
		if err != nil || strings.TrimSpace(string(b)) != tok {
			return fmt.Errorf("%q %v", b, err)
		}
		return nil
	})
	e.fuseTeardown(t, "sqfuse", "rclone")
}

// fuseSetup makes a squashfs image under the squashfuse profile's root and
// an rclone remote (a directory) configured by a Secret, their PVs and
// claims, and returns the token each holds in its file.
func (e *env) fuseSetup(t *testing.T) (sqTok, rcTok string) {
	t.Helper()
	dir := t.TempDir()
	sqTok, rcTok = token(), token()
	if err := os.WriteFile(filepath.Join(dir, "file"), []byte(sqTok+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := e.c.cfg.path("srv", "fuse", "tree.sqfs")
	hostRun(t, "mksquashfs", dir, img, "-quiet", "-noappend")
	// Node-local volumes have SINGLE_NODE_* modes only: a read-only
	// filesystem is a ReadWriteOnce claim the pod mounts read-only.
	e.apply(t, staticVolume("sqfuse", "16Mi", obj{"type": "fuse", "profile": "squashfuse", "source": img}, "ReadWriteOnce"),
		boundClaim("sqfuse", "16Mi", "ReadWriteOnce"))
	remote := e.c.cfg.path("srv", "fuse", "rclone")
	if err := os.WriteFile(filepath.Join(remote, "file"), []byte(rcTok+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.apply(t, obj{"apiVersion": "v1", "kind": "Secret", "metadata": obj{"name": "rclone-conf", "namespace": testNS},
		"stringData": obj{"rcloneConf": "[data]\ntype = alias\nremote = " + remote + "\n"}})
	v := staticVolume("rclone", "16Mi", obj{"type": "fuse", "profile": "rclone", "source": "data:"}, "ReadWriteOnce")
	v["spec"].(obj)["csi"].(obj)["nodeStageSecretRef"] = obj{"name": "rclone-conf", "namespace": testNS}
	e.apply(t, v, boundClaim("rclone", "16Mi", "ReadWriteOnce"))
	return sqTok, rcTok
}

// fuseTeardown deletes pods of the same names as the FUSE volumes, the
// claims and the PVs.
func (e *env) fuseTeardown(t *testing.T, names ...string) {
	t.Helper()
	for _, n := range names {
		e.c.deleteAndWait(t, "pod", n)
		e.c.deleteAndWait(t, "pvc", n)
		must(t)(e.c.kubectl("delete", "pv", n, "--wait=true", "--timeout=60s"))
	}
}

// killFUSE: the FUSE daemons killed (kill -9), then the mounter's
// container (the daemons, in cgroups of their own, outlive it: the new
// mounter adopts them), while pods use their mounts: each
// pod's own copy of the mount must heal in place, and the time from the
// kill to the first good read (and, on the writable rclone volume, write
// and read back) in each pod is measured, the pods polled in parallel.
func killFUSE(t *testing.T, e *env) {
	sqTok, rcTok := e.fuseSetup(t)
	e.run(t, pod("sqfuse", withClaim("sqfuse", "/data", true)), pod("rclone", withClaim("rclone", "/data", false)))
	checks := map[string]func(tag string) error{
		"sqfuse": func(string) error { return e.podHolds("sqfuse", "/data/file", sqTok) },
		"rclone": func(tag string) error {
			out, err := e.c.podExec("rclone", "sh", "-c", fmt.Sprintf("echo %s > /data/%s && cat /data/%s /data/file", tag, tag, tag))
			if err != nil {
				return err
			}
			if want := tag + "\n" + rcTok + "\n"; out != want {
				return fmt.Errorf("wrote and read back %q, want %q", out, want)
			}
			return nil
		},
	}
	for p, check := range checks {
		if err := check("before"); err != nil {
			t.Fatalf("%s before the kills: %v", p, err)
		}
	}
	daemons := map[string]int{}
	for _, daemon := range []string{"squashfuse", "rclone"} {
		// Not in the mounter's container: in cgroups of their own
		// (fuse_rollout_flows_test.go).
		daemons[daemon] = e.daemonPID(t, daemon)
	}
	wantUnprivilegedDaemon(t, "squashfuse", daemons["squashfuse"])
	e.healAfter(t, "kill -9 of the daemons", "healed-1", checks, func() {
		for _, pid := range daemons {
			if err := unix.Kill(pid, unix.SIGKILL); err != nil {
				t.Fatal(err)
			}
		}
	})
	mounter := e.containerPID(t, mounterComponent, mounterContainer, mounterComm)
	e.healAfter(t, "kill -9 of the mounter container", "healed-2", checks, func() {
		if err := unix.Kill(mounter, unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
	})
	if got, err := os.ReadFile(e.c.cfg.path("srv", "fuse", "rclone", "healed-2")); err != nil || string(got) != "healed-2\n" {
		t.Errorf("the rclone backend holds %q (%v) for the pod's last write", got, err)
	}
	e.fuseTeardown(t, "sqfuse", "rclone")
}

// healAfter runs kill, then polls every pod's check in parallel until it
// passes and logs the time from the kill to then. The checks get tag, the
// name of a file to write.
func (e *env) healAfter(t *testing.T, event, tag string, checks map[string]func(tag string) error, kill func()) {
	t.Helper()
	start := time.Now()
	kill()
	var wg sync.WaitGroup
	for p, check := range checks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			for time.Since(start) < 90*time.Second {
				if err = check(tag); err == nil {
					t.Logf("heal time after %s: pod %s reads (and writes) again %v after the kill", event, p, time.Since(start).Round(10*time.Millisecond))
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Errorf("after %s, pod %s does not work again within 90s: %v", event, p, err)
		}()
	}
	wg.Wait()
}

// podHolds checks a file's content in a pod.
func (e *env) podHolds(pod, file, want string) error {
	out, err := e.c.podExec(pod, "cat", file)
	if err != nil {
		return err
	}
	if got := strings.TrimSpace(out); got != want {
		return fmt.Errorf("%s holds %q, want %q", file, got, want)
	}
	return nil
}

// fsSize is the size of the filesystem at path in a pod, in KiB.
func (e *env) fsSize(t *testing.T, pod, path string) int {
	t.Helper()
	out := must(t)(e.c.podExec(pod, "df", "-k", path))
	lines := strings.Split(strings.TrimSpace(out), "\n")
	f := strings.Fields(lines[len(lines)-1])
	n, err := strconv.Atoi(f[1])
	if err != nil {
		t.Fatalf("df: %s", out)
	}
	return n
}

// resize asks for a new size and waits until the claim reports it.
func (e *env) resize(t *testing.T, claim, size string) {
	t.Helper()
	must(t)(e.c.kubectl("-n", testNS, "patch", "pvc", claim, "--type=merge", "-p",
		fmt.Sprintf(`{"spec":{"resources":{"requests":{"storage":%q}}}}`, size)))
}

func (e *env) waitCapacity(t *testing.T, claim, size string) {
	t.Helper()
	waitFor(t, 90*time.Second, claim+" capacity "+size, func() error {
		out, err := e.c.kubectl("-n", testNS, "get", "pvc", claim, "-o", "jsonpath={.status.capacity.storage} {.status.conditions}")
		if err != nil {
			return err
		}
		if !strings.HasPrefix(out, size+" ") && out != size {
			return fmt.Errorf("%s", out)
		}
		return nil
	})
}

// expandOnline: the xfs claim grows while its pod runs (mountplan-resizer,
// then kubelet's NodeExpandVolume on the mounted filesystem).
func expandOnline(t *testing.T, e *env) {
	before := e.fsSize(t, "xfs", "/data")
	e.resize(t, "xfs", "600Mi")
	e.waitCapacity(t, "xfs", "600Mi")
	if after := e.fsSize(t, "xfs", "/data"); after < before+250*1024 {
		t.Errorf("filesystem %d KiB after the resize, was %d", after, before)
	}
	e.expect(t, "xfs", "/data/token", e.shared["xfs"])
	e.write(t, "xfs", "/data/token")
	e.c.deleteAndWait(t, "pod", "xfs")
	e.c.deleteAndWait(t, "pvc", "xfs")
}

// expandOffline: an xfs claim grows while no pod uses it; the filesystem
// grows when the next pod mounts it (kubelet's NodeExpandVolume after the
// publish).
func expandOffline(t *testing.T, e *env) {
	e.apply(t, pvc("grow", "mountplan-xfs", "300Mi"))
	e.run(t, pod("grow1", withClaim("grow", "/data", false)))
	tok := e.write(t, "grow1", "/data/token")
	before := e.fsSize(t, "grow1", "/data")
	e.c.deleteAndWait(t, "pod", "grow1")
	e.resize(t, "grow", "600Mi")
	e.waitResizeState(t, "grow", "NodeResizePending")
	e.run(t, pod("grow2", withClaim("grow", "/data", false)))
	e.waitCapacity(t, "grow", "600Mi")
	if after := e.fsSize(t, "grow2", "/data"); after < before+250*1024 {
		t.Errorf("filesystem %d KiB after the resize, was %d", after, before)
	}
	e.expect(t, "grow2", "/data/token", tok)
	e.c.deleteAndWait(t, "pod", "grow2")
	e.c.deleteAndWait(t, "pvc", "grow")
}

// waitResizeState waits for the claim's allocatedResourceStatuses.storage.
func (e *env) waitResizeState(t *testing.T, claim, state string) {
	t.Helper()
	waitFor(t, 60*time.Second, claim+" resize state "+state, func() error {
		out, err := e.c.kubectl("-n", testNS, "get", "pvc", claim, "-o", "jsonpath={.status.allocatedResourceStatuses.storage}")
		if err != nil {
			return err
		}
		if out != state {
			return fmt.Errorf("allocatedResourceStatuses %q", out)
		}
		return nil
	})
}

// expandExt4: kubelet grows a filesystem only once it is published, so an
// ext4 volume always grows online (resize2fs through the kernel's resize
// ioctl), which needs CAP_SYS_RESOURCE in the mounter's container (the
// plugin has no capability; the mounter runs the tool). Where the container
// has it, the claim grows; where it has not (this kind of machine: not even
// privileged containers get it), the claim must say why, and the volume
// keeps working at its old size.
func expandExt4(t *testing.T, e *env) {
	e.apply(t, pvc("ext", storageClass, "32Mi"))
	e.run(t, pod("ext", withClaim("ext", "/data", false)))
	tok := e.write(t, "ext", "/data/token")
	before := e.fsSize(t, "ext", "/data")
	e.resize(t, "ext", "64Mi")
	if e.has(t, e.containerPID(t, mounterComponent, mounterContainer, mounterComm), capSysResource) {
		e.waitCapacity(t, "ext", "64Mi")
		if after := e.fsSize(t, "ext", "/data"); after < before+20*1024 {
			t.Errorf("filesystem %d KiB after the resize, was %d", after, before)
		}
	} else {
		// Two minutes: the claim's resize goes through the resizer's and
		// kubelet's queues, whose backoffs earlier flows' resizes may have
		// raised (a fresh CI run waited past one minute once).
		waitFor(t, 2*time.Minute, "the claim's NodeResizeError naming CAP_SYS_RESOURCE", func() error {
			out, err := e.c.kubectl("-n", testNS, "get", "pvc", "ext", "-o", `jsonpath={.status.conditions[?(@.type=="NodeResizeError")].message}`)
			if err != nil {
				return err
			}
			if !strings.Contains(out, "CAP_SYS_RESOURCE") {
				return fmt.Errorf("NodeResizeError %q", out)
			}
			return nil
		})
		t.Logf("ext4 online growth needs CAP_SYS_RESOURCE, which this machine's containers lack: the claim says so")
	}
	e.expect(t, "ext", "/data/token", tok)
	e.write(t, "ext", "/data/token")
	e.c.deleteAndWait(t, "pod", "ext")
	e.c.deleteAndWait(t, "pvc", "ext")
}

// wantUnprivilegedDaemon: a daemon of an fd-mode profile (issue 34), from
// its own /proc status: not root, no capability in any set, no new
// privileges.
func wantUnprivilegedDaemon(t *testing.T, name string, pid int) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	var seen []string
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		v = strings.TrimSpace(v)
		switch {
		case !ok:
		case k == "Uid":
			seen = append(seen, l)
			if strings.HasPrefix(v, "0") {
				t.Errorf("the %s daemon (host PID %d) runs as root: %s", name, pid, l)
			}
		case k == "CapPrm" || k == "CapEff" || k == "CapBnd" || k == "CapAmb":
			seen = append(seen, l)
			if v != "0000000000000000" {
				t.Errorf("the %s daemon (host PID %d) holds capabilities: %s", name, pid, l)
			}
		case k == "NoNewPrivs":
			seen = append(seen, l)
			if v != "1" {
				t.Errorf("the %s daemon (host PID %d) may gain privileges: %s", name, pid, l)
			}
		}
	}
	if len(seen) != 6 {
		t.Errorf("the %s daemon's status shows %q, want Uid, the four capability sets and NoNewPrivs", name, seen)
	}
	t.Logf("the %s daemon (host PID %d): %s", name, pid, strings.Join(seen, "; "))
}

// Capabilities' bits in /proc/PID/status CapEff.
const (
	capSysAdmin    = 21
	capSysResource = 24
)

// has says whether a process (a host PID) holds a capability.
func (e *env) has(t *testing.T, pid int, bit uint) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	caps, err := capEff(string(b))
	if err != nil {
		t.Fatalf("process %d: %v", pid, err)
	}
	return caps&(1<<bit) != 0
}

// capEff reads CapEff from a /proc/PID/status text.
func capEff(status string) (uint64, error) {
	for _, l := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	return 0, fmt.Errorf("no CapEff in %q", status)
}

// writer is a pod that appends a counter to a file every 100 ms and notes
// every failed write apart.
func writer(name, claim string) obj {
	return pod(name, withClaim(claim, "/data", false), withScript(
		"trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); echo $i >> /data/log || echo $i >> /tmp/failed; sleep 0.1; done"))
}

// checkWrites: no write failed, none is missing, and the counter moves.
func (e *env) checkWrites(t *testing.T, pod string, last *int) {
	t.Helper()
	if out, err := e.c.podExec(pod, "sh", "-c", "cat /tmp/failed 2>/dev/null | wc -l"); err != nil || strings.TrimSpace(out) != "0" {
		t.Fatalf("failed writes: %s %v", out, err)
	}
	out := must(t)(e.c.podExec(pod, "awk", "$1 != NR { print \"gap at line \" NR \": \" $1; exit 1 } END { print NR }", "/data/log"))
	n, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("log: %s", out)
	}
	if n <= *last {
		t.Fatalf("%d writes, %d before: the writer is stuck", n, *last)
	}
	*last = n
}

// writesSurviveRestarts: a pod writes every 100 ms through a plugin
// container restart, a mounter container restart (after which a new volume
// is provisioned, staged and mounted through the new mounter), a rolling
// update of both DaemonSets and a kubelet restart.
func writesSurviveRestarts(t *testing.T, e *env) {
	e.apply(t, pvc("w", storageClass, "32Mi"))
	e.run(t, writer("w", "w"))
	last := 0
	sleep(time.Second)
	e.checkWrites(t, "w", &last)

	// The plugin's container, then the mounter's: each one's process killed
	// (found by its container's name), kubelet restarts the container.
	for _, k := range []struct{ component, container, comm string }{
		{nodeComponent, pluginContainer, pluginComm},
		{mounterComponent, mounterContainer, mounterComm},
	} {
		was := e.containerStatus(t, k.component, k.container, "restartCount")
		start := time.Now()
		if err := unix.Kill(e.containerPID(t, k.component, k.container, k.comm), unix.SIGKILL); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 90*time.Second, "the "+k.container+" container restarted", func() error {
			if now := e.containerStatus(t, k.component, k.container, "restartCount"); now == was {
				return fmt.Errorf("restartCount %s", now)
			}
			return nil
		})
		must(t)(e.c.kubectl("-n", "kube-system", "wait", "--for=condition=Ready", "pod", "-l",
			"app.kubernetes.io/name=mountplan,app.kubernetes.io/component="+k.component, "--timeout=90s"))
		t.Logf("the %s container killed and Ready again in %v", k.container, time.Since(start).Round(time.Millisecond))
		sleep(2 * time.Second)
		e.checkWrites(t, "w", &last)
	}
	// The new mounter does its work: a new volume provisioned, attached,
	// formatted and mounted, written and read back.
	e.apply(t, pvc("after-mounter", storageClass, "32Mi"))
	e.run(t, pod("after-mounter", withClaim("after-mounter", "/data", false)))
	e.write(t, "after-mounter", "/data/token")
	e.c.deleteAndWait(t, "pod", "after-mounter")
	e.c.deleteAndWait(t, "pvc", "after-mounter")
	e.checkWrites(t, "w", &last)

	// A rolling update of both DaemonSets: every container replaced.
	e.rollout++
	e.install(t)
	sleep(2 * time.Second)
	e.checkWrites(t, "w", &last)

	// kubelet restarted (the node restarts it).
	kubelet := e.c.pidOf(t, "kubelet")
	if err := unix.Kill(kubelet, unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 60*time.Second, "a new kubelet", func() error {
		if unix.Kill(kubelet, 0) == nil {
			return fmt.Errorf("kubelet %d still running", kubelet)
		}
		for _, c := range e.c.procs() {
			if c == "kubelet" {
				return nil
			}
		}
		return fmt.Errorf("no kubelet")
	})
	e.c.waitNodeReady(t)
	sleep(5 * time.Second)
	e.checkWrites(t, "w", &last)
	// The writer stays for HelmUninstallInUseAndReinstall.
}

// helmUninstallInUse: the chart uninstalled while a pod writes to a volume
// and installed again; the pod keeps writing, and its volume is unpublished,
// unstaged and deleted by the new installation.
func helmUninstallInUse(t *testing.T, e *env) {
	last := 0
	e.checkWrites(t, "w", &last)
	must(t)(e.c.helm("uninstall", "mountplan", "--namespace", "kube-system", "--wait", "--timeout", "3m"))
	sleep(3 * time.Second)
	e.checkNoCapacityLeft(t)
	e.checkWrites(t, "w", &last)
	e.install(t)
	sleep(2 * time.Second)
	e.checkWrites(t, "w", &last)
	e.c.deleteAndWait(t, "pod", "w")
	e.c.deleteAndWait(t, "pvc", "w")
}
