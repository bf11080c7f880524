//go:build vmguest

package guest

import (
	"bufio"
	"bytes"
	"context"
	encjson "encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/driver"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/iscsi"
	"github.com/mountplan/mountplan/internal/source/iscsi/iscsitest"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/internal/source/nbd"
	"github.com/mountplan/mountplan/internal/source/nbd/nbdtest"
	"github.com/mountplan/mountplan/internal/volview"
)

// The reboot test runs in two boots of the VM (test/vm): TestRebootBefore
// stages and publishes NBD and iSCSI volumes, writes to them and asks the
// host for a hard reset (qemu's system_reset: no sync, no orderly stop);
// TestRebootAfter runs in the next boot, over the same disks, and plays
// kubelet after a reboot. /init mounts two disks the host made:
//
//   - the node's disk at /persist: the plugin's state dir (with kubelet's
//     directories and the mounter's records under it) and /etc/iscsi
//     (bound over it, as a node's root disk keeps it). It is mounted with
//     commit=600 and the kernel's periodic writeback is off, so that the
//     reset finds on it exactly what was synced: what the plugin fsync'ed
//     itself, and what the "settled" volumes wrote before the node was
//     synced once, as hours of uptime would have written it back;
//   - the servers' disk at /srv: the NBD exports, the iSCSI LUNs, and the
//     facts the second boot checks. The servers stand for machines of
//     their own, which the node's reboot does not touch: their disk is
//     synced before the reset, and they are started again, on the same
//     ports with the same exports and CHAP account, before the plugin.
//
// Two volumes of each kind: "settled" ones staged and written before the
// node's disk was synced (a reboot long after the pods started: every
// record on disk), and "fresh" ones staged after (a reboot right after:
// the records only as durable as the plugin made them). The fresh iSCSI
// volume is a second LUN of the settled one's target, so it shares its
// session.
const (
	rebootNodeDir   = "/persist"
	rebootServerDir = "/srv"
	rebootNBDPort   = 10809
	rebootISCSIPort = 3260
	// resetMarker tells the host that the first boot is ready for the reset.
	resetMarker = "MOUNTPLAN-GUEST-RESET-NOW"
)

// rebootVolume is one volume of the reboot test, as the first boot
// leaves it for the second.
type rebootVolume struct {
	ID      string            `json:"id"`
	Kind    string            `json:"kind"` // nbd or iscsi
	Settled bool              `json:"settled"`
	VCtx    map[string]string `json:"vctx"`
	Data    string            `json:"data"`
	// State is the source's state the first boot recorded.
	State encjson.RawMessage `json:"state"`
	// Backing is the export or LUN file on the servers' disk.
	Backing string `json:"backing"`
}

// rebootFacts is what the first boot knew: its boot ID and the volumes.
type rebootFacts struct {
	Boot    string         `json:"boot"`
	Volumes []rebootVolume `json:"volumes"`
}

func factsPath() string { return filepath.Join(rebootServerDir, "reboot-facts.json") }

func rebootStateDir() string { return filepath.Join(rebootNodeDir, "state") }

// requireRebootPhase fails unless /init started this boot's phase with
// both disks mounted.
func requireRebootPhase(t *testing.T, phase string) {
	t.Helper()
	requireGuest(t)
	if got := os.Getenv("MOUNTPLAN_VM_REBOOT"); got != phase {
		t.Fatalf("MOUNTPLAN_VM_REBOOT=%q: runs only as the %q phase that test/vm's /init starts", got, phase)
	}
	for _, d := range []string{rebootNodeDir, rebootServerDir} {
		if !mountedAt(d) {
			t.Fatalf("%s is not mounted: /init mounts the disks the host attached", d)
		}
	}
}

func bootID(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// mountPoints lists the mount points of this process's namespace.
func mountPoints() []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) > 4 {
			out = append(out, strings.ReplaceAll(f[4], `\040`, " "))
		}
	}
	return out
}

func mountedAt(p string) bool { return slices.Contains(mountPoints(), p) }

// mountsUnder lists the mount points below dir.
func mountsUnder(dir string) []string {
	var out []string
	for _, m := range mountPoints() {
		if strings.HasPrefix(m, dir+"/") {
			out = append(out, m)
		}
	}
	return out
}

func syncfsOf(t *testing.T, dir string) {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		t.Fatalf("syncfs %s: %v", dir, err)
	}
}

