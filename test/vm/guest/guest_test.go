//go:build vmguest

// Package guest runs inside the VM that test/vm boots (Debian's kernel,
// which has nbd and iscsi_tcp): the whole flow of each network block kind
// through the plugin's own driver, with the servers on the guest's
// loopback, and the online ext4 resize of a loop volume, which needs the
// CAP_SYS_RESOURCE that the guest's init holds. It builds only with the vmguest tag, which test/vm sets; run
// anywhere but in that VM, every test fails (it would touch the host's
// nbd and iSCSI state).
package guest

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/driver"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/iscsi"
	"github.com/mountplan/mountplan/internal/source/iscsi/iscsitest"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/internal/source/nbd"
	"github.com/mountplan/mountplan/internal/source/nbd/nbdtest"
)

// logs collects klog's output, to prove no secret reaches a log line.
var logs safeBuffer

type safeBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *safeBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	os.Stderr.Write(p)
	return s.b.Write(p)
}

func (s *safeBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestMain(m *testing.M) {
	fs := flag.NewFlagSet("klog", flag.ExitOnError)
	klog.InitFlags(fs)
	_ = fs.Set("v", "5")
	_ = fs.Set("logtostderr", "false")
	_ = fs.Set("alsologtostderr", "false")
	klog.SetOutput(&logs)
	os.Exit(m.Run())
}

func requireGuest(t *testing.T) {
	t.Helper()
	if os.Getenv("MOUNTPLAN_VM_GUEST") != "1" {
		t.Fatal("runs only inside the VM that `make test-vm` boots (MOUNTPLAN_VM_GUEST=1)")
	}
}

// mounters are the mounters started by the tests, by state dir: a plugin
// restarted over the same state dir (newDriverAt) keeps its mounter.
var mounters sync.Map

// nodes are the mounters' nodes by state dir: a test that names a
// consumer's namespace to one (Attribute), as the NRI hook would.
var nodes sync.Map

// mounterFor starts a mounter over stateDir as mountplan-sidecar serve
// does (mounter.Local served on a unix socket) and returns the plugin's
// client of it: every privileged act of the tests' drivers and sources
// crosses the socket, NBD's connected sockets by SCM_RIGHTS.
func mounterFor(t *testing.T, cfg *config.Config, stateDir string) *service.Client {
	t.Helper()
	if c, ok := mounters.Load(stateDir); ok {
		return c.(*service.Client)
	}
	ctx, cancel := context.WithCancel(context.Background())
	node, err := mounter.NewNode(ctx, mounter.Options{StateDir: stateDir, KubeletDir: stateDir,
		RecordsDir: filepath.Join(stateDir, "mounter"), Config: cfg, RemoveMountPoint: true, Attributed: true})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "mounter.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- service.Serve(ctx, l, node) }()
	c := service.NewClient(sock)
	mounters.Store(stateDir, c)
	nodes.Store(stateDir, node)
	t.Cleanup(func() {
		mounters.Delete(stateDir)
		nodes.Delete(stateDir)
		c.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("mounter: %v", err)
		}
		node.Close()
	})
	return c
}

// newDriver builds the plugin's driver and its mounter (mounterFor), as
// mountplan-plugin with mountplan-sidecar serve.
func newDriver(t *testing.T, cfg *config.Config, sources func(*service.Client) map[string]source.Source) (*driver.Driver, string) {
	t.Helper()
	return newDriverAt(t, cfg, sources, t.TempDir())
}

// newDriverAt builds the driver over stateDir and reconciles, as a
// (re)started plugin does.
func newDriverAt(t *testing.T, cfg *config.Config, sources func(*service.Client) map[string]source.Source, stateDir string) (*driver.Driver, string) {
	t.Helper()
	cfg.DefaultFsType = "ext4"
	m := mounterFor(t, cfg, stateDir)
	srcs := map[string]source.Source{loop.Type: loop.New(stateDir, m)}
	if sources != nil {
		maps.Copy(srcs, sources(m))
	}
	d, err := driver.New(driver.Options{DriverName: "mountplan.csi.io", NodeID: "guest", StateDir: stateDir, KubeletDir: stateDir, Config: cfg,
		Node: m, Sources: srcs, DefaultType: loop.Type})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	return d, stateDir
}

func mountCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

type flow struct {
	t        *testing.T
	d        *driver.Driver
	stateDir string
	id       string
	vctx     map[string]string
	secrets  map[string]string
}

func (f *flow) stage() error {
	_, err := f.d.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{VolumeId: f.id,
		StagingTargetPath: filepath.Join(f.stateDir, "staging", f.id), VolumeCapability: mountCap(),
		VolumeContext: f.vctx, Secrets: f.secrets})
	return err
}

func (f *flow) unstage() error {
	_, err := f.d.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: f.id,
		StagingTargetPath: filepath.Join(f.stateDir, "staging", f.id)})
	return err
}

func (f *flow) target() string { return filepath.Join(f.stateDir, "pods", f.id, "mount") }

func (f *flow) publish() {
	f.t.Helper()
	if err := os.MkdirAll(filepath.Dir(f.target()), 0o755); err != nil {
		f.t.Fatal(err)
	}
	_, err := f.d.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{VolumeId: f.id,
		StagingTargetPath: filepath.Join(f.stateDir, "staging", f.id), TargetPath: f.target(),
		VolumeCapability: mountCap(), VolumeContext: f.vctx})
	if err != nil {
		f.t.Fatalf("NodePublishVolume: %v", err)
	}
}

func (f *flow) unpublish() {
	f.t.Helper()
	if _, err := f.d.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: f.id, TargetPath: f.target()}); err != nil {
		f.t.Fatalf("NodeUnpublishVolume: %v", err)
	}
}

// writeRemountRead writes through one publish and reads back through a
// second one: the data went to the device, not to a page cache.
func (f *flow) writeRemountRead() {
	f.t.Helper()
	f.publish()
	want := []byte("written through the plan at " + time.Now().String() + "\n")
	if err := os.WriteFile(filepath.Join(f.target(), "hello.txt"), want, 0o644); err != nil {
		f.t.Fatal(err)
	}
	f.unpublish()
	if _, err := os.Stat(f.target()); !os.IsNotExist(err) {
		f.t.Fatalf("target still there after unpublish: %v", err)
	}
	f.publish()
	got, err := os.ReadFile(filepath.Join(f.target(), "hello.txt"))
	if err != nil || !bytes.Equal(got, want) {
		f.t.Fatalf("read back after remount: %q, %v; want %q", got, err, want)
	}
	f.unpublish()
}

func (f *flow) state() json {
	f.t.Helper()
	st, err := journal.OpenVolumes(f.stateDir)
	if err != nil {
		f.t.Fatal(err)
	}
	v, err := st.Get(f.id)
	if err != nil {
		f.t.Fatal(err)
	}
	if v.Stage == nil {
		f.t.Fatal("volume not staged")
	}
	return json(v.Stage.Source)
}

type json []byte

func (j json) has(s string) bool { return bytes.Contains(j, []byte(s)) }

func wantCode(t *testing.T, what string, err error, code codes.Code) {
	t.Helper()
	if got := errdefs.Code(err); got != code {
		t.Fatalf("%s: code %v (%v), want %v", what, got, err, code)
	}
	t.Logf("%s: %v: %v", what, code, err)
}

// connectedNBD lists connected NBD devices.
func connectedNBD() []string {
	pids, _ := filepath.Glob("/sys/block/nbd*/pid")
	return pids
}

