//go:build clustertest

package cluster

// The flows of NRI mode (issue 10) through kubelet: a StorageClass with
// nri: "true", its volumes in pods' containers only. A poller reads the
// node's mount table (the namespace of kubelet and containerd) from the
// first of these flows to the last and fails the last if anything but the
// guard was ever mounted under kubelet's directory.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/mountplan/mountplan/internal/nri/guard"
	"github.com/mountplan/mountplan/pkg/plan"
)

const nriClass = "mountplan-nri"

// nriPoll runs from NRIPVC to NRIWritesSurviveMounterRollout; nriPVs are
// the volumes of these flows.
var (
	nriPoll *nodePoller
	nriPVs  []string
)

// nriPVC: a claim of the NRI StorageClass in a pod: ext4 of the loop
// device inside the container, the guard at kubelet's target.
func nriPVC(t *testing.T, e *env) {
	nriPoll = startNodePoller(e)
	e.apply(t, e.nriStorageClass())
	e.apply(t, pvc("ndata", nriClass, "64Mi"))
	e.run(t, pod("n1", withClaim("ndata", "/data", false)))
	e.nriPV(t, "ndata")
	e.wantFSInPod(t, "n1", "/data", "ext4", "/dev/loop")
	e.shared["ndata"] = e.write(t, "n1", "/data/token")
	sleep(100 * time.Millisecond) // a few samples
	if nriPoll.seen(guard.FSType) == 0 {
		t.Error("no guard in the node's mount table at kubelet's target")
	}
}

// nriStorageClass is the StorageClass of NRI mode.
func (e *env) nriStorageClass() obj {
	return obj{"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": obj{"name": nriClass},
		"provisioner": e.driverName, "parameters": obj{"nri": "true"}, "volumeBindingMode": "WaitForFirstConsumer", "reclaimPolicy": "Delete"}
}

// nriPodRecreated: the pod deleted, a new one finds the data; the first
// container's claim is released.
func nriPodRecreated(t *testing.T, e *env) {
	e.c.deleteAndWait(t, "pod", "n1")
	e.run(t, pod("n2", withClaim("ndata", "/data", false)))
	e.expect(t, "n2", "/data/token", e.shared["ndata"])
	e.shared["ndata"] = e.write(t, "n2", "/data/token")
	e.wantContainerConsumers(t, "ndata", 1)
}

// nriTwoPodsRWO: two pods of the node on one ReadWriteOnce claim, each
// container a consumer; a ReadWriteOncePod claim's second pod is refused
// until the first is gone.
func nriTwoPodsRWO(t *testing.T, e *env) {
	e.run(t, pod("n3", withClaim("ndata", "/data", false)))
	e.expect(t, "n3", "/data/token", e.shared["ndata"])
	tok := e.write(t, "n3", "/data/token")
	e.expect(t, "n2", "/data/token", tok)
	e.shared["ndata"] = tok
	e.wantContainerConsumers(t, "ndata", 2)
	e.c.deleteAndWait(t, "pod", "n3")
	e.wantContainerConsumers(t, "ndata", 1)

	e.apply(t, pvc("nonce", nriClass, "32Mi", "ReadWriteOncePod"))
	e.run(t, pod("no1", withClaim("nonce", "/data", false)))
	e.nriPV(t, "nonce")
	tok = e.write(t, "no1", "/data/token")
	e.apply(t, pod("no2", withClaim("nonce", "/data", false)))
	waitFor(t, 60*time.Second, "no2 refused for ReadWriteOncePod", func() error {
		out, err := e.c.kubectl("-n", testNS, "get", "pod", "no2", "-o",
			`jsonpath={.status.phase} {.status.conditions[?(@.type=="PodScheduled")].reason}: {.status.conditions[?(@.type=="PodScheduled")].message}`)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(out, "Pending Unschedulable") || !strings.Contains(out, "ReadWriteOncePod") {
			return fmt.Errorf("no2: %s", out)
		}
		return nil
	})
	e.c.deleteAndWait(t, "pod", "no1")
	e.c.waitPod(t, "no2")
	e.expect(t, "no2", "/data/token", tok)
	e.c.deleteAndWait(t, "pod", "no2")
	e.c.deleteAndWait(t, "pvc", "nonce")
}

