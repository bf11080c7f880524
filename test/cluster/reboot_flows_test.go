//go:build clustertest

package cluster

// The node's reboot (issue 24): a power loss of the node (Cluster.reboot)
// while pods of every kind of volume run, each having written and synced
// data; after the boot every pod runs again with its data, the
// filesystems check clean once the pods are gone, and once the claims are
// gone nothing of them is left on the node.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/model"
)

// rebootFile is a token a pod wrote before the reboot, read back after.
type rebootFile struct {
	pod, file string
	writable  bool // written again after the reboot
	tok       string
}

// rebootFS is a filesystem checked with its tool once its pods are gone.
type rebootFS struct{ claim, fsType string }

const rebootSTS = "rb-sts"

// nodeReboot: a dynamic ext4 claim, an xfs claim, a raw block claim, an
// overlay chain with a scratch upper, the squashfuse and rclone volumes
// (rclone's remote from a Secret), an NRI claim, a StatefulSet of 3 and an
// inline volume, each in a pod that wrote and synced a token; the node is
// rebooted; every pod runs again (the same pod, its containers restarted
// by kubelet) with its token, and the writable ones write again. The time
// from the node's start to every pod running is logged. Then the pods go,
// each filesystem checks clean (e2fsck -n, xfs_repair -n on the images),
// the claims go, and no record, loop device or FUSE connection of them is
// left.
func nodeReboot(t *testing.T, e *env) {
	fuseBefore := fuseConnections()
	files, block, sqTok, baseTok := e.rebootWorkloads(t)
	for i := range files {
		files[i].tok = e.write(t, files[i].pod, files[i].file)
	}
	e.write(t, "rb-chain", "/data/upper")
	uids := e.podUIDs(t)

	e.c.reboot(t)
	e.waitRecovered(t)

	for _, f := range files {
		e.expect(t, f.pod, f.file, f.tok)
	}
	e.expect(t, "sqfuse", "/data/file", sqTok)
	if got := e.blockSum(t, "rb-blk"); got != block {
		t.Errorf("the raw block device reads %s after the reboot, %s was written", got, block)
	}
	e.wantFSInPod(t, "rb-nri", "/data", "ext4", "/dev/loop")
	// The overlay chain: its base again, and an upper built anew, since
	// docs/sources.md says a reboot loses the upper's writes (the upper is
	// only valid with its own work dir).
	e.expect(t, "rb-chain", "/data/base", baseTok)
	if out, err := e.c.podExec("rb-chain", "ls", "/data"); err != nil || slices.Contains(strings.Fields(out), "upper") {
		t.Errorf("the overlay's upper after the reboot: %q %v; docs/sources.md says its writes are lost", out, err)
	}
	e.write(t, "rb-chain", "/data/upper")
	for _, f := range files {
		if f.writable {
			e.write(t, f.pod, f.file)
		}
	}
	for name, uid := range e.podUIDs(t) {
		if was, ok := uids[name]; !ok || was != uid {
			t.Logf("pod %s recreated by its controller after the reboot", name)
		}
	}
	e.rebootTeardown(t, fuseBefore)
}