func TestNBD(t *testing.T) {
	requireGuest(t)
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "vol", 64<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	cfg := &config.Config{NBD: config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}, TimeoutSeconds: 10}}
	d, stateDir := newDriver(t, cfg, func(m *service.Client) map[string]source.Source {
		return map[string]source.Source{nbd.Type: nbd.New(cfg.NBD, m, nil)}
	})
	f := &flow{t: t, d: d, stateDir: stateDir, id: "nbd-vol", vctx: map[string]string{"type": "nbd", "address": srv.Address, "export": "vol"}}

	start := time.Now()
	if err := f.stage(); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	st := f.state()
	if !st.has(`"fsType":"ext4"`) || !st.has(`"device":"/dev/nbd`) || !st.has(`"backend":"mountplan:nbd-vol:`) || st.has(`"pid"`) {
		t.Fatalf("state %s, want the device and its backend", st)
	}
	t.Logf("stage with format: %v, state %s", time.Since(start), st)
	if len(connectedNBD()) != 1 {
		t.Fatalf("connected devices %v, want 1", connectedNBD())
	}
	f.writeRemountRead()
	if err := f.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	if c := connectedNBD(); len(c) != 0 {
		t.Fatalf("NBD devices still connected after unstage: %v", c)
	}

	// Stage again: the filesystem is found, not made again, and the data is there.
	if err := f.stage(); err != nil {
		t.Fatalf("second NodeStageVolume: %v", err)
	}
	f.publish()
	if _, err := os.Stat(filepath.Join(f.target(), "hello.txt")); err != nil {
		t.Fatalf("data lost across stages: %v", err)
	}
	f.unpublish()

	// The server goes away: health says so, unstage still cleans up.
	srv.Stop()
	resp, err := d.NodeGetVolumeHealth(context.Background(), &csi.NodeGetVolumeHealthRequest{VolumeId: f.id})
	if err != nil || len(resp.GetVolumeHealth().GetHealthStatuses()) == 0 {
		t.Fatalf("health with the server gone: %v %v, want abnormal", resp, err)
	}
	t.Logf("health with the server gone: %v", resp.GetVolumeHealth().GetHealthStatuses()[0])
	if err := f.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume with the server gone: %v", err)
	}
	if c := connectedNBD(); len(c) != 0 {
		t.Fatalf("NBD devices still connected after unstage: %v", c)
	}
}

func TestNBDBadInput(t *testing.T) {
	requireGuest(t)
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "vol", 16<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	cfg := &config.Config{NBD: config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}, TimeoutSeconds: 10}}
	d, stateDir := newDriver(t, cfg, func(m *service.Client) map[string]source.Source {
		return map[string]source.Source{nbd.Type: nbd.New(cfg.NBD, m, nil)}
	})
	for _, tc := range []struct {
		name string
		vctx map[string]string
		code codes.Code
	}{
		{"address not allowed", map[string]string{"type": "nbd", "address": "127.0.0.2:" + fmt.Sprint(srv.Port), "export": "vol"}, codes.InvalidArgument},
		{"missing export", map[string]string{"type": "nbd", "address": srv.Address, "export": "nope"}, codes.NotFound},
		{"nobody listening", map[string]string{"type": "nbd", "address": fmt.Sprintf("127.0.0.1:%d", nbdtest.FreePort(t)), "export": "vol"}, codes.Unavailable},
	} {
		f := &flow{t: t, d: d, stateDir: stateDir, id: "bad", vctx: tc.vctx}
		wantCode(t, tc.name, f.stage(), tc.code)
		if c := connectedNBD(); len(c) != 0 {
			t.Fatalf("%s: devices left connected: %v", tc.name, c)
		}
	}
}

// startIscsid runs iscsid for the test (the guest has no init system).
func startIscsid(t *testing.T) {
	t.Helper()
	cmd := exec.Command("/usr/sbin/iscsid", "-f")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	time.Sleep(200 * time.Millisecond)
}

// sessions lists the kernel's iSCSI sessions.
func sessions() []string {
	s, _ := filepath.Glob("/sys/class/iscsi_session/session*")
	return s
}

// secretWatch scans every process's command line and environment for
// secret until stopped, and counts the hits.
type secretWatch struct {
	stop  chan struct{}
	done  chan struct{}
	hits  atomic.Int64
	scans atomic.Int64
}

func watchSecret(secret string) *secretWatch {
	w := &secretWatch{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for {
			select {
			case <-w.stop:
				return
			default:
			}
			files, _ := filepath.Glob("/proc/[0-9]*/cmdline")
			for _, c := range files {
				for _, p := range []string{c, strings.TrimSuffix(c, "cmdline") + "environ"} {
					if b, err := os.ReadFile(p); err == nil && bytes.Contains(b, []byte(secret)) {
						w.hits.Add(1)
					}
				}
			}
			w.scans.Add(1)
		}
	}()
	return w
}

func (w *secretWatch) finish() (hits, scans int64) {
	close(w.stop)
	<-w.done
	return w.hits.Load(), w.scans.Load()
}

const chapUser, chapPassword = "mountplan", "canary-Pw-7d1e2f"