// rebootServers starts, over the servers' disk, iscsid, nbdkit on its
// port and tgtd with its CHAP target on its port. The first boot makes
// the exports and LUN files; the second serves the same files.
func rebootServers(t *testing.T, first bool) (nbdAddr string, tg *iscsitest.Target) {
	t.Helper()
	nbdDir := filepath.Join(rebootServerDir, "nbd")
	tgtDir := filepath.Join(rebootServerDir, "tgt")
	for _, d := range []string{nbdDir, tgtDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if first {
		for _, e := range []string{"settled", "fresh"} {
			nbdtest.AddExport(t, nbdDir, e, 32<<20)
		}
	}
	startIscsid(t)
	srv := nbdtest.StartNbdkit(t, nbdDir, nbdtest.Options{Port: rebootNBDPort})
	tg = iscsitest.StartTgtd(t, tgtDir, iscsitest.Options{LUNSizes: []int64{32 << 20, 32 << 20},
		CHAPUser: chapUser, CHAPPassword: chapPassword, Port: rebootISCSIPort})
	return srv.Address, tg
}

func rebootConfig() *config.Config {
	return &config.Config{
		NBD:   config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}, TimeoutSeconds: 10},
		ISCSI: config.ISCSIConfig{AllowedPortals: []string{"127.0.0.1:*"}, DeviceTimeoutSeconds: 30},
	}
}

// startRebootPlugin starts the mounter and the plugin over the node's
// state dir and runs the plugin's start-up reconcile, returning its error
// as the plugin would log it (a failed reconcile does not stop a plugin:
// kubelet's calls come next).
func startRebootPlugin(t *testing.T) (*driver.Driver, error) {
	t.Helper()
	cfg := rebootConfig()
	cfg.DefaultFsType = "ext4"
	stateDir := rebootStateDir()
	if err := os.MkdirAll(stateDir, 0o755); err != nil {
		t.Fatal(err)
	}
	m := mounterFor(t, cfg, stateDir)
	d, err := driver.New(driver.Options{DriverName: "mountplan.csi.io", NodeID: "guest", StateDir: stateDir, KubeletDir: stateDir, Config: cfg,
		Node: m, DefaultType: loop.Type, Sources: map[string]source.Source{
			loop.Type:  loop.New(stateDir, m),
			nbd.Type:   nbd.New(cfg.NBD, m, nil),
			iscsi.Type: iscsi.New(cfg.ISCSI, m, nil),
		}})
	if err != nil {
		t.Fatal(err)
	}
	return d, d.Reconcile(context.Background())
}

func (v rebootVolume) flow(t *testing.T, d *driver.Driver) *flow {
	f := &flow{t: t, d: d, stateDir: rebootStateDir(), id: v.ID, vctx: v.VCtx}
	if v.Kind == iscsi.Type {
		f.secrets = map[string]string{iscsi.SecretUsername: chapUser, iscsi.SecretPassword: chapPassword}
	}
	return f
}

func (v rebootVolume) file() string { return "before-reboot.txt" }

// TestRebootBefore is the first boot: volumes staged, published and
// written, then the reset (see the comment above).
func TestRebootBefore(t *testing.T) {
	requireRebootPhase(t, "before")
	begin := time.Now()
	nbdAddr, tg := rebootServers(t, true)
	iscsiadmShim(t)
	d, err := startRebootPlugin(t)
	if err != nil {
		t.Fatalf("reconcile over an empty state dir: %v", err)
	}
	facts := rebootFacts{Boot: bootID(t)}
	vols := []rebootVolume{
		{ID: "nbd-settled", Kind: nbd.Type, Settled: true, VCtx: map[string]string{"type": "nbd", "address": nbdAddr, "export": "settled"},
			Backing: filepath.Join(rebootServerDir, "nbd", "settled")},
		{ID: "iscsi-settled", Kind: iscsi.Type, Settled: true, VCtx: map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN, "lun": "1"},
			Backing: tg.LUNs[1]},
		{ID: "nbd-fresh", Kind: nbd.Type, VCtx: map[string]string{"type": "nbd", "address": nbdAddr, "export": "fresh"},
			Backing: filepath.Join(rebootServerDir, "nbd", "fresh")},
		{ID: "iscsi-fresh", Kind: iscsi.Type, VCtx: map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN, "lun": "2"},
			Backing: tg.LUNs[2]},
	}
	for i, v := range vols {
		if i == 2 {
			// The node runs on: its kernel writes back and commits what the
			// settled volumes' stage left, as it would within 30 s.
			syncfsOf(t, rebootNodeDir)
			t.Logf("node's disk synced: the settled volumes' records are on it")
		}
		f := v.flow(t, d)
		start := time.Now()
		if err := f.stage(); err != nil {
			t.Fatalf("NodeStageVolume %s: %v", v.ID, err)
		}
		f.publish()
		v.Data = fmt.Sprintf("%s, written and fsync'ed in boot %s at %s\n", v.ID, facts.Boot, time.Now().UTC().Format(time.RFC3339Nano))
		writeSynced(t, filepath.Join(f.target(), v.file()), []byte(v.Data))
		v.State = encjson.RawMessage(f.state())
		t.Logf("%s staged, published and written in %v: state %s", v.ID, time.Since(start), v.State)
		vols[i] = v
	}
	for _, v := range vols {
		if h := health(t, d, v.ID); h != nil {
			t.Fatalf("health of %s before the reboot: %v", v.ID, h)
		}
	}
	if n, s := len(connectedNBD()), sessions(); n != 2 || len(s) != 1 {
		t.Fatalf("before the reboot: %d NBD devices and sessions %v, want 2 and one session", n, s)
	}
	facts.Volumes = vols
	b, err := encjson.MarshalIndent(facts, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(factsPath(), b, 0o644); err != nil {
		t.Fatal(err)
	}
	// The servers' machines do not lose power: what they hold is on disk.
	syncfsOf(t, rebootServerDir)
	if strings.Contains(logs.String(), chapPassword) {
		t.Fatal("a log line shows the CHAP password")
	}
	t.Logf("published: %v", mountsUnder(rebootStateDir()))
	timing("4 volumes up, before the reset", time.Since(begin))
	// The host resets the machine on this line; nothing after it runs,
	// and no cleanup: every process, device and session dies with the boot.
	fmt.Printf("\n%s boot=%s\n", resetMarker, facts.Boot)
	time.Sleep(time.Hour)
	t.Fatal("the host did not reset the machine")
}