// rebootWorkloads creates the flow's volumes and pods and waits until they
// run; it returns the files to write and read back, the checksum of what
// it wrote to the raw block device, the squashfuse image's token and the
// overlay chain's base's.
func (e *env) rebootWorkloads(t *testing.T) (files []rebootFile, block, sqTok, baseTok string) {
	t.Helper()
	e.apply(t, xfsStorageClass(), e.nriStorageClass())
	blk := pvc("rb-blk", storageClass, "32Mi")
	blk["spec"].(obj)["volumeMode"] = "Block"
	e.apply(t, pvc("rb-ext4", storageClass, "64Mi"), pvc("rb-xfs", "mountplan-xfs", "300Mi"), blk, pvc("rb-nri", nriClass, "64Mi"))
	// The overlay's upper layer on a scratch image (upperSize), whose
	// device a reboot detaches too.
	baseTok, base := e.rebootBaseImage(t)
	e.apply(t, staticVolume("rb-chain", "64Mi", obj{"type": "loop", "image": base, "overlay": "true", "upperSize": fmt.Sprint(32 << 20)}, "ReadWriteOnce"),
		boundClaim("rb-chain", "64Mi", "ReadWriteOnce"))
	sqTok, rcTok := e.fuseSetup(t)
	e.apply(t, statefulSet(rebootSTS, 3, "32Mi"))
	e.run(t,
		pod("rb-ext4", withClaim("rb-ext4", "/data", false)),
		pod("rb-xfs", withClaim("rb-xfs", "/data", false)),
		pod("rb-blk", withBlockClaim("rb-blk", "/dev/xvda")),
		pod("rb-chain", withClaim("rb-chain", "/data", false)),
		pod("sqfuse", withClaim("sqfuse", "/data", true)),
		pod("rclone", withClaim("rclone", "/data", false)),
		pod("rb-nri", withClaim("rb-nri", "/data", false)),
		pod("rb-eph", withInline("32Mi", "/scratch")),
	)
	must(t)(e.c.kubectl("-n", testNS, "rollout", "status", "statefulset/"+rebootSTS, "--timeout=180s"))
	e.expect(t, "rb-chain", "/data/base", baseTok)
	e.expect(t, "rclone", "/data/file", rcTok)
	e.wantFSInPod(t, "rb-nri", "/data", "ext4", "/dev/loop")
	must(t)(e.c.podExec("rb-blk", "sh", "-c",
		"dd if=/dev/urandom of=/tmp/x bs=4096 count=64 2>/dev/null && dd if=/tmp/x of=/dev/xvda bs=4096 count=64 conv=fsync 2>/dev/null"))
	block = strings.TrimSpace(must(t)(e.c.podExec("rb-blk", "sh", "-c", "md5sum < /tmp/x")))
	if got := e.blockSum(t, "rb-blk"); got != block {
		t.Fatalf("device reads %s, wrote %s", got, block)
	}
	files = []rebootFile{
		{pod: "rb-ext4", file: "/data/token", writable: true},
		{pod: "rb-xfs", file: "/data/token", writable: true},
		{pod: "rclone", file: "/data/token", writable: true},
		{pod: "rb-nri", file: "/data/token", writable: true},
		{pod: "rb-eph", file: "/scratch/token", writable: true},
	}
	for i := 0; i < 3; i++ {
		files = append(files, rebootFile{pod: fmt.Sprintf("%s-%d", rebootSTS, i), file: "/data/token", writable: true})
	}
	return files, block, sqTok, baseTok
}

