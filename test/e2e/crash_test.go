package e2e

// The crash test: kill -9 of the plugin, of its mounter (`mountplan-sidecar
// serve`) or of a one-shot sidecar at a random point inside every kind of
// operation, in both modes (the plugin performs plans itself, or through the
// mounter). After each kill the victim restarts and the operation is retried
// as kubelet, the provisioner or a runtime would; then the test checks that
// the data is intact (checksums), the filesystem was never made again, the
// loop devices and mounts are exactly those the volume's state calls for, no
// temp file is left, and every call completed.
//
//	go test ./test/e2e -run '^TestCrash$' -crash.kills=300   (make test-crash N=300)

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	mathrand "math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountplan/mountplan/test/testutil"
)

var (
	crashKills = flag.Int("crash.kills", 88, "kills TestCrash makes, rounded up to whole rounds (one kill in each operation of a round)")
	crashSeed  = flag.Uint64("crash.seed", 0, "seed of TestCrash's random choices (0: from the clock; the test logs the one it used)")
)

// crashRetryBudget bounds how long an operation may take to succeed after
// a kill: beyond it the call counts as stuck.
const crashRetryBudget = 60 * time.Second

func TestCrash(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "mkfs.ext4", "mkfs.xfs", "xfs_growfs", "blkid", "unshare", "nsenter")
	seed := *crashSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	rounds := (*crashKills + len(crashOps) - 1) / len(crashOps)
	t.Logf("%d rounds of %d kills, seed %d (-crash.seed=%d repeats the choices)", rounds, len(crashOps), seed, seed)
	modes := []struct {
		name    string
		mounter bool
		fsType  string
	}{{"in-process", false, "ext4"}, {"mounter", true, "xfs"}}
	for i, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			testutil.NoLeaks(t)
			c := newCrasher(t, m.mounter, m.fsType, seed+uint64(i))
			for r := i; r < rounds; r += len(modes) {
				c.round(r)
			}
			c.finish()
		})
	}
}

// crashOp is one kind of operation, run on the crasher's volumes.
type crashOp struct {
	name string
	run  func(c *crasher, ctx context.Context) error
	// oneShot: the operation is a `mountplan-sidecar mount/unmount`
	// process, which may be the victim too.
	oneShot bool
	// after updates the crasher's idea of the volumes' state once the
	// operation has succeeded.
	after func(c *crasher)
}

// crashOps is one round: a throwaway volume is created, staged, unstaged
// and deleted (its filesystem is made at create, or in every other round,
// where it is asked for as a raw block device and so created blank, at its
// first stage); the long-lived one goes through its
// whole life once. A kill lands in each.
var crashOps = []crashOp{
	{name: "create", run: (*crasher).create, after: func(c *crasher) { c.scratchExists = true }},
	{name: "stage with format", run: (*crasher).stageScratch, after: func(c *crasher) { c.scratchStaged = true }},
	{name: "stage", run: (*crasher).stage, after: func(c *crasher) { c.staged = true }},
	{name: "publish", run: (*crasher).publish, after: func(c *crasher) { c.published = true }},
	{name: "prepare", run: (*crasher).prepare, oneShot: true, after: func(c *crasher) { c.prepared = true }},
	{name: "expand", run: (*crasher).expand, after: func(c *crasher) { c.capacity = c.expandTo }},
	{name: "unprepare", run: (*crasher).unprepare, oneShot: true, after: func(c *crasher) { c.prepared = false }},
	{name: "unpublish", run: (*crasher).unpublish, after: func(c *crasher) { c.published = false }},
	{name: "unstage", run: (*crasher).unstage, after: func(c *crasher) { c.staged = false }},
	{name: "unstage a new volume", run: (*crasher).unstageScratch, after: func(c *crasher) { c.scratchStaged = false }},
	{name: "delete", run: (*crasher).deleteScratch, after: func(c *crasher) { c.scratchExists = false }},
}