// nriSubPath: subPath volume mounts of an NRI claim. kubelet stats the
// subPath below the target (the guard says every name there is a
// directory) and binds it under the pod's volume-subpaths; the hook finds
// the target and the subPath through the guard, and the mounter mounts
// the volume's own directory at the container's start. An existing
// directory, written by another pod of the claim, and a missing one (made,
// as kubelet makes it) in one container; each shows that directory only,
// and writes through it reach the claim.
func nriSubPath(t *testing.T, e *env) {
	tok := token()
	must(t)(e.c.podExec("n2", "sh", "-c", "mkdir -p /data/dir && echo "+tok+" > /data/dir/token"))
	e.c.deleteAtEnd(t, "pod", "nsub") // a failure must not keep the claim from the flows after this one
	e.run(t, pod("nsub", func(spec, ctr obj) {
		addVolume(spec, obj{"name": "v", "persistentVolumeClaim": obj{"claimName": "ndata"}})
		addMount(ctr, obj{"name": "v", "mountPath": "/sub", "subPath": "dir"})
		addMount(ctr, obj{"name": "v", "mountPath": "/new", "subPath": "made/here"})
	}))
	e.wantFSInPod(t, "nsub", "/sub", "ext4", "/dev/loop")
	e.expect(t, "nsub", "/sub/token", tok)
	if got := strings.TrimSpace(must(t)(e.c.podExec("nsub", "ls", "-A", "/sub"))); got != "token" {
		t.Errorf("/sub of the subPath pod holds %q, want only token (the subPath, not the volume's root)", got)
	}
	back := e.write(t, "nsub", "/sub/back")
	e.expect(t, "n2", "/data/dir/back", back)
	made := e.write(t, "nsub", "/new/file")
	e.expect(t, "n2", "/data/made/here/file", made)
	// n2's container and each of nsub's two mounts (a consumer per mount
	// point of a container).
	e.wantContainerConsumers(t, "ndata", 3)
	e.c.deleteAndWait(t, "pod", "nsub")
	e.wantContainerConsumers(t, "ndata", 1)
}