// timing reports a duration to the host's summary.
func timing(name string, d time.Duration) {
	fmt.Printf("MOUNTPLAN-GUEST-TIMING %s %.2fs\n", name, d.Seconds())
}

// TestRebootAfter is the second boot: the servers come back, the plugin
// and the mounter start over the same state dir, and kubelet, as after a
// reboot, stages and publishes every volume again at the same paths. The
// plugin reconnects the NBD devices and logs in to iSCSI again with CHAP;
// every volume shows the data written before, its stats and health are
// normal, nothing in the operator's view disagrees with the kernel, and
// the teardown leaves no device, session, node record, mount or record.
func TestRebootAfter(t *testing.T) {
	requireRebootPhase(t, "after")
	b, err := os.ReadFile(factsPath())
	if err != nil {
		t.Fatalf("the first boot's facts: %v", err)
	}
	var facts rebootFacts
	if err := encjson.Unmarshal(b, &facts); err != nil || len(facts.Volumes) != 4 {
		t.Fatalf("the first boot's facts: %v (%d volumes)", err, len(facts.Volumes))
	}
	if boot := bootID(t); boot == facts.Boot {
		t.Fatalf("boot ID %s is the first boot's: no reboot happened", boot)
	}
	if n, s, m := len(connectedNBD()), sessions(), mountsUnder(rebootStateDir()); n != 0 || len(s) != 0 || len(m) != 0 {
		t.Fatalf("after the reset: %d NBD devices, sessions %v, mounts %v; want none", n, s, m)
	}
	describeLeftovers(t, facts)

	_, tg := rebootServers(t, false)
	argvLog := iscsiadmShim(t)
	w := watchSecret(chapPassword)
	start := time.Now()
	d, err := startRebootPlugin(t)
	timing("plugin start-up reconcile", time.Since(start))
	logView(t, d, "after the start-up reconcile")
	if err != nil {
		t.Fatalf("the start-up reconcile after the reboot: %v", err)
	}
	// The plugin saw a boot it did not run in: it trusts nothing its
	// records say of the ended boot (an NBD index or a session ID may be
	// someone else's now) and brings nothing back before kubelet asks
	// (docs/state.md, After a reboot). The settled volumes' records were
	// on disk, so they wait marked; what of the fresh ones' records reached
	// the disk varies, and kubelet's calls settle them below.
	if d.RebootedFrom() != facts.Boot {
		t.Fatalf("the plugin took the reboot from boot %q for one from %q", d.RebootedFrom(), facts.Boot)
	}
	if n, s := len(connectedNBD()), sessions(); n != 0 || len(s) != 0 {
		t.Fatalf("before kubelet asks: %d NBD devices, sessions %v; want none", n, s)
	}
	if n := d.AwaitingRestage(); n < 2 {
		t.Fatalf("%d volumes await a new stage after the start-up reconcile, want the 2 settled ones at least", n)
	}
	t.Logf("after the start-up reconcile: %d volumes await kubelet's stage", d.AwaitingRestage())

	// Kubelet after a reboot: for every pod still on the node, the global
	// mount (NodeStage, with the Secret) and then the pod's (NodePublish),
	// at the same paths; it makes the parent directories first.
	for _, v := range facts.Volumes {
		f := v.flow(t, d)
		if err := os.MkdirAll(filepath.Dir(f.target()), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := f.stage(); err != nil {
			t.Fatalf("NodeStageVolume %s after the reboot: %v", v.ID, err)
		}
		f.publish()
	}
	timing("plugin start to every volume published", time.Since(start))
	if hits, scans := w.finish(); hits != 0 || scans < 2 {
		t.Fatalf("the CHAP password was seen in /proc/*/cmdline or environ %d times (%d scans) during the recovery", hits, scans)
	}

	// The devices are back: two NBD devices connected with the backends
	// their records name, one new iSCSI session logged in with CHAP.
	if n := len(connectedNBD()); n != 2 {
		t.Fatalf("%d NBD devices connected after the recovery, want 2", n)
	}
	ss := sessions()
	if len(ss) != 1 {
		t.Fatalf("sessions after the recovery %v, want one", ss)
	}
	argv, err := os.ReadFile(argvLog)
	if err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(argv, []byte(" --login")); n != 1 {
		t.Fatalf("iscsiadm logins after the reboot: %d, want 1 (both LUNs share the target's session):\n%s", n, argv)
	}
	if bytes.Contains(argv, []byte(chapPassword)) || bytes.Contains(argv, []byte(" -v ")) {
		t.Fatalf("iscsiadm was given the password or a -v value:\n%s", argv)
	}
	t.Logf("iscsiadm calls after the reboot (recorded by a shim):\n%s", argv)
	for _, v := range facts.Volumes {
		checkRecovered(t, d, v, ss[0])
	}
	logView(t, d, "after kubelet's stage and publish")
	checkView(t, d)

	// Teardown, as kubelet does when the pods go.
	for _, v := range facts.Volumes {
		f := v.flow(t, d)
		f.unpublish()
		if err := f.unstage(); err != nil {
			t.Fatalf("NodeUnstageVolume %s: %v", v.ID, err)
		}
	}
	checkNothingLeft(t)
	tg.Stop() // the LUN files are checked with no writer
	for _, v := range facts.Volumes {
		fsck(t, v.Backing)
	}
	if strings.Contains(logs.String(), chapPassword) {
		t.Fatal("a log line shows the CHAP password")
	}
}

// describeLeftovers logs what the reset left on the node's disk: which
// records, kubelet directories and mounter records the plugin finds.
func describeLeftovers(t *testing.T, facts rebootFacts) {
	t.Helper()
	st, err := journal.OpenVolumes(rebootStateDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range facts.Volumes {
		f := v.flow(t, nil)
		rec, err := st.Get(v.ID)
		var what string
		switch {
		case err != nil:
			what = "no record (" + err.Error() + ")"
		case rec.Stage == nil:
			what = "a record without a stage"
		default:
			what = fmt.Sprintf("a record in phase %s with %d publishes", rec.Stage.Phase, len(rec.Publishes))
		}
		_, terr := os.Stat(f.target())
		t.Logf("after the reset, %s (settled %v): %s; target dir there: %v", v.ID, v.Settled, what, terr == nil)
	}
	var recs []string
	_ = filepath.WalkDir(filepath.Join(rebootStateDir(), "mounter"), func(p string, e fs.DirEntry, err error) error {
		if err == nil && !e.IsDir() {
			recs = append(recs, strings.TrimPrefix(p, rebootStateDir()+"/"))
		}
		return nil
	})
	nodes, _ := filepath.Glob("/etc/iscsi/nodes/*/*")
	t.Logf("after the reset: mounter records %v; iSCSI node records %v", recs, nodes)
}

// checkRecovered checks one volume after kubelet's stage and publish: its
// device is connected (NBD: the backend its record names; iSCSI: in the
// new session), its filesystem is mounted at the target with the data
// written before the reboot, read from the device, a new write goes
// through, and its stats and health are normal.
func checkRecovered(t *testing.T, d *driver.Driver, v rebootVolume, session string) {
	t.Helper()
	f := v.flow(t, d)
	var st struct {
		Device  string `json:"device"`
		Index   int    `json:"index"`
		Backend string `json:"backend"`
		SID     int    `json:"sid"`
	}
	state := f.state()
	if err := encjson.Unmarshal(state, &st); err != nil {
		t.Fatal(err)
	}
	switch v.Kind {
	case nbd.Type:
		if got := sysfs(t, st.Index, "backend"); st.Backend == "" || got != st.Backend {
			t.Fatalf("%s: /sys/block/nbd%d/backend %q, record says %q (%s)", v.ID, st.Index, got, st.Backend, state)
		}
	case iscsi.Type:
		if want := strings.TrimPrefix(filepath.Base(session), "session"); fmt.Sprint(st.SID) != want {
			t.Fatalf("%s: state %s, want the new session %s", v.ID, state, want)
		}
	}
	if !mountedAt(f.target()) {
		t.Fatalf("%s: %s is not mounted", v.ID, f.target())
	}
	readFromDevice(t, filepath.Join(f.target(), v.file()), []byte(v.Data))
	after := []byte(v.ID + ", written after the reboot\n")
	writeSynced(t, filepath.Join(f.target(), "after-reboot.txt"), after)
	readFromDevice(t, filepath.Join(f.target(), "after-reboot.txt"), after)
	stats, err := d.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: v.ID, VolumePath: f.target()})
	if err != nil {
		t.Fatalf("%s: NodeGetVolumeStats: %v", v.ID, err)
	}
	if u := stats.GetUsage(); len(u) == 0 || u[0].GetTotal() <= 0 || u[0].GetUsed() <= 0 {
		t.Fatalf("%s: stats %v", v.ID, stats)
	}
	if h := health(t, d, v.ID); h != nil {
		t.Fatalf("%s: health after the recovery: %v", v.ID, h)
	}
	t.Logf("%s: back on %s with its data (state before %s, after %s)", v.ID, st.Device, v.State, state)
}

