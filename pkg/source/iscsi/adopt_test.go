package iscsi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/source"
	"github.com/mountplan/mountplan/pkg/source/sourcetest"
	"github.com/mountplan/mountplan/pkg/toolrun"
)

// fakeNode is a node's iSCSI side without a kernel: a sysfs tree under
// the source's SysDir and DevDir, and an iscsiadm (the source's run) that
// makes and ends sessions in it and records its calls.
type fakeNode struct {
	t       *testing.T
	s       *Source
	nextSID int
	disk    int // sd index of the next disk
	calls   [][]string
	// loginStatus, when set, is the exit status --login fails with.
	loginStatus int
}

const (
	fakeIQN    = "iqn.2024-01.io.mountplan.test:disk"
	fakePortal = "127.0.0.1:3260"
	fakeLUN    = 1
)

func newFakeNode(t *testing.T) *fakeNode {
	t.Helper()
	s := newSource(t, "127.0.0.1:*")
	s.SysDir, s.DevDir = t.TempDir(), t.TempDir()
	n := &fakeNode{t: t, s: s, nextSID: 1}
	s.runner = toolrun.Runner{Exec: n.iscsiadm}
	if err := os.MkdirAll(filepath.Join(s.SysDir, "module", "iscsi_tcp"), 0o755); err != nil {
		t.Fatal(err)
	}
	return n
}

func (n *fakeNode) sys(parts ...string) string {
	return filepath.Join(append([]string{n.s.SysDir}, parts...)...)
}

func (n *fakeNode) write(path, content string) {
	n.t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		n.t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content+"\n"), 0o644); err != nil {
		n.t.Fatal(err)
	}
}

// addSession makes session SID to the fake target, on SCSI host SID+10,
// with LUN fakeLUN's disk, as the kernel shows a login.
func (n *fakeNode) addSession() int {
	n.t.Helper()
	sid, host := n.nextSID, n.nextSID+10
	n.nextSID++
	hostDir := n.sys("devices", "platform", fmt.Sprintf("host%d", host))
	sessDev := filepath.Join(hostDir, fmt.Sprintf("session%d", sid))
	name := "sd" + string(rune('a'+n.disk))
	n.disk++
	hctl := fmt.Sprintf("%d:0:0:%d", host, fakeLUN)
	devnum := "8:" + strconv.Itoa(16*(n.disk-1))
	n.write(filepath.Join(sessDev, fmt.Sprintf("target%d:0:0", host), hctl, "block", name, "dev"), devnum)
	sess := n.sys("class", "iscsi_session", fmt.Sprintf("session%d", sid))
	n.write(filepath.Join(sess, "targetname"), fakeIQN)
	n.write(filepath.Join(sess, "state"), "LOGGED_IN")
	if err := os.Symlink(sessDev, filepath.Join(sess, "device")); err != nil {
		n.t.Fatal(err)
	}
	conn := n.sys("class", "iscsi_connection", fmt.Sprintf("connection%d:0", sid))
	n.write(filepath.Join(conn, "persistent_address"), "127.0.0.1")
	n.write(filepath.Join(conn, "persistent_port"), "3260")
	n.write(n.sys("class", "scsi_host", fmt.Sprintf("host%d", host), "scan"), "")
	n.write(n.sys("class", "block", name, "dev"), devnum)
	n.write(filepath.Join(n.s.DevDir, name), "")
	return sid
}

// dropSession is a logout behind the plugin's back (or a reboot).
func (n *fakeNode) dropSession(sid int) {
	sess := n.sys("class", "iscsi_session", fmt.Sprintf("session%d", sid))
	link, _ := os.Readlink(filepath.Join(sess, "device"))
	blocks, _ := filepath.Glob(filepath.Join(link, "target*", "*", "block", "*"))
	for _, b := range blocks {
		os.RemoveAll(n.sys("class", "block", filepath.Base(b)))
		os.Remove(filepath.Join(n.s.DevDir, filepath.Base(b)))
	}
	os.RemoveAll(sess)
	os.RemoveAll(n.sys("class", "iscsi_connection", fmt.Sprintf("connection%d:0", sid)))
}