// rebootBaseImage makes a squashfs image under the admin's root holding a
// token, for the overlay chain.
func (e *env) rebootBaseImage(t *testing.T) (tok, img string) {
	t.Helper()
	dir := t.TempDir()
	tok = token()
	if err := os.WriteFile(filepath.Join(dir, "base"), []byte(tok+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img = e.c.cfg.path("srv", "images", "rb-base.sqfs")
	hostRun(t, "mksquashfs", dir, img, "-quiet", "-noappend")
	return tok, img
}

// statefulSet is a StatefulSet of busybox pods, each with a claim of the
// chart's StorageClass at /data (claims data-<name>-<i>).
func statefulSet(name string, replicas int, size string) obj {
	p := pod(name, func(_, ctr obj) { addMount(ctr, obj{"name": "data", "mountPath": "/data"}) })
	return obj{"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": obj{"name": name, "namespace": testNS},
		"spec": obj{"serviceName": name, "replicas": replicas, "podManagementPolicy": "Parallel",
			"selector": obj{"matchLabels": obj{"app": name}},
			"template": obj{"metadata": obj{"labels": obj{"app": name}}, "spec": p["spec"]},
			"volumeClaimTemplates": []obj{{"metadata": obj{"name": "data"}, "spec": obj{
				"accessModes": []string{"ReadWriteOnce"}, "storageClassName": storageClass,
				"resources": obj{"requests": obj{"storage": size}}}}}}}
}

// blockSum is the checksum of the first 256 KiB of a pod's /dev/xvda.
func (e *env) blockSum(t *testing.T, pod string) string {
	t.Helper()
	return strings.TrimSpace(must(t)(e.c.podExec(pod, "sh", "-c", "dd if=/dev/xvda bs=4096 count=64 2>/dev/null | md5sum")))
}

// podUIDs maps the test namespace's pods to their UIDs.
func (e *env) podUIDs(t *testing.T) map[string]string {
	t.Helper()
	out := must(t)(e.c.kubectl("-n", testNS, "get", "pods", "-o", `jsonpath={range .items[*]}{.metadata.name}={.metadata.uid}{"\n"}{end}`))
	m := map[string]string{}
	for _, l := range strings.Fields(out) {
		if name, uid, ok := strings.Cut(l, "="); ok {
			m[name] = uid
		}
	}
	return m
}

// waitRecovered waits until, after the node's boot, mountplan's pods and
// every pod of the test namespace are Ready with every container started
// since the boot (the API shows the pods' state before the reboot until
// kubelet reports again), and logs when each step came, from the node's
// start.
func (e *env) waitRecovered(t *testing.T) {
	t.Helper()
	boot := e.c.started
	t.Logf("reboot: control plane, containerd and kubelet up %v after the node's start", time.Since(boot).Round(time.Millisecond))
	var mountplanAt time.Duration
	waitFor(t, 5*time.Minute, "every pod running again after the reboot", func() error {
		// The pods of the node that rebooted: the other nodes' ran on.
		out, err := e.c.kubectl("get", "pods", "-A", "--field-selector", "spec.nodeName="+nodeName, "-o", `jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name} {.status.conditions[?(@.type=="Ready")].status} {range .status.containerStatuses[*]}{.name}={.state.running.startedAt},{end}{"\n"}{end}`)
		if err != nil {
			return err
		}
		var waiting []string
		mountplanUp := true
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			name, ok := podRestarted(l, boot)
			if ok {
				continue
			}
			waiting = append(waiting, name)
			if strings.HasPrefix(name, "kube-system/mountplan-") {
				mountplanUp = false
			}
		}
		if mountplanUp && mountplanAt == 0 {
			mountplanAt = time.Since(boot)
			t.Logf("reboot: mountplan's pods Ready %v after the node's start", mountplanAt.Round(time.Millisecond))
		}
		if len(waiting) > 0 {
			return fmt.Errorf("not yet running since the boot: %v", waiting)
		}
		return nil
	})
	t.Logf("reboot: recovery time (node start to every pod Running and Ready, volumes mounted): %v", time.Since(boot).Round(time.Millisecond))
}

// podRestarted reads a line "<ns>/<name> <Ready> <ctr>=<startedAt>,..."
// and says whether the pod is Ready with every container started at or
// after boot (to the second, as the API reports).
func podRestarted(line string, boot time.Time) (name string, ok bool) {
	f := strings.Fields(line)
	if len(f) < 2 {
		return line, false
	}
	name = f[0]
	if f[1] != "True" || len(f) < 3 {
		return name, false
	}
	for _, c := range strings.Split(strings.TrimSuffix(f[2], ","), ",") {
		_, at, _ := strings.Cut(c, "=")
		started, err := time.Parse(time.RFC3339, at)
		if err != nil || started.Before(boot.Truncate(time.Second)) {
			return name, false
		}
	}
	return name, true
}

// rebootTeardown deletes the flow's pods, checks each filesystem once its
// volume is unstaged, deletes the claims and volumes, and checks that
// nothing of them is left: no record, no loop device, no FUSE connection.
func (e *env) rebootTeardown(t *testing.T, fuseBefore []string) {
	t.Helper()
	claims := []string{"rb-ext4", "rb-xfs", "rb-blk", "rb-nri", "rb-chain", "sqfuse", "rclone"}
	var fsck []rebootFS
	fsck = append(fsck, rebootFS{"rb-ext4", "ext4"}, rebootFS{"rb-xfs", "xfs"}, rebootFS{"rb-nri", "ext4"})
	for i := 0; i < 3; i++ {
		c := fmt.Sprintf("data-%s-%d", rebootSTS, i)
		claims = append(claims, c)
		fsck = append(fsck, rebootFS{c, "ext4"})
	}
	ids := map[string]string{} // claim → volume ID
	for _, c := range claims {
		ids[c] = e.volumeHandle(t, e.pvOf(t, c))
	}
	e.c.deleteAndWait(t, "statefulset", rebootSTS)
	e.c.deleteAndWait(t, "pod", "rb-ext4", "rb-xfs", "rb-blk", "rb-chain", "sqfuse", "rclone", "rb-nri", "rb-eph",
		rebootSTS+"-0", rebootSTS+"-1", rebootSTS+"-2")
	for _, f := range fsck {
		e.fsckVolume(t, ids[f.claim], f.fsType)
	}
	t.Logf("reboot: not checked with a tool: the raw block device (its bytes are), the overlay's scratch upper and the inline volume (their images go with the pods), squashfs and rclone (read-only image, remote directory)")
	waitFor(t, 30*time.Second, "the inline volume's record removed", func() error {
		if n := e.ephemeralRecords(t); n != 0 {
			return fmt.Errorf("%d inline volumes' records", n)
		}
		return nil
	})
	e.c.deleteAndWait(t, "pvc", "rb-ext4", "rb-xfs", "rb-blk", "rb-nri", "rb-chain",
		"data-"+rebootSTS+"-0", "data-"+rebootSTS+"-1", "data-"+rebootSTS+"-2")
	must(t)(e.c.kubectl("delete", "pv", "rb-chain", "--wait=true", "--timeout=60s"))
	e.fuseTeardown(t, "sqfuse", "rclone")
	waitFor(t, 2*time.Minute, "the flow's volumes deleted, with their records", func() error {
		for c, id := range ids {
			if _, err := os.Stat(e.c.cfg.path("state", "volumes", id+".json")); err == nil {
				return fmt.Errorf("the record of %s (claim %s) is still there", id, c)
			}
		}
		return e.mounterRecordsOf(ids)
	})
	waitFor(t, 30*time.Second, "no loop device that no volume uses", func() error { return e.strayLoops(t) })
	waitFor(t, 30*time.Second, "no FUSE connection of the flow's left", func() error {
		if extra := slicesDiff(fuseConnections(), fuseBefore); len(extra) > 0 {
			return fmt.Errorf("FUSE connections left: %v", extra)
		}
		return nil
	})
	must(t)(e.c.kubectl("delete", "storageclass", nriClass, "--ignore-not-found"))
}

// volumeHandle is a PV's CSI volume ID.
func (e *env) volumeHandle(t *testing.T, pv string) string {
	t.Helper()
	return strings.TrimSpace(must(t)(e.c.kubectl("get", "pv", pv, "-o", "jsonpath={.spec.csi.volumeHandle}")))
}

// record reads a volume's journal record.
func (e *env) record(id string) (model.Volume, error) {
	var v model.Volume
	b, err := os.ReadFile(e.c.cfg.path("state", "volumes", id+".json"))
	if err == nil {
		err = json.Unmarshal(b, &v)
	}
	return v, err
}

// fsckVolume waits until kubelet unstaged a provisioned volume, then checks
// its image read-only with the filesystem's tool.
func (e *env) fsckVolume(t *testing.T, id, fsType string) {
	t.Helper()
	waitFor(t, 2*time.Minute, "volume "+id+" unstaged", func() error {
		v, err := e.record(id)
		if err != nil {
			return err
		}
		if v.Stage != nil {
			return fmt.Errorf("stage %+v", *v.Stage)
		}
		return nil
	})
	img := e.c.cfg.path("state", "images", string(model.KindProvisioned), id+".img")
	var cmd *exec.Cmd
	switch fsType {
	case "ext4":
		cmd = exec.Command("e2fsck", "-f", "-n", img)
	case "xfs":
		cmd = exec.Command("xfs_repair", "-n", img)
	default:
		t.Fatalf("no check for %s", fsType)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("%s of volume %s after the reboot: %v\n%s", cmd.Args[0], id, err, lastLines(string(out), 20))
		return
	}
	t.Logf("reboot: %s -n of volume %s: clean", cmd.Args[0], id)
}

// mounterRecordsOf: an error while a record of the mounter names one of
// the volumes.
func (e *env) mounterRecordsOf(ids map[string]string) error {
	var found []string
	_ = filepath.WalkDir(e.c.cfg.path("state")+"-mounter", func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return nil
		}
		b, _ := os.ReadFile(p)
		for _, id := range ids {
			if strings.Contains(string(b), id) || strings.Contains(p, id) {
				found = append(found, p)
			}
		}
		return nil
	})
	if len(found) > 0 {
		return fmt.Errorf("the mounter's records of deleted volumes: %v", found)
	}
	return nil
}