type crasher struct {
	t       *testing.T
	e       *env
	rng     *mathrand.Rand
	mounter bool
	fsType  string

	// The long-lived volume, its publish target, its consumer (a process
	// in a mount namespace of its own) and the mount point there.
	id, image, target string
	consumer          *testutil.Proc
	consumerTarget    string
	staged, published bool
	prepared          bool
	capacity          int64
	expandTo          int64
	files             map[string][sha256.Size]byte // written through the publish, fsynced
	uuid              string                       // the filesystem's, from its first format on
	canGrowExt4       bool                         // the plugin holds CAP_SYS_RESOURCE

	// The throwaway volume of the round.
	scratch                      string
	scratchExists, scratchStaged bool
	scratchBlank                 bool // created blank: its first stage formats it

	oneShotMu sync.Mutex
	oneShot   *os.Process // the one-shot sidecar running now

	took  map[string]time.Duration // how long each kind of operation takes, for the kill delay
	stats crashStats
}

type crashStats struct {
	kills        map[string]int // "op by victim"
	interrupted  int            // the call in flight failed
	finished     int            // the call in flight completed before the kill
	stalls       int            // the mounter was stopped across the plugin's restart
	retries, max int
}

func newCrasher(t *testing.T, mounter bool, fsType string, seed uint64) *crasher {
	t.Helper()
	e := startEnv(t, envOptions{mounter: mounter})
	c := &crasher{t: t, e: e, rng: mathrand.New(mathrand.NewPCG(seed, seed>>1)), mounter: mounter, fsType: fsType,
		files: map[string][sha256.Size]byte{}, took: map[string]time.Duration{}, stats: crashStats{kills: map[string]int{}}}
	c.id = "crash-" + fsType
	size := 32 * miB
	if fsType == "xfs" {
		size = 300 * miB // mkfs.xfs's minimum; the image stays sparse
	}
	c.capacity = e.create(c.id, fsType, size).GetCapacityBytes()
	c.image = e.image(c.id)
	c.target = e.target(c.id, "mnt")
	// The consumer's namespace is a copy of the host's tree made now,
	// before anything of the volume is mounted on the host.
	c.consumer = testutil.StartUnshare(t)
	c.consumerTarget = filepath.Join(e.dir, "consumer")
	if err := os.Mkdir(c.consumerTarget, 0o755); err != nil {
		t.Fatal(err)
	}
	c.canGrowExt4 = plugCapEff(t, e.plugin.PID(), unix.CAP_SYS_RESOURCE)
	c.verify("at the start")
	return c
}

// round runs every kind of operation once, each with a kill inside.
func (c *crasher) round(r int) {
	c.scratch = fmt.Sprintf("crash-scratch-%d", r)
	c.scratchBlank = r%2 == 1
	for _, op := range crashOps {
		c.crashDuring(op)
		if c.t.Failed() {
			c.t.FailNow()
		}
	}
}

// crashDuring starts op, kills a victim after a random delay (up to 1.2
// times what op usually takes, so that most kills land inside it), restarts the victim, retries op until it succeeds and checks
// everything.
func (c *crasher) crashDuring(op crashOp) {
	t := c.t
	t.Helper()
	victims := []string{"plugin"}
	if c.mounter {
		victims = append(victims, "mounter")
	}
	if op.oneShot {
		victims = append(victims, "one-shot sidecar")
	}
	victim := victims[c.rng.IntN(len(victims))]
	// Issue 11 item 5: the mounter still at work on a publish while the
	// plugin dies and restarts, finishing behind the new plugin's back.
	stall := c.mounter && victim == "plugin" && (op.name == "publish" || op.name == "unpublish") && c.rng.IntN(2) == 0
	took, ok := c.took[op.name]
	if !ok {
		took = 5 * time.Millisecond
	}
	delay := time.Duration(c.rng.Float64() * 1.2 * float64(took))
	stallFor := time.Duration(c.rng.IntN(200)) * time.Millisecond
	if op.name == "expand" {
		c.expandTo = c.capacity + 16*miB
	}

	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
		defer cancel()
		done <- op.run(c, ctx)
	}()
	time.Sleep(delay)
	c.kill(victim, stall, stallFor)
	var inFlight error
	select {
	case inFlight = <-done:
	case <-time.After(2 * rpcTimeout):
		t.Fatalf("%s: the call in flight when the %s was killed never returned", op.name, victim)
	}
	if inFlight == nil {
		c.stats.finished++
	} else {
		c.stats.interrupted++
	}
	c.stats.kills[op.name+" by "+victim]++
	if stall {
		c.stats.stalls++
	}
	when := fmt.Sprintf("%s with the %s killed after %v (the call in flight: %v)", op.name, victim, delay.Round(time.Millisecond), inFlight)
	c.settle(op, when)
	op.after(c)
	c.verify("after " + when)
	if op.name == "publish" {
		c.write()
	}
}