func (n *fakeNode) recordDir() string {
	return filepath.Join(n.s.Config.NodeDBDir, fakeIQN, "127.0.0.1,3260,1")
}

func (n *fakeNode) iscsiadm(_ context.Context, _ string, args []string) ([]byte, int, error) {
	n.calls = append(n.calls, args)
	a := strings.Join(args, " ")
	switch {
	case strings.HasPrefix(a, "-m node -o new "):
		n.write(filepath.Join(n.recordDir(), "default"), "node.name = "+fakeIQN+"\nnode.session.auth.authmethod = None")
	case strings.HasSuffix(a, " --login"):
		if n.loginStatus != 0 {
			return []byte("iscsiadm: login failed"), n.loginStatus, nil
		}
		if _, err := os.Stat(filepath.Join(n.recordDir(), "default")); err != nil {
			return []byte("iscsiadm: No records found"), 21, nil
		}
		n.addSession()
	case strings.HasPrefix(a, "-m session -r ") && strings.HasSuffix(a, " --logout"):
		sid, _ := strconv.Atoi(args[3])
		n.dropSession(sid)
	case strings.HasPrefix(a, "-m node -o delete "):
		os.RemoveAll(filepath.Join(n.s.Config.NodeDBDir, fakeIQN))
	default:
		n.t.Errorf("unexpected iscsiadm %s", a)
	}
	return nil, 0, nil
}

// stage stages volume "v1" (LUN fakeLUN, CHAP) through the plugin's join
// and waitDisk, as Stage does after discovery, and returns its record.
func (n *fakeNode) stage(id string) source.Volume {
	n.t.Helper()
	v, err := n.s.NewVolume(id, map[string]string{"portals": fakePortal, "iqn": fakeIQN, "lun": strconv.Itoa(fakeLUN)})
	if err != nil {
		n.t.Fatal(err)
	}
	c := credentials{user: "u", password: "canary-pw"}
	st, err := n.s.join(context.Background(), id, targetOf(v), Portal{Address: fakePortal, TPGT: 1}, &c)
	if err != nil {
		n.t.Fatal(err)
	}
	if err := n.s.waitDisk(context.Background(), &st); err != nil {
		n.t.Fatal(err)
	}
	st.FsType = "ext4"
	b, _ := json.Marshal(st)
	v = sourcetest.Staged(v, b)
	return v
}

// session is the record the driver keeps of the session key (zero: none).
func (n *fakeNode) session(key string) session {
	n.t.Helper()
	var rec session
	if b := n.s.getHost().(*sourcetest.Host).Shared(sharedKind, key); b != nil {
		if err := json.Unmarshal(b, &rec); err != nil {
			n.t.Fatal(err)
		}
	}
	return rec
}

func (n *fakeNode) owner(key string) *owner { return n.session(key).Owner }