// strayLoops: an error for a loop device backed by a file of the cluster
// that is no image of a volume still recorded.
func (e *env) strayLoops(t *testing.T) error {
	t.Helper()
	used := map[string]bool{}
	for _, f := range e.records(t) {
		id := strings.TrimSuffix(filepath.Base(f), ".json")
		v, err := e.record(id)
		if err != nil {
			continue // removed since the listing
		}
		used[v.Image] = true
		for _, kind := range []string{string(model.KindProvisioned), string(model.KindEphemeral), "scratch"} {
			used[e.c.cfg.path("state", "images", kind, id+".img")] = true
		}
	}
	var stray []string
	for dev, p := range e.c.firstNodeLoops() {
		if !used[p] {
			stray = append(stray, dev+" "+p)
		}
	}
	if len(stray) > 0 {
		slices.Sort(stray)
		return errors.New("loop devices of no volume: " + strings.Join(stray, ", "))
	}
	return nil
}

// fuseConnections lists the kernel's FUSE connections.
func fuseConnections() []string {
	entries, _ := os.ReadDir("/sys/fs/fuse/connections")
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// slicesDiff is what a has that b has not.
func slicesDiff(a, b []string) []string {
	var d []string
	for _, x := range a {
		if !slices.Contains(b, x) {
			d = append(d, x)
		}
	}
	return d
}

// nodeRebootMidWork: the node loses power while work is in flight: an xfs
// claim in use growing online (its resize just asked for), a snapshot of
// it being taken, and a pod starting on a claim just bound (its stage and
// publish about to run or running). After the boot the work completes: the
// snapshot is ready and a claim restored from it holds the data with a
// clean filesystem, the claim reaches its new size with the filesystem
// grown and its data kept, and the pod runs with a working volume; once
// the claims and the snapshot are deleted nothing of them is left.
func nodeRebootMidWork(t *testing.T, e *env) {
	e.apply(t, xfsStorageClass(), pvc("mw-xfs", "mountplan-xfs", "300Mi"))
	e.run(t, pod("mw-xfs", withClaim("mw-xfs", "/data", false)))
	tok := e.write(t, "mw-xfs", "/data/token")
	before := e.fsSize(t, "mw-xfs", "/data")

	e.apply(t, pvc("mw-start", storageClass, "64Mi"))
	e.resize(t, "mw-xfs", "600Mi")
	e.apply(t, pod("mw-start", withClaim("mw-start", "/data", false)))
	waitFor(t, time.Minute, "mw-start's claim bound", func() error {
		out, err := e.c.kubectl("-n", testNS, "get", "pvc", "mw-start", "-o", "jsonpath={.status.phase}")
		if err != nil || out != "Bound" {
			return fmt.Errorf("phase %q %v", out, err)
		}
		return nil
	})
	// A snapshot of the claim in use, asked for just before the power
	// goes: the copy is under way, done, or not begun at the loss.
	e.apply(t, obj{"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
		"metadata": obj{"name": "mw-snap", "namespace": testNS},
		"spec":     obj{"volumeSnapshotClassName": snapshotClass, "source": obj{"persistentVolumeClaimName": "mw-xfs"}}})
	resizing := must(t)(e.c.kubectl("-n", testNS, "get", "pvc", "mw-xfs", "-o", "jsonpath={.status.capacity.storage} {.status.allocatedResourceStatuses}"))
	snap, _ := e.c.kubectl("-n", testNS, "get", "volumesnapshot", "mw-snap", "-o", "jsonpath={.status.readyToUse}")
	t.Logf("reboot mid-work: mw-xfs at the power loss: %s; its snapshot ready: %q", resizing, snap)
	e.c.reboot(t)
	e.waitRecovered(t)

	// The snapshot completes after the boot, and a claim restored from it
	// holds the token and a clean filesystem.
	e.waitSnapshotReady(t, "mw-snap")
	restored := pvc("mw-restored", "mountplan-xfs", "600Mi")
	restored["spec"].(obj)["dataSource"] = obj{"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "mw-snap"}
	e.apply(t, restored)
	e.run(t, pod("mw-restored", withClaim("mw-restored", "/data", false)))
	e.expect(t, "mw-restored", "/data/token", tok)
	restoredID := e.volumeHandle(t, e.pvOf(t, "mw-restored"))
	e.c.deleteAndWait(t, "pod", "mw-restored")
	e.fsckVolume(t, restoredID, "xfs")
	e.c.deleteAndWait(t, "pvc", "mw-restored")
	e.c.deleteAndWait(t, "volumesnapshot", "mw-snap")
	waitFor(t, time.Minute, "the snapshot's copy removed", func() error {
		if c := e.snapshotCopies(t); len(c) != 0 {
			return fmt.Errorf("snapshots on the node: %v", c)
		}
		return nil
	})

	e.waitCapacity(t, "mw-xfs", "600Mi")
	waitFor(t, time.Minute, "mw-xfs's filesystem grown", func() error {
		if after := e.fsSize(t, "mw-xfs", "/data"); after < before+250*1024 {
			return fmt.Errorf("filesystem %d KiB, was %d", after, before)
		}
		return nil
	})
	e.expect(t, "mw-xfs", "/data/token", tok)
	e.write(t, "mw-xfs", "/data/token")
	e.write(t, "mw-start", "/data/token")

	ids := map[string]string{}
	for _, c := range []string{"mw-xfs", "mw-start"} {
		ids[c] = e.volumeHandle(t, e.pvOf(t, c))
	}
	e.c.deleteAndWait(t, "pod", "mw-xfs", "mw-start")
	e.fsckVolume(t, ids["mw-xfs"], "xfs")
	e.fsckVolume(t, ids["mw-start"], "ext4")
	e.c.deleteAndWait(t, "pvc", "mw-xfs", "mw-start")
	waitFor(t, 2*time.Minute, "the claims' records removed", func() error {
		for c, id := range ids {
			if _, err := os.Stat(e.c.cfg.path("state", "volumes", id+".json")); err == nil {
				return fmt.Errorf("the record of %s (claim %s) is still there", id, c)
			}
		}
		return e.mounterRecordsOf(ids)
	})
	waitFor(t, 30*time.Second, "no loop device that no volume uses", func() error { return e.strayLoops(t) })
}

// nodeRebootAgedInline: an inline volume whose pod had run for longer than
// the plugin's publish grace (10 minutes) when the node lost power. The
// record's publish is aged while the node is down (the test cannot wait
// 10 minutes); after the boot the pod must find its data again.
func nodeRebootAgedInline(t *testing.T, e *env) {
	e.run(t, pod("ag-eph", withInline("32Mi", "/scratch")))
	tok := e.write(t, "ag-eph", "/scratch/token")
	e.c.rebootWith(t, func() { e.agePublishes(t, model.KindEphemeral, 11*time.Minute) })
	e.waitRecovered(t)
	e.expect(t, "ag-eph", "/scratch/token", tok)
	e.c.deleteAndWait(t, "pod", "ag-eph")
}

// agePublishes moves the time each publish of the records of a kind was
// asked back by d (the node is down: nothing else writes the journal).
func (e *env) agePublishes(t *testing.T, kind model.Kind, d time.Duration) {
	t.Helper()
	for _, f := range e.records(t) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var rec map[string]any
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.UseNumber() // inodes and sizes kept exact
		if err := dec.Decode(&rec); err != nil {
			t.Fatal(err)
		}
		pubs, _ := rec["publishes"].([]any)
		if rec["kind"] != string(kind) || len(pubs) == 0 {
			continue
		}
		for _, p := range pubs {
			p.(map[string]any)["asked"] = time.Now().Add(-d).UTC().Format(time.RFC3339Nano)
		}
		if b, err = json.Marshal(rec); err == nil {
			err = os.WriteFile(f, b, 0o600)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("publishes of %s aged by %v", filepath.Base(f), d)
	}
}