// kill kills victim with SIGKILL and starts it again. With stall, the
// mounter is stopped (SIGSTOP) before the plugin dies and let go only
// after the new plugin has started, which then reconciles while the
// mounter finishes what it was doing.
func (c *crasher) kill(victim string, stall bool, stallFor time.Duration) {
	t := c.t
	t.Helper()
	switch victim {
	case "plugin":
		if !stall {
			c.e.plugin.Kill9()
			c.e.restart()
			return
		}
		mpid := c.e.mounter.pid()
		if err := syscall.Kill(mpid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		c.e.plugin.Kill9()
		c.e.plugin.Restart()
		time.Sleep(stallFor)
		if err := syscall.Kill(mpid, syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		c.e.connect()
		c.e.waitReady()
	case "mounter":
		c.e.mounter.kill9()
		c.e.startMounter("")
	case "one-shot sidecar":
		c.oneShotMu.Lock()
		if c.oneShot != nil {
			_ = c.oneShot.Kill()
		}
		c.oneShotMu.Unlock()
	}
}

// settle retries op until it succeeds. Only errors a crash explains
// (the plugin or the mounter unreachable, the volume busy, a killed
// one-shot) are retried; anything else, or no success within
// crashRetryBudget, fails the test.
func (c *crasher) settle(op crashOp, when string) {
	t := c.t
	t.Helper()
	start := time.Now()
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
		t0 := time.Now()
		err := op.run(c, ctx)
		cancel()
		if err == nil || c.accepted(op, err) {
			took := time.Since(t0)
			if prev, ok := c.took[op.name]; ok {
				took = (prev*3 + took) / 4
			}
			c.took[op.name] = took
			c.stats.retries += attempt
			c.stats.max = max(c.stats.max, attempt)
			return
		}
		if !crashTransient(err) {
			t.Fatalf("%s: retry %d answers %v, which no crash explains", when, attempt+1, err)
		}
		if time.Since(start) > crashRetryBudget {
			t.Fatalf("stuck: %s: no success within %v of retries (%d); last: %v", when, crashRetryBudget, attempt+1, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// accepted: an error that is the right answer here. Online ext4 growth
// needs CAP_SYS_RESOURCE, which a container running the test may lack.
func (c *crasher) accepted(op crashOp, err error) bool {
	return op.name == "expand" && c.fsType == "ext4" && !c.canGrowExt4 &&
		status.Code(err) == codes.FailedPrecondition && strings.Contains(err.Error(), "CAP_SYS_RESOURCE")
}

// oneShotTransient matches the gRPC codes a one-shot sidecar prints when
// the plugin was unreachable or busy.
var oneShotTransient = regexp.MustCompile(`code = (Unavailable|Aborted|Canceled)|signal: killed`)

func crashTransient(err error) bool {
	var oe *oneShotError
	if errors.As(err, &oe) {
		return oneShotTransient.MatchString(oe.Error())
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.Aborted, codes.Canceled:
		return true
	}
	return false
}

// --- the operations ---

func (c *crasher) create(ctx context.Context) error {
	capability := mountCap("ext4", rwo)
	if c.scratchBlank {
		capability = blockCap(rwo)
	}
	_, err := c.e.ctl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: c.scratch,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 * miB}, Parameters: map[string]string{"type": "loop", "fsType": "ext4"},
		VolumeCapabilities: []*csi.VolumeCapability{capability}})
	return err
}

func (c *crasher) stageScratch(ctx context.Context) error {
	_, err := c.e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: c.scratch,
		StagingTargetPath: c.e.staging(c.scratch), VolumeCapability: mountCap("ext4", rwo)})
	return err
}