func stateOf(t *testing.T, raw json.RawMessage) State {
	t.Helper()
	var st State
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// TestAdoptLogsInAgain: a staged volume whose session was logged out
// behind the plugin's back is abnormal, and Adopt logs in again from the
// node record alone (no CHAP on any argv, no record rewrite), records the
// new session and disk, keeps the owner record (and that the plugin made
// the node record), and unstage then logs out and deletes the record.
func TestAdoptLogsInAgain(t *testing.T) {
	n := newFakeNode(t)
	v := n.stage("v1")
	old := stateOf(t, v.State)
	rec := filepath.Join(n.recordDir(), "default")
	recBefore, _ := os.ReadFile(rec)
	if !strings.Contains(string(recBefore), "canary-pw") {
		t.Fatalf("stage did not write CHAP into the record:\n%s", recBefore)
	}
	ctx := context.Background()
	if h := n.s.Health(ctx, v); h.Abnormal {
		t.Fatalf("health after stage: %+v", h)
	}
	if raw, err := n.s.Adopt(ctx, v); err != nil || string(raw) != string(v.State) {
		t.Fatalf("Adopt of a healthy volume = %s, %v; want the state unchanged", raw, err)
	}

	n.dropSession(old.SID)
	h := n.s.Health(ctx, v)
	if !h.Abnormal || h.Reason != "SessionGone" {
		t.Fatalf("health with the session gone: %+v, want SessionGone", h)
	}
	n.calls = nil
	raw, err := n.s.Adopt(ctx, v)
	if err != nil {
		t.Fatalf("Adopt with the session gone: %v", err)
	}
	want := [][]string{{"-m", "node", "-T", fakeIQN, "-p", fakePortal, "--login"}}
	if !slices.EqualFunc(n.calls, want, slices.Equal) {
		t.Fatalf("iscsiadm calls %q, want %q", n.calls, want)
	}
	st := stateOf(t, raw)
	if st.SID == old.SID || st.Device == old.Device || st.DevNum == "" || st.FsType != "ext4" || st.Session != old.Session || st.LUN != fakeLUN {
		t.Fatalf("state after Adopt %+v (before %+v)", st, old)
	}
	if recAfter, _ := os.ReadFile(rec); string(recAfter) != string(recBefore) {
		t.Fatalf("Adopt changed the node record")
	}
	if own := n.owner(st.Session); own == nil || own.SID != st.SID || !own.CreatedRecord {
		t.Fatalf("owner record %+v, want SID %d and createdRecord", own, st.SID)
	}
	if !slices.Contains(n.session(st.Session).Users, "v1") {
		t.Fatalf("volume marker: %+v", n.session(st.Session))
	}
	v.State = raw
	if h := n.s.Health(ctx, v); h.Abnormal {
		t.Fatalf("health after Adopt: %+v", h)
	}

	n.calls = nil
	if err := n.s.Unstage(ctx, v); err != nil {
		t.Fatal(err)
	}
	want = [][]string{{"-m", "session", "-r", strconv.Itoa(st.SID), "--logout"}, {"-m", "node", "-o", "delete", "-T", fakeIQN, "-p", fakePortal}}
	if !slices.EqualFunc(n.calls, want, slices.Equal) {
		t.Fatalf("unstage's iscsiadm calls %q, want %q", n.calls, want)
	}
	if ents, _ := os.ReadDir(filepath.Join(n.s.StateDir, "iscsi", "sessions")); len(ents) != 0 {
		t.Fatalf("session registry not empty: %v", ents)
	}
}

// TestAdoptRecordGone: without the node record the secrets are gone too:
// FailedPrecondition saying so, no iscsiadm call, the volume still
// registered (unstage cleans up).
func TestAdoptRecordGone(t *testing.T) {
	n := newFakeNode(t)
	v := n.stage("v1")
	st := stateOf(t, v.State)
	n.dropSession(st.SID)
	os.RemoveAll(filepath.Join(n.s.Config.NodeDBDir, fakeIQN))
	n.calls = nil
	_, err := n.s.Adopt(context.Background(), v)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "node record") || !strings.Contains(err.Error(), "stage it again") {
		t.Fatalf("Adopt with the record gone = %v, want FailedPrecondition about the node record", err)
	}
	if len(n.calls) != 0 {
		t.Fatalf("iscsiadm called: %q", n.calls)
	}
	if !slices.Contains(n.session(st.Session).Users, "v1") {
		t.Fatalf("volume marker gone: %+v", n.session(st.Session))
	}
	if err := n.s.Unstage(context.Background(), v); err != nil {
		t.Fatal(err)
	}
}

// TestAdoptLoginFails: a failed re-login (iscsid down, target away) keeps
// the node record and the volume's registration for the next try.
func TestAdoptLoginFails(t *testing.T) {
	n := newFakeNode(t)
	v := n.stage("v1")
	st := stateOf(t, v.State)
	n.dropSession(st.SID)
	n.loginStatus = 8
	if _, err := n.s.Adopt(context.Background(), v); err == nil {
		t.Fatal("Adopt with a failing login succeeded")
	}
	if _, err := os.Stat(filepath.Join(n.recordDir(), "default")); err != nil {
		t.Fatalf("node record gone after a failed re-login: %v", err)
	}
	if !slices.Contains(n.session(st.Session).Users, "v1") {
		t.Fatalf("volume marker gone after a failed re-login: %+v", n.session(st.Session))
	}
	n.loginStatus = 0
	raw, err := n.s.Adopt(context.Background(), v)
	if err != nil {
		t.Fatalf("Adopt once login works: %v", err)
	}
	if own := n.owner(st.Session); own == nil || own.SID != stateOf(t, raw).SID || !own.CreatedRecord {
		t.Fatalf("owner record after retry: %+v", own)
	}
}