// nriFSGroup: kubelet hands the pod's fsGroup to the driver
// (VOLUME_MOUNT_GROUP); a non-root pod writes to its loop volume, and the
// files of its squashfuse volume (NRI too) are the group's: the daemon was
// started with the profile's mountGroupArgs.
func nriFSGroup(t *testing.T, e *env) {
	dir := t.TempDir()
	tok := token()
	if err := os.WriteFile(filepath.Join(dir, "file"), []byte(tok+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	img := e.c.cfg.path("srv", "fuse", "fsgroup.sqfs")
	hostRun(t, "mksquashfs", dir, img, "-quiet", "-noappend", "-all-root")
	e.apply(t, pvc("nfsg", nriClass, "32Mi"),
		staticVolume("nfsg-fuse", "16Mi", obj{"type": "fuse", "profile": "squashfuse", "source": img, "nri": "true"}, "ReadWriteOnce"),
		boundClaim("nfsg-fuse", "16Mi", "ReadWriteOnce"))
	e.c.deleteAtEnd(t, "pv", "nfsg-fuse")
	e.c.deleteAtEnd(t, "pvc", "nfsg", "nfsg-fuse")
	e.c.deleteAtEnd(t, "pod", "nfsg") // (cleanups run last first: the pod, then the claims)
	e.run(t, pod("nfsg", withClaim("nfsg", "/data", false), withClaim("nfsg-fuse", "/fuse", true), func(spec, _ obj) {
		spec["securityContext"] = obj{"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000, "runAsNonRoot": true}
	}))
	e.nriPV(t, "nfsg")
	e.write(t, "nfsg", "/data/token")
	if out := strings.TrimSpace(must(t)(e.c.podExec("nfsg", "stat", "-c", "%g", "/data", "/data/token"))); out != "2000\n2000" {
		t.Errorf("groups of /data and the new file: %q, want 2000 for both", out)
	}
	// The image's file is root's, mode 0600: the pod (uid 1000) reads it
	// only as the group's, through the daemon's gid and umask (libfuse's
	// umask sets every mode: 0777 less 0002).
	if out := strings.TrimSpace(must(t)(e.c.podExec("nfsg", "stat", "-c", "%g %a", "/fuse", "/fuse/file"))); out != "2000 775\n2000 775" {
		t.Errorf("group and mode of the FUSE volume's root and file: %q, want 2000 775 for both", out)
	}
	e.expect(t, "nfsg", "/fuse/file", tok)
	e.c.deleteAndWait(t, "pod", "nfsg")
	e.c.deleteAndWait(t, "pvc", "nfsg", "nfsg-fuse")
}

// nriRollout: a pod writes every 100 ms through a rolling update of the
// DaemonSet (the mounter, its hook and the guard replaced); afterwards a
// new pod gets the volume again. Then everything of these flows goes, and
// the poller's record is checked.
func nriRollout(t *testing.T, e *env) {
	e.run(t, writer("nw", "ndata"))
	last := 0
	sleep(time.Second)
	e.checkWrites(t, "nw", &last)
	e.rollout++
	e.install(t)
	sleep(2 * time.Second)
	e.checkWrites(t, "nw", &last)
	e.run(t, pod("n4", withClaim("ndata", "/data", false)))
	e.wantFSInPod(t, "n4", "/data", "ext4", "/dev/loop")
	e.expect(t, "n4", "/data/token", e.shared["ndata"])
	e.wantContainerConsumers(t, "ndata", 3)

	e.c.deleteAndWait(t, "pod", "nw", "n2", "n4")
	e.wantContainerConsumers(t, "ndata", 0)
	e.c.deleteAndWait(t, "pvc", "ndata")
	bad, samples, seen := nriPoll.stop(nriPVs)
	t.Logf("node mount table polled %d times through the NRI flows; under kubelet's directory: %s", samples, strings.Join(seen, "; "))
	for _, b := range bad {
		t.Errorf("a volume appeared in the node's mount namespace under kubelet's directory: %s", b)
	}
}

// nriPV records the volume of a claim of these flows for the poller.
func (e *env) nriPV(t *testing.T, claim string) {
	t.Helper()
	nriPVs = append(nriPVs, e.pvOf(t, claim))
}

// pvOf is the volume of a claim (of the test namespace unless qualified:
// "namespace/claim").
func (e *env) pvOf(t *testing.T, claim string) string {
	t.Helper()
	ns, name := qualified(claim)
	return strings.TrimSpace(must(t)(e.c.kubectl("-n", ns, "get", "pvc", name, "-o", "jsonpath={.spec.volumeName}")))
}

// wantFSInPod checks the filesystem type and source of the top mount at
// dir inside a pod's container.
func (e *env) wantFSInPod(t *testing.T, pod, dir, fsType, sourcePrefix string) {
	t.Helper()
	got, src := mountAt(must(t)(e.c.podExec(pod, "cat", "/proc/self/mountinfo")), dir)
	if got != fsType || !strings.HasPrefix(src, sourcePrefix) {
		t.Errorf("%s in pod %s is %s from %s, want %s from %s*", dir, pod, got, src, fsType, sourcePrefix)
	}
}

// mountAt returns the filesystem type and source of the top mount at dir
// in a mountinfo table.
func mountAt(mountinfo, dir string) (fsType, source string) {
	for _, l := range strings.Split(mountinfo, "\n") {
		f := strings.Fields(l)
		if i := slices.Index(f, "-"); len(f) > 4 && f[4] == dir && i > 0 && i+2 < len(f) {
			fsType, source = f[i+1], f[i+2]
		}
	}
	return fsType, source
}

// wantContainerConsumers checks how many containers the plugin's journal
// records as consumers of a claim's volume, each with its namespace.
func (e *env) wantContainerConsumers(t *testing.T, claim string, n int) {
	t.Helper()
	vol := e.pvOf(t, claim)
	waitFor(t, 30*time.Second, fmt.Sprintf("%d container consumers of %s", n, claim), func() error {
		ids, err := e.containerConsumers(vol)
		if err != nil {
			return err
		}
		if len(ids) != n {
			return fmt.Errorf("%d container consumers", len(ids))
		}
		return nil
	})
}

// containerConsumers reads the container IDs a volume's journal record
// names as consumers; a consumer that is not a started container (no ID or
// no namespace) is an error.
func (e *env) containerConsumers(vol string) ([]string, error) {
	return e.containerConsumersOn(e.c, vol)
}

// containerConsumersOn is containerConsumers of node n's journal.
func (e *env) containerConsumersOn(n *Cluster, vol string) ([]string, error) {
	b, err := os.ReadFile(n.seen(e.c.cfg.path("state", "volumes", vol+".json")))
	if err != nil {
		return nil, err
	}
	var rec struct {
		Consumers []struct {
			ContainerID string `json:"containerID"`
			NSInode     uint64 `json:"nsInode"`
		} `json:"consumers"`
	}
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, err
	}
	var ids []string
	for _, c := range rec.Consumers {
		if c.ContainerID == "" || c.NSInode == 0 {
			return nil, fmt.Errorf("consumer %+v is not a started container", c)
		}
		ids = append(ids, c.ContainerID)
	}
	return ids, nil
}

// nodePoller reads the node's mount table every 5 ms.
type nodePoller struct {
	pid     int
	root    string
	done    chan struct{}
	stopped chan struct{}
	mu      sync.Mutex
	samples int
	counts  map[mountKey]int // every mount seen under kubelet's CSI volume dirs
	types   map[string]int
}

func startNodePoller(e *env) *nodePoller {
	p := &nodePoller{pid: e.c.nodePID(), root: e.c.cfg.path("kubelet"), done: make(chan struct{}), stopped: make(chan struct{}),
		counts: map[mountKey]int{}, types: map[string]int{}}
	go func() {
		defer close(p.stopped)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-p.done:
				return
			case <-tick.C:
				p.sample()
			}
		}
	}()
	return p
}