// logView logs the operator's view (what `mountplan-sidecar volumes`
// prints).
func logView(t *testing.T, d *driver.Driver, when string) {
	t.Helper()
	r := d.Volumes(context.Background())
	volview.HostProc.Check(r)
	var b bytes.Buffer
	if err := volview.WriteTable(&b, r); err != nil {
		t.Fatal(err)
	}
	t.Logf("volumes %s (%d disagreements):\n%s", when, r.Disagreements(), b.String())
}

// checkView: nothing stale, every volume staged and healthy, every
// publish present in the kernel's mount table.
func checkView(t *testing.T, d *driver.Driver) {
	t.Helper()
	r := d.Volumes(context.Background())
	volview.HostProc.Check(r)
	if len(r.Errors) > 0 || r.Disagreements() != 0 || len(r.Volumes) != 4 {
		t.Fatalf("the operator's view: %d volumes, %d disagreements, errors %v", len(r.Volumes), r.Disagreements(), r.Errors)
	}
	for _, v := range r.Volumes {
		if v.Stage != "staged" || v.Health.Status != "ok" || len(v.Consumers) != 1 || v.Consumers[0].Kernel.State != volview.Present {
			t.Fatalf("the operator's view of %s: %+v", v.ID, v)
		}
	}
}

// checkNothingLeft: no NBD device, iSCSI session or node record, no mount
// under the state dir, no volume record and no mounter record of a
// device or session.
func checkNothingLeft(t *testing.T) {
	t.Helper()
	noNBDLeft(t)
	if s := sessions(); len(s) != 0 {
		t.Fatalf("sessions left after unstage: %v", s)
	}
	if recs, _ := filepath.Glob("/etc/iscsi/nodes/*"); len(recs) != 0 {
		t.Fatalf("node records left after unstage: %v", recs)
	}
	if m := mountsUnder(rebootStateDir()); len(m) != 0 {
		t.Fatalf("mounts left under the state dir: %v", m)
	}
	st, err := journal.OpenVolumes(rebootStateDir())
	if err != nil {
		t.Fatal(err)
	}
	if keys, err := st.Keys(); err != nil || len(keys) != 0 {
		t.Fatalf("volume records left: %v, %v", keys, err)
	}
	for _, kind := range []string{"nbd", "iscsi"} {
		dir := filepath.Join(rebootStateDir(), "mounter", kind)
		entries, err := os.ReadDir(dir)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Fatal(err)
		}
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		if slices.ContainsFunc(names, func(n string) bool { return strings.HasSuffix(n, ".json") }) {
			t.Fatalf("mounter records left in %s: %v", dir, names)
		}
	}
}

// fsck checks the filesystem in an export or LUN file, read only.
func fsck(t *testing.T, file string) {
	t.Helper()
	out, err := exec.Command("e2fsck", "-f", "-n", file).CombinedOutput()
	if err != nil {
		t.Fatalf("e2fsck -fn %s: %v\n%s", file, err, out)
	}
	t.Logf("e2fsck -fn %s: clean", filepath.Base(filepath.Dir(file))+"/"+filepath.Base(file))
}