// TestAdoptSharedSession: two LUN users of one session; after a logout the
// first Adopt logs in, the second joins that session without a login.
func TestAdoptSharedSession(t *testing.T) {
	n := newFakeNode(t)
	a := n.stage("a")
	b := n.stage("b")
	sa, sb := stateOf(t, a.State), stateOf(t, b.State)
	if sa.SID != sb.SID {
		t.Fatalf("two sessions: %d, %d", sa.SID, sb.SID)
	}
	n.dropSession(sa.SID)
	n.calls = nil
	rawA, err := n.s.Adopt(context.Background(), a)
	if err != nil {
		t.Fatal(err)
	}
	rawB, err := n.s.Adopt(context.Background(), b)
	if err != nil {
		t.Fatal(err)
	}
	if len(n.calls) != 1 {
		t.Fatalf("iscsiadm calls %q, want one login", n.calls)
	}
	if stateOf(t, rawA).SID != stateOf(t, rawB).SID {
		t.Fatalf("volumes on different sessions after Adopt: %s %s", rawA, rawB)
	}
}

// TestRedactPasswordFields: a record echoed by iscsiadm has its password
// values blotted out even when the plugin does not know them (a re-login).
func TestRedactPasswordFields(t *testing.T) {
	in := "node.session.auth.username = u\nnode.session.auth.password = hunter2\nnode.session.auth.password_in=back two\nnode.name = x"
	got := admOutput(t, in, credentials{})
	if strings.Contains(got, "hunter2") || strings.Contains(got, "back two") || !strings.Contains(got, "username = u\n") || !strings.Contains(got, "node.name = x") {
		t.Fatalf("redact:\n%s", got)
	}
}

// admOutput is the error of an iscsiadm run that printed out and failed:
// what of a tool's output reaches an error.
func admOutput(t *testing.T, out string, c credentials) string {
	t.Helper()
	s := &Source{runner: toolrun.Runner{Exec: func(context.Context, string, []string) ([]byte, int, error) {
		return []byte(out), 1, nil
	}}}
	_, err := s.adm(t.Context(), c, "-m", "node")
	if err == nil {
		t.Fatal("adm of a failing run succeeded")
	}
	return err.Error()
}

// TestLegacyRegistryTakenOver: the session registry a plugin of an
// earlier version kept in files of its own becomes the driver's records
// when the driver is handed over, and the files go.
func TestLegacyRegistryTakenOver(t *testing.T) {
	s := New(config.ISCSIConfig{AllowedPortals: []string{"127.0.0.1:*"}, NodeDBDir: t.TempDir()}, t.TempDir(), nil)
	key := sessionKey(fakeIQN, fakePortal)
	dir := filepath.Join(s.StateDir, "iscsi", "sessions", key)
	if err := os.MkdirAll(filepath.Join(dir, "users"), 0o700); err != nil {
		t.Fatal(err)
	}
	for _, f := range []struct{ path, data string }{
		{filepath.Join(dir, "users", "v1"), fakeIQN + " " + fakePortal + "\n"},
		{filepath.Join(dir, "users", "v2"), fakeIQN + " " + fakePortal + "\n"},
		{filepath.Join(dir, "owner.json"), `{"target":"` + fakeIQN + `","portal":"` + fakePortal + `","tpgt":1,"sid":7,"createdRecord":true}`},
	} {
		if err := os.WriteFile(f.path, []byte(f.data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	host := &sourcetest.Host{}
	s.SetHost(host)
	var rec session
	if err := json.Unmarshal(host.Shared(sharedKind, key), &rec); err != nil {
		t.Fatal(err)
	}
	slices.Sort(rec.Users)
	if !slices.Equal(rec.Users, []string{"v1", "v2"}) || rec.Owner == nil || rec.Owner.SID != 7 || !rec.Owner.CreatedRecord {
		t.Fatalf("taken over: %+v (owner %+v)", rec, rec.Owner)
	}
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Fatalf("the old registry is still there: %v", err)
	}
}