func (c *crasher) unstageScratch(ctx context.Context) error {
	_, err := c.e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: c.scratch, StagingTargetPath: c.e.staging(c.scratch)})
	return err
}

func (c *crasher) deleteScratch(ctx context.Context) error {
	_, err := c.e.ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: c.scratch})
	return err
}

func (c *crasher) cap() *csi.VolumeCapability { return mountCap(c.fsType, rwo) }

func (c *crasher) stage(ctx context.Context) error {
	_, err := c.e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: c.id,
		StagingTargetPath: c.e.staging(c.id), VolumeCapability: c.cap()})
	return err
}

func (c *crasher) unstage(ctx context.Context) error {
	_, err := c.e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: c.id, StagingTargetPath: c.e.staging(c.id)})
	return err
}

func (c *crasher) publish(ctx context.Context) error {
	_, err := c.e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: c.id,
		StagingTargetPath: c.e.staging(c.id), TargetPath: c.target, VolumeCapability: c.cap()})
	return err
}

func (c *crasher) unpublish(ctx context.Context) error {
	_, err := c.e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: c.id, TargetPath: c.target})
	return err
}

// expand grows the image (ControllerExpandVolume) and then the published
// filesystem (NodeExpandVolume), as the external-resizer and kubelet do.
func (c *crasher) expand(ctx context.Context) error {
	capRange := &csi.CapacityRange{RequiredBytes: c.expandTo}
	if _, err := c.e.ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: c.id,
		CapacityRange: capRange, VolumeCapability: c.cap()}); err != nil {
		return err
	}
	_, err := c.e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: c.id, VolumePath: c.target,
		StagingTargetPath: c.e.staging(c.id), CapacityRange: capRange, VolumeCapability: c.cap()})
	return err
}

func (c *crasher) prepare(ctx context.Context) error {
	return c.runOneShot(ctx, "mount", "--plugin-endpoint", c.e.plugin.Endpoint, "--volume-id", c.id,
		"--staging-path", c.e.staging(c.id), "--pid", fmt.Sprint(c.consumer.PID), "--target", c.consumerTarget,
		"--state-dir", c.e.stateDir())
}

func (c *crasher) unprepare(ctx context.Context) error {
	return c.runOneShot(ctx, "unmount", "--plugin-endpoint", c.e.plugin.Endpoint, "--volume-id", c.id,
		"--pid", fmt.Sprint(c.consumer.PID), "--target", c.consumerTarget)
}

// oneShotError is a one-shot sidecar that failed, with what it printed.
type oneShotError struct{ msg string }

func (e *oneShotError) Error() string { return e.msg }