func TestISCSI(t *testing.T) {
	requireGuest(t)
	startIscsid(t)
	tg := iscsitest.StartTgtd(t, t.TempDir(), iscsitest.Options{LUNSizes: []int64{64 << 20}, CHAPUser: chapUser, CHAPPassword: chapPassword})
	cfg := &config.Config{ISCSI: config.ISCSIConfig{AllowedPortals: []string{"127.0.0.1:*"}, DeviceTimeoutSeconds: 30}}
	argvLog := iscsiadmShim(t)
	d, stateDir := newDriver(t, cfg, func(m *service.Client) map[string]source.Source {
		return map[string]source.Source{iscsi.Type: iscsi.New(cfg.ISCSI, m, nil)}
	})
	secrets := map[string]string{iscsi.SecretUsername: chapUser, iscsi.SecretPassword: chapPassword}
	f := &flow{t: t, d: d, stateDir: stateDir, id: "iscsi-vol", secrets: secrets,
		vctx: map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN, "lun": "1"}}

	w := watchSecret(chapPassword)
	start := time.Now()
	err := f.stage()
	hits, scans := w.finish()
	if err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	st := f.state()
	t.Logf("stage with login and format: %v, state %s", time.Since(start), st)
	if !st.has(`"fsType":"ext4"`) || !st.has(`"device":"/dev/sd`) {
		t.Fatalf("state %s", st)
	}
	if hits != 0 || scans < 2 {
		t.Fatalf("the CHAP password was seen in /proc/*/cmdline or environ %d times (%d scans)", hits, scans)
	}
	t.Logf("CHAP password in no command line or environment: %d scans of /proc during stage", scans)
	if len(sessions()) != 1 {
		t.Fatalf("sessions %v, want 1", sessions())
	}
	f.writeRemountRead()
	if err := f.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	if s := sessions(); len(s) != 0 {
		t.Fatalf("sessions left after unstage: %v", s)
	}
	if recs, _ := filepath.Glob("/etc/iscsi/nodes/*"); len(recs) != 0 {
		t.Fatalf("node records left after unstage: %v", recs)
	}

	// Bad input: each leaves no session behind.
	for _, tc := range []struct {
		name    string
		vctx    map[string]string
		secrets map[string]string
		code    codes.Code
	}{
		{"wrong CHAP password", f.vctx, map[string]string{iscsi.SecretUsername: chapUser, iscsi.SecretPassword: chapPassword + "-wrong"}, codes.PermissionDenied},
		{"LUN that does not exist", map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN, "lun": "5"}, secrets, codes.NotFound},
		{"target that does not exist", map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN + "x", "lun": "1"}, secrets, codes.NotFound},
		{"portal not allowed", map[string]string{"type": "iscsi", "portals": "127.0.0.2:" + strings.Split(tg.Portal, ":")[1], "iqn": tg.IQN, "lun": "1"}, secrets, codes.InvalidArgument},
	} {
		bad := &flow{t: t, d: d, stateDir: stateDir, id: "bad", vctx: tc.vctx, secrets: tc.secrets}
		err := bad.stage()
		wantCode(t, tc.name, err, tc.code)
		if err != nil && strings.Contains(err.Error(), chapPassword) {
			t.Fatalf("%s: the error shows the password", tc.name)
		}
		if s := sessions(); len(s) != 0 {
			t.Fatalf("%s: sessions left: %v", tc.name, s)
		}
		if recs, _ := filepath.Glob("/etc/iscsi/nodes/*"); len(recs) != 0 {
			t.Fatalf("%s: node records left: %v", tc.name, recs)
		}
	}

	argv, err := os.ReadFile(argvLog)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(argv, []byte(chapPassword)) || bytes.Contains(argv, []byte(" -v ")) {
		t.Fatalf("iscsiadm was given the password or a -v value:\n%s", argv)
	}
	t.Logf("iscsiadm calls (recorded by a shim):\n%s", argv)
	if strings.Contains(logs.String(), chapPassword) {
		t.Fatal("a log line shows the CHAP password")
	}
}

