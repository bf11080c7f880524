package iscsi

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/iscsi/iscsitest"
	"github.com/mountplan/mountplan/internal/source/sourcetest"
)

// fakeNode is a node's iSCSI side without a kernel: the real mounter
// (mounter.Local) logging in through a fake iscsiadm into a fake sysfs
// (iscsitest.FakeNode), which the source reads as the node's /sys.
type fakeNode struct {
	*iscsitest.FakeNode
	t *testing.T
	s *Source
	m *mounter.Local
	// records is the mounter's records dir.
	records string
}

const (
	fakeIQN    = iscsitest.FakeIQN
	fakePortal = iscsitest.FakePortal
	fakeLUN    = iscsitest.FakeLUN
)

func newFakeNode(t *testing.T) *fakeNode {
	t.Helper()
	f := iscsitest.NewFakeNode(t)
	s := newSource(t, "127.0.0.1:*")
	s.SysDir, s.DevDir = f.SysDir, f.DevDir
	n := &fakeNode{FakeNode: f, t: t, s: s, records: filepath.Join(t.TempDir(), "records")}
	n.m = n.mounter()
	return n
}

// mounter starts a mounter over the node's records (again, for a
// restart) and makes it the source's.
func (n *fakeNode) mounter() *mounter.Local {
	n.t.Helper()
	cfg := &config.Config{ISCSI: config.ISCSIConfig{AllowedPortals: []string{"127.0.0.1:*"}, NodeDBDir: n.NodeDBDir}}
	m, err := mounter.NewNode(context.Background(), mounter.Options{StateDir: n.t.TempDir(), RecordsDir: n.records, Config: cfg})
	if err != nil {
		n.t.Fatal(err)
	}
	n.t.Cleanup(func() { m.Close() })
	m.SetISCSITestHooks(n.SysDir, n.Exec)
	n.s.Devices = m
	return m
}

func (n *fakeNode) addSession() int { return n.AddSession() }

func (n *fakeNode) dropSession(sid int) { n.DropSession(sid) }

func (n *fakeNode) recordDir() string { return n.RecordDir() }

// fakeCreds are the credentials fakeNode.stage logs in with.
var fakeCreds = credentials{user: "u", password: "canary-pw"}

// stage stages volume id (LUN fakeLUN, CHAP) through the plugin's join
// and waitDisk, as Stage does after discovery, and returns its record.
func (n *fakeNode) stage(id string) source.Volume {
	n.t.Helper()
	v, err := n.s.NewVolume(id, map[string]string{"portals": fakePortal, "iqn": fakeIQN, "lun": strconv.Itoa(fakeLUN)})
	if err != nil {
		n.t.Fatal(err)
	}
	c := fakeCreds
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
	n.Calls()
	raw, err := n.s.Adopt(ctx, v)
	if err != nil {
		t.Fatalf("Adopt with the session gone: %v", err)
	}
	want := [][]string{{"-m", "node", "-T", fakeIQN, "-p", fakePortal, "--login"}}
	if calls := n.Calls(); !slices.EqualFunc(calls, want, slices.Equal) {
		t.Fatalf("iscsiadm calls %q, want %q", calls, want)
	}
	st := stateOf(t, raw)
	if st.SID == old.SID || st.Device == old.Device || st.DevNum == "" || st.FsType != "ext4" || st.Session != old.Session || st.LUN != fakeLUN {
		t.Fatalf("state after Adopt %+v (before %+v)", st, old)
	}
	if recAfter, _ := os.ReadFile(rec); string(recAfter) != string(recBefore) {
		t.Fatalf("Adopt changed the node record")
	}
	if own := n.owner(st.Session); own == nil || own.SID != st.SID {
		t.Fatalf("owner record %+v, want SID %d", own, st.SID)
	}
	if !slices.Contains(n.session(st.Session).Users, "v1") {
		t.Fatalf("volume marker: %+v", n.session(st.Session))
	}
	v.State = raw
	if h := n.s.Health(ctx, v); h.Abnormal {
		t.Fatalf("health after Adopt: %+v", h)
	}

	if err := n.s.Unstage(ctx, v); err != nil {
		t.Fatal(err)
	}
	want = [][]string{{"-m", "session", "-r", strconv.Itoa(st.SID), "--logout"}, {"-m", "node", "-o", "delete", "-T", fakeIQN, "-p", fakePortal}}
	if calls := n.Calls(); !slices.EqualFunc(calls, want, slices.Equal) {
		t.Fatalf("unstage's iscsiadm calls %q, want %q", calls, want)
	}
	if keys, _ := n.s.getHost().SharedKeys(sharedKind); len(keys) != 0 {
		t.Fatalf("session records left: %v", keys)
	}
	if recs, _ := filepath.Glob(filepath.Join(n.records, "iscsi", "*")); len(recs) != 0 || n.Record() != "" {
		t.Fatalf("the mounter's records %v or the node record %q left", recs, n.Record())
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
	os.RemoveAll(filepath.Join(n.NodeDBDir, fakeIQN))
	n.Calls()
	_, err := n.s.Adopt(context.Background(), v)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "node record") || !strings.Contains(err.Error(), "stage it again") {
		t.Fatalf("Adopt with the record gone = %v, want FailedPrecondition about the node record", err)
	}
	if calls := n.Calls(); len(calls) != 0 {
		t.Fatalf("iscsiadm called: %q", calls)
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
	n.FailLogins(8)
	if _, err := n.s.Adopt(context.Background(), v); err == nil {
		t.Fatal("Adopt with a failing login succeeded")
	}
	if _, err := os.Stat(filepath.Join(n.recordDir(), "default")); err != nil {
		t.Fatalf("node record gone after a failed re-login: %v", err)
	}
	if !slices.Contains(n.session(st.Session).Users, "v1") {
		t.Fatalf("volume marker gone after a failed re-login: %+v", n.session(st.Session))
	}
	n.FailLogins(0)
	raw, err := n.s.Adopt(context.Background(), v)
	if err != nil {
		t.Fatalf("Adopt once login works: %v", err)
	}
	if own := n.owner(st.Session); own == nil || own.SID != stateOf(t, raw).SID {
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
	n.Calls()
	rawA, err := n.s.Adopt(context.Background(), a)
	if err != nil {
		t.Fatal(err)
	}
	rawB, err := n.s.Adopt(context.Background(), b)
	if err != nil {
		t.Fatal(err)
	}
	if calls := n.Calls(); len(calls) != 1 {
		t.Fatalf("iscsiadm calls %q, want one login", calls)
	}
	if stateOf(t, rawA).SID != stateOf(t, rawB).SID {
		t.Fatalf("volumes on different sessions after Adopt: %s %s", rawA, rawB)
	}
}