// runOneShot runs `mountplan-sidecar args...` as a runtime hook would; the
// process is the victim when the test kills the one-shot sidecar.
func (c *crasher) runOneShot(ctx context.Context, args ...string) error {
	cmd := exec.CommandContext(ctx, c.e.sidecar, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.WaitDelay = 5 * time.Second
	c.oneShotMu.Lock()
	err := cmd.Start()
	if err == nil {
		c.oneShot = cmd.Process
	}
	c.oneShotMu.Unlock()
	if err != nil {
		return err
	}
	err = cmd.Wait()
	c.oneShotMu.Lock()
	c.oneShot = nil
	c.oneShotMu.Unlock()
	if err != nil {
		return &oneShotError{fmt.Sprintf("mountplan-sidecar %s: %v: %s", args[0], err, strings.TrimSpace(out.String()))}
	}
	return nil
}

// write adds a file of random data through the publish and fsyncs it: from
// then on every check reads it back.
func (c *crasher) write() {
	t := c.t
	t.Helper()
	data := make([]byte, 16<<10)
	_, _ = rand.Read(data)
	name := fmt.Sprintf("f%03d", len(c.files))
	f, err := os.OpenFile(filepath.Join(c.target, name), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	c.files[name] = sha256.Sum256(data)
}

// --- the checks ---

// verify checks the volumes against what their state calls for, from
// outside the product: the journal's files, sysfs, the mount tables of the
// host and of the consumer, the image's superblock, the data.
func (c *crasher) verify(when string) {
	t := c.t
	t.Helper()
	v, err := c.e.record(c.id)
	if err != nil {
		t.Fatalf("%s: record of %s: %v", when, c.id, err)
	}
	if v.Staged() != c.staged || len(v.Publishes) != b2i(c.published) || len(v.Consumers) != b2i(c.prepared) {
		t.Fatalf("%s: record says staged %v, %d publishes, %d consumers; want %v, %d, %d",
			when, v.Staged(), len(v.Publishes), len(v.Consumers), c.staged, b2i(c.published), b2i(c.prepared))
	}
	// Exactly one loop device while staged, none otherwise (an autoclear
	// device goes a moment after its last close).
	var loops []plugLoop
	if !testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool {
		loops = plugLoopsBackedBy(t, c.image)
		return len(loops) == b2i(c.staged)
	}) {
		t.Fatalf("%s: loop devices backed by %s: %+v, want %d", when, c.image, loops, b2i(c.staged))
	}
	var hostMounts, nsMounts []string
	if c.staged {
		if st := c.e.loopState(c.id); st.Device != loops[0].Path() {
			t.Fatalf("%s: the record names %s, the image is on %s", when, st.Device, loops[0].Path())
		}
		hostMounts = plugMountsOf(t, os.Getpid(), loops[0].Dev)
		nsMounts, err = prepMountsOfDev(c.consumer.PID, prepDevOf(t, loops[0].Path()))
		if err != nil {
			t.Fatal(err)
		}
	}
	if want := c.wantHostMounts(); !equalStrings(hostMounts, want) {
		t.Fatalf("%s: the host mounts the volume at %v, want %v", when, hostMounts, want)
	}
	if n := countMountsAt(t, os.Getpid(), c.target); n != b2i(c.published) {
		t.Fatalf("%s: %d mounts at the target %s, want %d", when, n, c.target, b2i(c.published))
	}
	if _, err := os.Lstat(c.target); !c.published && !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("%s: the target %s is there while unpublished: %v", when, c.target, err)
	}
	if len(nsMounts) != b2i(c.prepared) || countMountsAt(t, c.consumer.PID, c.consumerTarget) != b2i(c.prepared) {
		t.Fatalf("%s: the consumer's namespace shows the volume %v (and %d mounts at %s), want %d",
			when, nsMounts, countMountsAt(t, c.consumer.PID, c.consumerTarget), c.consumerTarget, b2i(c.prepared))
	}
	c.verifyScratch(when)
	if temps := tempFilesUnder(t, c.e.stateDir()); len(temps) > 0 {
		t.Fatalf("%s: temp files of interrupted writes left: %v", when, temps)
	}
	c.verifyData(when, v.Format != nil && v.Format.Done)
	if v.CapacityBytes < c.capacity {
		t.Fatalf("%s: the record's capacity %d is below the %d it grew to", when, v.CapacityBytes, c.capacity)
	}
}

func (c *crasher) wantHostMounts() []string {
	if c.published {
		return []string{c.target}
	}
	return nil
}

// verifyScratch checks the throwaway volume: a record and a full-size
// image while it exists, neither after its delete, one loop device while
// staged and a filesystem on it from then on, none otherwise.
func (c *crasher) verifyScratch(when string) {
	t := c.t
	t.Helper()
	if c.scratch == "" {
		return
	}
	img := c.e.image(c.scratch)
	fi, imgErr := os.Stat(img)
	v, recErr := c.e.record(c.scratch)
	switch {
	case c.scratchExists && (imgErr != nil || recErr != nil || fi.Size() < 16*miB):
		t.Fatalf("%s: volume %s: image %v (%v), record %v", when, c.scratch, fi, imgErr, recErr)
	case !c.scratchExists && (!errors.Is(imgErr, fs.ErrNotExist) || !errors.Is(recErr, fs.ErrNotExist)):
		t.Fatalf("%s: deleted volume %s: image %v, record %v", when, c.scratch, imgErr, recErr)
	}
	if c.scratchExists && (v.Staged() != c.scratchStaged || c.scratchStaged && (v.Format == nil || !v.Format.Done)) {
		t.Fatalf("%s: record of %s: stage %+v, format %+v; want staged %v and formatted", when, c.scratch, v.Stage, v.Format, c.scratchStaged)
	}
	var ls []plugLoop
	if !testutil.Poll(5*time.Second, 10*time.Millisecond, func() bool {
		ls = plugLoopsBackedBy(t, img)
		return len(ls) == b2i(c.scratchStaged)
	}) {
		t.Fatalf("%s: volume %s is on %+v, want %d loop devices", when, c.scratch, ls, b2i(c.scratchStaged))
	}
	if c.scratchStaged {
		if out, err := exec.Command("blkid", "-p", "-s", "TYPE", "-o", "value", img).Output(); err != nil || strings.TrimSpace(string(out)) != "ext4" {
			t.Fatalf("%s: volume %s staged but its image holds %q (%v), want ext4", when, c.scratch, out, err)
		}
	}
}