// iscsiadmShim puts a recording iscsiadm first on PATH (the mounter, in
// this process, runs "iscsiadm" from PATH) and returns the file its argv
// lines go to.
func iscsiadmShim(t *testing.T) string {
	t.Helper()
	shimDir := t.TempDir()
	argvLog := filepath.Join(shimDir, "argv.log")
	script := "#!/bin/sh\necho \"$0 $*\" >> " + argvLog + "\nexec /usr/sbin/iscsiadm \"$@\"\n"
	if err := os.WriteFile(filepath.Join(shimDir, "iscsiadm"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", shimDir+":"+os.Getenv("PATH"))
	return argvLog
}

// health returns the volume's abnormal health entry, or nil.
func health(t *testing.T, d *driver.Driver, id string) *csi.VolumeHealth_VolumeHealthEntry {
	t.Helper()
	resp, err := d.NodeGetVolumeHealth(context.Background(), &csi.NodeGetVolumeHealthRequest{VolumeId: id})
	if err != nil {
		t.Fatalf("NodeGetVolumeHealth: %v", err)
	}
	if h := resp.GetVolumeHealth().GetHealthStatuses(); len(h) > 0 {
		return h[0]
	}
	return nil
}

// TestISCSIReattach: a staged, published CHAP volume whose session is
// logged out behind the plugin's back reports abnormal health; a new
// driver over the same state dir (a restarted plugin) logs in again from
// the node record in its Reconcile, the data reads back through a new
// mount, and unstage logs out and removes the record. The password is in
// no argv, environment or log line during the re-login either.
func TestISCSIReattach(t *testing.T) {
	requireGuest(t)
	startIscsid(t)
	tg := iscsitest.StartTgtd(t, t.TempDir(), iscsitest.Options{LUNSizes: []int64{64 << 20}, CHAPUser: chapUser, CHAPPassword: chapPassword})
	cfg := &config.Config{ISCSI: config.ISCSIConfig{AllowedPortals: []string{"127.0.0.1:*"}, DeviceTimeoutSeconds: 30}}
	argvLog := iscsiadmShim(t)
	d, stateDir := newDriver(t, cfg, func(m *service.Client) map[string]source.Source {
		return map[string]source.Source{iscsi.Type: iscsi.New(cfg.ISCSI, m, nil)}
	})
	f := &flow{t: t, d: d, stateDir: stateDir, id: "iscsi-re", secrets: map[string]string{iscsi.SecretUsername: chapUser, iscsi.SecretPassword: chapPassword},
		vctx: map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN, "lun": "1"}}
	if err := f.stage(); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	before := f.state()
	f.publish()
	want := []byte("written before the session was lost\n")
	file, err := os.Create(filepath.Join(f.target(), "kept.txt"))
	if err == nil {
		_, err = file.Write(want)
	}
	if err == nil {
		err = file.Sync()
	}
	if err == nil {
		err = file.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	if h := health(t, d, f.id); h != nil {
		t.Fatalf("health after stage: %v", h)
	}

	// Behind the plugin's back: the session ends (as a reboot ends it).
	ss := sessions()
	if len(ss) != 1 {
		t.Fatalf("sessions %v, want 1", ss)
	}
	oldSID := strings.TrimPrefix(filepath.Base(ss[0]), "session")
	if out, err := exec.Command("/usr/sbin/iscsiadm", "-m", "session", "-r", oldSID, "-u").CombinedOutput(); err != nil {
		t.Fatalf("iscsiadm logout: %v\n%s", err, out)
	}
	if s := sessions(); len(s) != 0 {
		t.Fatalf("sessions after the logout: %v", s)
	}
	h := health(t, d, f.id)
	if h == nil || h.GetReason() != "SessionGone" {
		t.Fatalf("health with the session gone: %v, want SessionGone", h)
	}
	t.Logf("health with the session gone: %v", h)

	// A restarted plugin: a new source and driver over the same state.
	w := watchSecret(chapPassword)
	start := time.Now()
	d2, _ := newDriverAt(t, cfg, func(m *service.Client) map[string]source.Source {
		return map[string]source.Source{iscsi.Type: iscsi.New(cfg.ISCSI, m, nil)}
	}, stateDir)
	hits, scans := w.finish()
	t.Logf("reconcile with re-login: %v", time.Since(start))
	if hits != 0 || scans < 2 {
		t.Fatalf("the CHAP password was seen in /proc/*/cmdline or environ %d times (%d scans) during the re-login", hits, scans)
	}
	ss = sessions()
	if len(ss) != 1 || strings.TrimPrefix(filepath.Base(ss[0]), "session") == oldSID {
		t.Fatalf("sessions after reconcile: %v (old session %s), want one new session", ss, oldSID)
	}
	after := f.state()
	newSID := strings.TrimPrefix(filepath.Base(ss[0]), "session")
	if !after.has(`"sid":`+newSID+`,`) || !after.has(`"fsType":"ext4"`) {
		t.Fatalf("state after reconcile %s, want sid %s (before: %s)", after, newSID, before)
	}
	t.Logf("state before %s\nstate after reconcile %s", before, after)
	if h := health(t, d2, f.id); h != nil {
		t.Fatalf("health after reconcile: %v", h)
	}

	// The old publish still shows the dead disk: unmount and mount again.
	f.d = d2
	f.unpublish()
	f.publish()
	got, err := os.ReadFile(filepath.Join(f.target(), "kept.txt"))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back after the re-login: %q, %v; want %q", got, err, want)
	}
	f.unpublish()
	if err := f.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	if s := sessions(); len(s) != 0 {
		t.Fatalf("sessions left after unstage: %v", s)
	}
	if recs, _ := filepath.Glob("/etc/iscsi/nodes/*"); len(recs) != 0 {
		t.Fatalf("node records left after unstage: %v", recs)
	}

	argv, err := os.ReadFile(argvLog)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(argv, []byte(chapPassword)) || bytes.Contains(argv, []byte(" -v ")) {
		t.Fatalf("iscsiadm was given the password or a -v value:\n%s", argv)
	}
	if n := bytes.Count(argv, []byte(" --login")); n != 2 {
		t.Fatalf("iscsiadm logins %d, want 2 (stage, re-login):\n%s", n, argv)
	}
	t.Logf("iscsiadm calls (recorded by a shim):\n%s", argv)
	if strings.Contains(logs.String(), chapPassword) {
		t.Fatal("a log line shows the CHAP password")
	}
}

// TestISCSISameTarget (review finding 4): two volumes are LUNs of one
// CHAP target. While the first is staged and published, a second volume
// of the target with no CHAP secret, or wrong ones, is refused
// (PermissionDenied): the mounter shares its session only with the
// credentials it made it with. The first volume keeps working: the same
// session, its health, its data written and read back. With the right
// credentials the second joins the session (no second login) and gets its
// own LUN; its unstage leaves the first's session. A session that the
// mounter did not log in (the admin's, to another target) is never
// joined: FailedPrecondition, and it stays logged in.
func TestISCSISameTarget(t *testing.T) {
	requireGuest(t)
	startIscsid(t)
	tg := iscsitest.StartTgtd(t, t.TempDir(), iscsitest.Options{LUNSizes: []int64{64 << 20, 32 << 20}, CHAPUser: chapUser, CHAPPassword: chapPassword})
	cfg := &config.Config{ISCSI: config.ISCSIConfig{AllowedPortals: []string{"127.0.0.1:*"}, DeviceTimeoutSeconds: 30}}
	argvLog := iscsiadmShim(t)
	d, stateDir := newDriver(t, cfg, func(m *service.Client) map[string]source.Source {
		return map[string]source.Source{iscsi.Type: iscsi.New(cfg.ISCSI, m, nil)}
	})
	secrets := map[string]string{iscsi.SecretUsername: chapUser, iscsi.SecretPassword: chapPassword}
	lun := func(n string) map[string]string {
		return map[string]string{"type": "iscsi", "portals": tg.Portal, "iqn": tg.IQN, "lun": n}
	}
	a := &flow{t: t, d: d, stateDir: stateDir, id: "iscsi-a", secrets: secrets, vctx: lun("1")}
	if err := a.stage(); err != nil {
		t.Fatalf("NodeStageVolume of the first volume: %v", err)
	}
	a.publish()
	ss := sessions()
	if len(ss) != 1 {
		t.Fatalf("sessions %v, want 1", ss)
	}
	aState := a.state()
	// firstWorks: the first volume's session is the same, healthy, and its
	// filesystem takes a write that reads back from the disk.
	firstWorks := func(when string) {
		t.Helper()
		if s := sessions(); !slices.Equal(s, ss) {
			t.Fatalf("%s: sessions %v, want %v", when, s, ss)
		}
		if h := health(t, d, a.id); h != nil {
			t.Fatalf("%s: health of the first volume: %v", when, h)
		}
		p := filepath.Join(a.target(), "a.txt")
		want := []byte("first volume, " + when + "\n")
		file, err := os.OpenFile(p, os.O_CREATE|os.O_TRUNC|os.O_WRONLY|os.O_SYNC, 0o644)
		if err == nil {
			_, err = file.Write(want)
			if cerr := file.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			t.Fatalf("%s: writing to the first volume: %v", when, err)
		}
		if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
			t.Logf("drop_caches: %v", err)
		}
		if got, err := os.ReadFile(p); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s: read back from the first volume: %q, %v", when, got, err)
		}
	}
	firstWorks("before")
	logins := func() int {
		b, _ := os.ReadFile(argvLog)
		return bytes.Count(b, []byte(" --login"))
	}
	loginsBefore := logins()

	for i, tc := range []struct {
		name    string
		secrets map[string]string
	}{
		{"no CHAP secret", nil},
		{"a wrong CHAP password", map[string]string{iscsi.SecretUsername: chapUser, iscsi.SecretPassword: chapPassword + "-wrong"}},
		{"another CHAP user", map[string]string{iscsi.SecretUsername: "mallory", iscsi.SecretPassword: chapPassword}},
		{"mutual CHAP added", map[string]string{iscsi.SecretUsername: chapUser, iscsi.SecretPassword: chapPassword,
			iscsi.SecretUsernameIn: "target", iscsi.SecretPasswordIn: "target-secret-12"}},
	} {
		b := &flow{t: t, d: d, stateDir: stateDir, id: fmt.Sprintf("iscsi-bad%d", i), secrets: tc.secrets, vctx: lun("2")}
		err := b.stage()
		wantCode(t, "second volume of the target with "+tc.name, err, codes.PermissionDenied)
		if strings.Contains(err.Error(), chapPassword) {
			t.Fatalf("%s: the error shows the password", tc.name)
		}
		firstWorks("after a refused stage with " + tc.name)
	}
	if n := logins(); n != loginsBefore {
		t.Fatalf("refused stages ran %d logins", n-loginsBefore)
	}
	if !bytes.Equal(a.state(), aState) {
		t.Fatalf("the first volume's state changed: %s (was %s)", a.state(), aState)
	}

	// The same credentials: the second volume joins the session.
	b := &flow{t: t, d: d, stateDir: stateDir, id: "iscsi-b", secrets: secrets, vctx: lun("2")}
	if err := b.stage(); err != nil {
		t.Fatalf("NodeStageVolume of the second volume with the session's credentials: %v", err)
	}
	if n := logins(); n != loginsBefore {
		t.Fatalf("the second volume logged in again (%d logins) instead of joining", n-loginsBefore)
	}
	sid := strings.TrimPrefix(filepath.Base(ss[0]), "session")
	if bs := b.state(); !bs.has(`"sid":`+sid+`,`) || !bs.has(`"lun":2,`) || bytes.Equal(bs, aState) {
		t.Fatalf("second volume's state %s, want session %s and LUN 2", bs, sid)
	}
	b.writeRemountRead()
	firstWorks("with the second volume staged")
	if err := b.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume of the second volume: %v", err)
	}
	firstWorks("after the second volume's unstage")
	a.unpublish()
	if err := a.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume of the first volume: %v", err)
	}
	if s := sessions(); len(s) != 0 {
		t.Fatalf("sessions left after unstage: %v", s)
	}
	if recs, _ := filepath.Glob("/etc/iscsi/nodes/*"); len(recs) != 0 {
		t.Fatalf("node records left after unstage: %v", recs)
	}

	// The admin's session to a target without CHAP: never joined.
	other := iscsitest.StartTgtd(t, t.TempDir(), iscsitest.Options{IQN: "iqn.2024-01.io.mountplan.test:admins", LUNSizes: []int64{16 << 20}})
	adm := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("/usr/sbin/iscsiadm", args...).CombinedOutput(); err != nil {
			t.Fatalf("iscsiadm %q: %v\n%s", args, err, out)
		}
	}
	adm("-m", "node", "-o", "new", "-T", other.IQN, "-p", other.Portal)
	adm("-m", "node", "-T", other.IQN, "-p", other.Portal, "--login")
	admins := sessions()
	if len(admins) != 1 {
		t.Fatalf("sessions %v after the admin's login, want 1", admins)
	}
	for i, s := range []map[string]string{nil, secrets} {
		c := &flow{t: t, d: d, stateDir: stateDir, id: fmt.Sprintf("iscsi-admins%d", i), secrets: s,
			vctx: map[string]string{"type": "iscsi", "portals": other.Portal, "iqn": other.IQN, "lun": "1"}}
		err := c.stage()
		wantCode(t, "a volume of the admin's session's target", err, codes.FailedPrecondition)
		if s := sessions(); !slices.Equal(s, admins) {
			t.Fatalf("sessions %v after the refusal, want the admin's %v", s, admins)
		}
	}
	adm("-m", "node", "-T", other.IQN, "-p", other.Portal, "--logout")
	adm("-m", "node", "-o", "delete", "-T", other.IQN, "-p", other.Portal)

	argv, err := os.ReadFile(argvLog)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(argv, []byte(chapPassword)) || bytes.Contains(argv, []byte(" -v ")) {
		t.Fatalf("iscsiadm was given the password or a -v value:\n%s", argv)
	}
	t.Logf("iscsiadm calls (recorded by a shim):\n%s", argv)
	if strings.Contains(logs.String(), chapPassword) {
		t.Fatal("a log line shows the CHAP password")
	}
}