func (p *nodePoller) sample() {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", p.pid))
	if err != nil {
		return
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, func(i *mountinfo.Info) (bool, bool) {
		return !plan.Within(p.root, i.Mountpoint) || !strings.Contains(i.Mountpoint, "/volumes/kubernetes.io~csi/"), false
	})
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		return
	}
	p.samples++
	for _, i := range infos {
		k := mountKey{i.FSType, i.Source, i.Mountpoint}
		p.counts[k]++
		p.types[i.FSType]++
	}
}

type mountKey struct{ fsType, source, mountPoint string }

func (p *nodePoller) seen(fsType string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.types[fsType]
}

// stop stops polling and judges what was seen at the targets of the
// volumes pvs (other flows' classic volumes share kubelet's directory):
// anything there but the guard is bad.
func (p *nodePoller) stop(pvs []string) (bad []string, samples int, seen []string) {
	close(p.done)
	<-p.stopped
	p.mu.Lock()
	defer p.mu.Unlock()
	for k, n := range p.counts {
		if !slices.ContainsFunc(pvs, func(pv string) bool { return strings.Contains(k.mountPoint, "/kubernetes.io~csi/"+pv+"/") }) {
			continue
		}
		desc := fmt.Sprintf("%s %s at %s", k.fsType, k.source, k.mountPoint)
		seen = append(seen, fmt.Sprintf("%s (%d samples)", desc, n))
		if k.fsType != guard.FSType {
			bad = append(bad, desc)
		}
	}
	slices.Sort(seen)
	return bad, p.samples, seen
}