// verifyData reads back every file written so far, through the publish and
// inside the consumer, and checks that the filesystem is the one first made.
func (c *crasher) verifyData(when string, formatted bool) {
	t := c.t
	t.Helper()
	if formatted {
		out, err := exec.Command("blkid", "-p", "-s", "UUID", "-o", "value", c.image).Output()
		uuid := strings.TrimSpace(string(out))
		switch {
		case err != nil || uuid == "":
			t.Fatalf("%s: blkid %s: %q, %v", when, c.image, uuid, err)
		case c.uuid == "":
			c.uuid = uuid
		case uuid != c.uuid:
			t.Fatalf("%s: the filesystem was made again: UUID %s, was %s", when, uuid, c.uuid)
		}
	}
	for name, sum := range c.files {
		if c.published {
			b, err := os.ReadFile(filepath.Join(c.target, name))
			if err != nil || sha256.Sum256(b) != sum {
				t.Fatalf("%s: %s through the publish: %d bytes, %v; its checksum differs or it is gone", when, name, len(b), err)
			}
		}
		if c.prepared {
			out, err := c.consumer.Exec(t, "cat", filepath.Join(c.consumerTarget, name))
			if err != nil || sha256.Sum256([]byte(out)) != sum {
				t.Fatalf("%s: %s inside the consumer: %d bytes, %v; its checksum differs or it is gone", when, name, len(out), err)
			}
		}
	}
}

// finish releases the long-lived volume (without kills) and logs what the
// kills hit.
func (c *crasher) finish() {
	t := c.t
	t.Helper()
	if c.staged {
		t.Fatal("a round ended with the volume staged")
	}
	c.e.delete(c.id)
	var kinds []string
	total := 0
	for k, n := range c.stats.kills {
		kinds = append(kinds, fmt.Sprintf("%s %d", k, n))
		total += n
	}
	sort.Strings(kinds)
	var tooks []string
	for op, d := range c.took {
		tooks = append(tooks, fmt.Sprintf("%s %v", op, d.Round(100*time.Microsecond)))
	}
	sort.Strings(tooks)
	t.Logf("operations take (moving average of the calls after a kill): %s", strings.Join(tooks, ", "))
	t.Logf("%d kills: %d interrupted the call in flight, %d came after it completed; %d with the mounter stopped across the plugin's restart; %d retries (at most %d for one operation); %d files checked after each; by operation and victim: %s",
		total, c.stats.interrupted, c.stats.finished, c.stats.stalls, c.stats.retries, c.stats.max, len(c.files), strings.Join(kinds, ", "))
}

// --- small things ---

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// countMountsAt counts the mounts stacked at mountPoint in pid's table.
func countMountsAt(t *testing.T, pid int, mountPoint string) int {
	t.Helper()
	infos, err := testutil.MountInfoOf(pid)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mi := range infos {
		if mi.Mountpoint == mountPoint {
			n++
		}
	}
	return n
}

// tempFileName is what fsutil.CreateAtomic names its temp files.
var tempFileName = regexp.MustCompile(`^\..+\.tmp-[0-9]+$`)

// tempFilesUnder lists the temp files of atomic writes under dir.
func tempFilesUnder(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) {
			return nil // removed meanwhile
		}
		if err != nil {
			return err
		}
		if tempFileName.MatchString(d.Name()) {
			out = append(out, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