// TestLoopExpandOnline grows a published ext4 loop volume through the
// driver: the kernel's online ext4 resize wants CAP_SYS_RESOURCE, which
// the guest's init has and a CI container may lack (there make test checks
// the FailedPrecondition instead).
func TestLoopExpandOnline(t *testing.T) {
	requireGuest(t)
	const size, grown = 32 << 20, 64 << 20
	d, stateDir := newDriver(t, &config.Config{}, nil)
	f := &flow{t: t, d: d, stateDir: stateDir, id: "loop-grow"}
	ctx := context.Background()
	c := mountCap()
	if _, err := d.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: f.id, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: map[string]string{"type": "loop"}}); err != nil {
		t.Fatalf("CreateVolume: %v", err)
	}
	if err := f.stage(); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	f.publish()
	want := []byte("kept across the resize\n")
	if err := os.WriteFile(filepath.Join(f.target(), "kept.txt"), want, 0o644); err != nil {
		t.Fatal(err)
	}
	var before, after syscall.Statfs_t
	if err := syscall.Statfs(f.target(), &before); err != nil {
		t.Fatal(err)
	}
	if _, err := d.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: f.id,
		CapacityRange: &csi.CapacityRange{RequiredBytes: grown}, VolumeCapability: c}); err != nil {
		t.Fatalf("ControllerExpandVolume: %v", err)
	}
	nr, err := d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: f.id, VolumePath: f.target(),
		StagingTargetPath: filepath.Join(stateDir, "staging", f.id), CapacityRange: &csi.CapacityRange{RequiredBytes: grown}, VolumeCapability: c})
	if err != nil {
		t.Fatalf("NodeExpandVolume of a mounted ext4: %v", err)
	}
	if err := syscall.Statfs(f.target(), &after); err != nil {
		t.Fatal(err)
	}
	if nr.GetCapacityBytes() < grown || after.Blocks*uint64(after.Bsize) <= before.Blocks*uint64(before.Bsize)+size/2 {
		t.Fatalf("after NodeExpandVolume: capacity %d, filesystem %d bytes (was %d); want it grown to about %d",
			nr.GetCapacityBytes(), after.Blocks*uint64(after.Bsize), before.Blocks*uint64(before.Bsize), grown)
	}
	t.Logf("ext4 grew online from %d to %d bytes", before.Blocks*uint64(before.Bsize), after.Blocks*uint64(after.Bsize))
	if got, err := os.ReadFile(filepath.Join(f.target(), "kept.txt")); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back after the resize: %q, %v", got, err)
	}
	f.unpublish()
	if err := f.unstage(); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
	if _, err := d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: f.id}); err != nil {
		t.Fatalf("DeleteVolume: %v", err)
	}
}
