package mounter_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source/iscsi/iscsitest"
)

// The mounter's iSCSI side against a fake node (iscsitest.FakeNode: a
// sysfs tree, node records and an iscsiadm that logs in there).

const canary, canaryIn = "canary-pw-3f9a", "canary-in-77c1"

// iscsiNode is a mounter over records (a new dir when ""), its iSCSI work
// on f.
func iscsiNode(t *testing.T, f *iscsitest.FakeNode, records string, observe bool) *mounter.Local {
	t.Helper()
	state := t.TempDir()
	if records == "" {
		records = filepath.Join(t.TempDir(), "records")
	}
	cfg := &config.Config{ISCSI: config.ISCSIConfig{AllowedPortals: []string{"127.0.0.1:*"}, NodeDBDir: f.NodeDBDir}}
	n, err := mounter.NewNode(context.Background(), mounter.Options{StateDir: state, RecordsDir: records, Config: cfg, Observe: observe})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	n.SetISCSITestHooks(f.SysDir, f.Exec)
	return n
}

func login(c *mounter.CHAP) mounter.ISCSILogin {
	return mounter.ISCSILogin{IQN: iscsitest.FakeIQN, Portal: iscsitest.FakePortal, TPGT: 1, LUN: iscsitest.FakeLUN, CHAP: c}
}

var logoutReq = mounter.ISCSILogout{IQN: iscsitest.FakeIQN, Portal: iscsitest.FakePortal}

func chap() *mounter.CHAP { return &mounter.CHAP{User: "alice", Password: canary} }

// noSecrets fails when the secret shows in what the mounter left: its
// records, the calls' argv, an error.
func noSecrets(t *testing.T, what string, texts ...string) {
	t.Helper()
	for _, s := range texts {
		if strings.Contains(s, canary) || strings.Contains(s, canaryIn) {
			t.Fatalf("%s shows a CHAP password: %s", what, s)
		}
	}
}

func recordFiles(t *testing.T, records string) map[string]string {
	t.Helper()
	out := map[string]string{}
	files, _ := filepath.Glob(filepath.Join(records, "iscsi", "*"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out[filepath.Base(f)] = string(b)
	}
	return out
}

func argv(calls [][]string) string {
	var b strings.Builder
	for _, c := range calls {
		b.WriteString(strings.Join(c, " ") + "\n")
	}
	return b.String()
}

func wantErr(t *testing.T, what string, err, sentinel error) {
	t.Helper()
	if !errors.Is(err, sentinel) {
		t.Fatalf("%s = %v, want %v", what, err, sentinel)
	}
	noSecrets(t, what+"'s error", err.Error())
}

// TestISCSIJoinRules: a login writes the CHAP fields into a 0600 node
// record (never argv) and records a salted hash (never the secret); the
// session is joined with the same credentials, without a login, and
// refused with other ones or none, the node record untouched; logout ends
// it and deletes the node record the mounter created.
func TestISCSIJoinRules(t *testing.T) {
	f := iscsitest.NewFakeNode(t)
	f.RequireCHAP("alice", canary)
	records := filepath.Join(t.TempDir(), "records")
	n := iscsiNode(t, f, records, false)
	ctx := context.Background()

	s, err := n.LoginISCSI(ctx, login(chap()))
	if err != nil || s.SID == 0 || s.Joined {
		t.Fatalf("first login = %+v, %v", s, err)
	}
	calls := f.Calls()
	want := [][]string{{"-m", "node", "-o", "new", "-T", iscsitest.FakeIQN, "-p", iscsitest.FakePortal + ",1"},
		{"-m", "node", "-T", iscsitest.FakeIQN, "-p", iscsitest.FakePortal, "--login"}}
	if !slices.EqualFunc(calls, want, slices.Equal) {
		t.Fatalf("iscsiadm calls %q, want %q", calls, want)
	}
	rec := f.Record()
	if !strings.Contains(rec, "node.session.auth.password = "+canary+"\n") {
		t.Fatalf("node record without the CHAP fields:\n%s", rec)
	}
	if fi, err := os.Stat(filepath.Join(f.RecordDir(), "default")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("node record mode: %v, %v", fi, err)
	}
	recs := recordFiles(t, records)
	if len(recs) != 1 {
		t.Fatalf("records %v, want one", recs)
	}
	for _, r := range recs {
		noSecrets(t, "the mounter's record", r)
		for _, field := range []string{`"fingerprint":"`, `"salt":"`, `"sid":` + strconv.Itoa(s.SID), `"createdRecord":true`, `"boot":"`} {
			if !strings.Contains(r, field) {
				t.Fatalf("record %s lacks %s", r, field)
			}
		}
	}

	for name, c := range map[string]*mounter.CHAP{"same credentials": chap(), "nil (a staged volume's re-login)": nil} {
		j, err := n.LoginISCSI(ctx, login(c))
		if err != nil || j.SID != s.SID || !j.Joined {
			t.Fatalf("join with %s = %+v, %v; want session %d joined", name, j, err, s.SID)
		}
	}
	for name, c := range map[string]*mounter.CHAP{
		"no credentials":     {},
		"wrong password":     {User: "alice", Password: canary + "x"},
		"other user":         {User: "mallory", Password: canary},
		"mutual CHAP added":  {User: "alice", Password: canary, UserIn: "tgt", PasswordIn: canaryIn},
		"password as a user": {User: canary, Password: "alice"},
	} {
		_, err := n.LoginISCSI(ctx, login(c))
		wantErr(t, "join with "+name, err, errdefs.ErrPermissionDenied)
	}
	if calls := f.Calls(); len(calls) != 0 {
		t.Fatalf("joins and refusals ran iscsiadm: %q", calls)
	}
	if f.Record() != rec {
		t.Fatalf("a refused join changed the node record:\n%s", f.Record())
	}
	if !n.OwnsISCSI(8, 0) {
		t.Fatal("the session's disk is not accepted")
	}

	if err := n.LogoutISCSI(ctx, mounter.ISCSILogout{IQN: iscsitest.FakeIQN, Portal: iscsitest.FakePortal, SID: s.SID}); err != nil {
		t.Fatal(err)
	}
	want = [][]string{{"-m", "session", "-r", strconv.Itoa(s.SID), "--logout"}, {"-m", "node", "-o", "delete", "-T", iscsitest.FakeIQN, "-p", iscsitest.FakePortal}}
	if calls := f.Calls(); !slices.EqualFunc(calls, want, slices.Equal) {
		t.Fatalf("logout's iscsiadm calls %q, want %q", calls, want)
	}
	if len(f.Sessions()) != 0 || f.Record() != "" || len(recordFiles(t, records)) != 0 {
		t.Fatalf("left after logout: sessions %v, node record %q, records %v", f.Sessions(), f.Record(), recordFiles(t, records))
	}
	if n.OwnsISCSI(8, 0) {
		t.Fatal("a disk is accepted after the logout")
	}
	if err := n.LogoutISCSI(ctx, logoutReq); err != nil || len(f.Calls()) != 0 {
		t.Fatalf("second logout: %v", err)
	}
	// Nothing recorded: other credentials make a new session.
	f.RequireCHAP("bob", canary+"b")
	if s, err := n.LoginISCSI(ctx, login(&mounter.CHAP{User: "bob", Password: canary + "b"})); err != nil || s.Joined {
		t.Fatalf("login with other credentials once the session ended: %+v, %v", s, err)
	}
	noSecrets(t, "iscsiadm's argv", argv(f.Calls()))
}

// TestISCSIForeignSession (finding 4): a session to the target and portal
// the mounter did not log in is never joined, with or without
// credentials, nor logged out, and its disks are not the mounter's.
func TestISCSIForeignSession(t *testing.T) {
	f := iscsitest.NewFakeNode(t)
	records := filepath.Join(t.TempDir(), "records")
	n := iscsiNode(t, f, records, false)
	ctx := context.Background()
	sid := f.AddSession()
	for name, c := range map[string]*mounter.CHAP{"credentials": chap(), "none": {}, "nil": nil} {
		_, err := n.LoginISCSI(ctx, login(c))
		wantErr(t, "login with "+name+" while a foreign session exists", err, errdefs.ErrFailedPrecondition)
	}
	if err := n.LogoutISCSI(ctx, mounter.ISCSILogout{IQN: iscsitest.FakeIQN, Portal: iscsitest.FakePortal, SID: sid}); err != nil {
		t.Fatal(err)
	}
	if calls := f.Calls(); len(calls) != 0 {
		t.Fatalf("iscsiadm calls %q, want none", calls)
	}
	if !slices.Equal(f.Sessions(), []int{sid}) || len(recordFiles(t, records)) != 0 || f.Record() != "" {
		t.Fatalf("sessions %v, records %v, node record %q", f.Sessions(), recordFiles(t, records), f.Record())
	}
	if n.OwnsISCSI(8, 0) {
		t.Fatal("the foreign session's disk is accepted")
	}

	// The mounter's session ended behind its back and someone else logged
	// in: that session is not the mounter's either.
	f.DropSession(sid)
	s, err := n.LoginISCSI(ctx, login(chap()))
	if err != nil {
		t.Fatal(err)
	}
	f.DropSession(s.SID)
	other := f.AddSession()
	_, err = n.LoginISCSI(ctx, login(chap()))
	wantErr(t, "login with the mounter's session replaced", err, errdefs.ErrFailedPrecondition)
	_, err = n.LoginISCSI(ctx, login(nil))
	wantErr(t, "re-login with the mounter's session replaced", err, errdefs.ErrFailedPrecondition)
	f.Calls()
	if err := n.LogoutISCSI(ctx, logoutReq); err != nil {
		t.Fatal(err)
	}
	for _, c := range f.Calls() {
		if slices.Contains(c, "--logout") {
			t.Fatalf("logout ended a session the mounter did not make: %q", c)
		}
	}
	if !slices.Equal(f.Sessions(), []int{other}) || n.OwnsISCSI(8, 16) {
		t.Fatalf("sessions %v (want %d), its disk accepted: %v", f.Sessions(), other, n.OwnsISCSI(8, 16))
	}
}

// TestISCSILoginFailureLeavesNothing: a refused or failed login removes
// the node record and the record it made, and shows no password; one of
// a session recorded before keeps both for the volumes that use it.
func TestISCSILoginFailureLeavesNothing(t *testing.T) {
	f := iscsitest.NewFakeNode(t)
	f.RequireCHAP("alice", canary)
	records := filepath.Join(t.TempDir(), "records")
	n := iscsiNode(t, f, records, false)
	ctx := context.Background()
	_, err := n.LoginISCSI(ctx, login(&mounter.CHAP{User: "alice", Password: canaryIn}))
	// The fake iscsiadm prints the target's password field: redacted too.
	wantErr(t, "login with a wrong password", err, errdefs.ErrPermissionDenied)
	f.FailLogins(8)
	_, err = n.LoginISCSI(ctx, login(chap()))
	wantErr(t, "login with the portal timing out", err, errdefs.ErrUnavailable)
	calls := f.Calls()
	noSecrets(t, "iscsiadm's argv", argv(calls))
	if n := len(calls); n != 6 || !slices.Contains(calls[2], "delete") || !slices.Contains(calls[5], "delete") {
		t.Fatalf("calls %q, want new, login, delete twice", calls)
	}
	if len(f.Sessions()) != 0 || f.Record() != "" || len(recordFiles(t, records)) != 0 {
		t.Fatalf("left: sessions %v, node record %q, records %v", f.Sessions(), f.Record(), recordFiles(t, records))
	}

	f.FailLogins(0)
	s, err := n.LoginISCSI(ctx, login(chap()))
	if err != nil {
		t.Fatal(err)
	}
	before, rec := recordFiles(t, records), f.Record()
	f.DropSession(s.SID)
	f.FailLogins(8)
	_, err = n.LoginISCSI(ctx, login(chap()))
	wantErr(t, "login again with the portal timing out", err, errdefs.ErrUnavailable)
	_, err = n.LoginISCSI(ctx, login(nil))
	wantErr(t, "re-login with the portal timing out", err, errdefs.ErrUnavailable)
	if f.Record() != rec || len(recordFiles(t, records)) != 1 {
		t.Fatalf("a failed login of a recorded session dropped its records: %v (before %v)", recordFiles(t, records), before)
	}
	f.FailLogins(0)
	f.Calls()
	s2, err := n.LoginISCSI(ctx, login(nil))
	if err != nil || s2.Joined || s2.SID == s.SID {
		t.Fatalf("re-login: %+v, %v", s2, err)
	}
	if calls := f.Calls(); len(calls) != 1 || !slices.Contains(calls[0], "--login") {
		t.Fatalf("re-login from the node record: calls %q, want the login alone", calls)
	}
	if f.Record() != rec {
		t.Fatal("the re-login rewrote the node record")
	}
}

// TestISCSIReloginNeedsRecords: a re-login (no credentials) needs the
// mounter's record and the node record it wrote.
func TestISCSIReloginNeedsRecords(t *testing.T) {
	f := iscsitest.NewFakeNode(t)
	n := iscsiNode(t, f, "", false)
	ctx := context.Background()
	_, err := n.LoginISCSI(ctx, login(nil))
	wantErr(t, "re-login with nothing recorded", err, errdefs.ErrFailedPrecondition)
	// A node record the mounter did not write is not logged in from.
	if err := os.MkdirAll(f.RecordDir(), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(f.RecordDir(), "default"), []byte("node.session.auth.authmethod = CHAP\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = n.LoginISCSI(ctx, login(nil))
	wantErr(t, "re-login from the admin's node record", err, errdefs.ErrFailedPrecondition)
	os.RemoveAll(filepath.Join(f.NodeDBDir, iscsitest.FakeIQN))

	s, err := n.LoginISCSI(ctx, login(chap()))
	if err != nil {
		t.Fatal(err)
	}
	f.DropSession(s.SID)
	os.RemoveAll(filepath.Join(f.NodeDBDir, iscsitest.FakeIQN))
	f.Calls()
	_, err = n.LoginISCSI(ctx, login(nil))
	wantErr(t, "re-login with the node record gone", err, errdefs.ErrFailedPrecondition)
	if !strings.Contains(err.Error(), "node record") || !strings.Contains(err.Error(), "stage it again") {
		t.Fatalf("error %v does not say the node record is gone", err)
	}
	if calls := f.Calls(); len(calls) != 0 {
		t.Fatalf("iscsiadm calls %q", calls)
	}
}

// TestISCSIRecordsAcrossRestarts: a restarted mounter joins its session
// with the same credentials only; after a reboot (a record of another
// boot) no session is its own until it logs in again, and that SID's
// disks are not accepted.
func TestISCSIRecordsAcrossRestarts(t *testing.T) {
	f := iscsitest.NewFakeNode(t)
	records := filepath.Join(t.TempDir(), "records")
	n := iscsiNode(t, f, records, false)
	ctx := context.Background()
	s, err := n.LoginISCSI(ctx, login(chap()))
	if err != nil {
		t.Fatal(err)
	}
	n.Close()
	n = iscsiNode(t, f, records, false)
	if j, err := n.LoginISCSI(ctx, login(chap())); err != nil || !j.Joined || j.SID != s.SID {
		t.Fatalf("join after a restart: %+v, %v", j, err)
	}
	_, err = n.LoginISCSI(ctx, login(&mounter.CHAP{}))
	wantErr(t, "join without credentials after a restart", err, errdefs.ErrPermissionDenied)
	if !n.OwnsISCSI(8, 0) {
		t.Fatal("the session's disk is not accepted after a restart")
	}
	obs := iscsiNode(t, f, records, true)
	if !obs.OwnsISCSI(8, 0) {
		t.Fatal("an observing node does not accept the session's disk")
	}
	_, err = obs.LoginISCSI(ctx, login(chap()))
	wantErr(t, "login on an observing node", err, errdefs.ErrFailedPrecondition)
	if err := obs.LogoutISCSI(ctx, logoutReq); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("logout on an observing node = %v", err)
	}

	// Another boot: the record keeps the credentials' hash, not the SID.
	n.Close()
	for name, r := range recordFiles(t, records) {
		r = strings.Replace(r, `"boot":"`, `"boot":"another-`, 1)
		if err := os.WriteFile(filepath.Join(records, "iscsi", name), []byte(r), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if obs := iscsiNode(t, f, records, true); obs.OwnsISCSI(8, 0) {
		t.Fatal("an observing node accepts the disk of a session of another boot")
	}
	n = iscsiNode(t, f, records, false)
	if n.OwnsISCSI(8, 0) {
		t.Fatal("the disk of a session of another boot is accepted")
	}
	_, err = n.LoginISCSI(ctx, login(chap()))
	wantErr(t, "join of a session of another boot", err, errdefs.ErrFailedPrecondition)
	f.DropSession(s.SID) // as the reboot did
	f.Calls()
	_, err = n.LoginISCSI(ctx, login(&mounter.CHAP{User: "mallory", Password: "x"}))
	wantErr(t, "login with other credentials after a reboot", err, errdefs.ErrPermissionDenied)
	s2, err := n.LoginISCSI(ctx, login(nil))
	if err != nil || s2.Joined {
		t.Fatalf("re-login after a reboot: %+v, %v", s2, err)
	}
	if calls := f.Calls(); len(calls) != 1 {
		t.Fatalf("calls %q, want the login alone", calls)
	}
	if !n.OwnsISCSI(8, 16) {
		t.Fatal("the new session's disk is not accepted")
	}
}

// TestOwnsISCSI: only a whole disk whose sysfs path runs through a
// recorded session of this boot, still to the recorded target.
func TestOwnsISCSI(t *testing.T) {
	f := iscsitest.NewFakeNode(t)
	n := iscsiNode(t, f, "", false)
	ctx := context.Background()
	s, err := n.LoginISCSI(ctx, login(chap()))
	if err != nil {
		t.Fatal(err)
	}
	f.AddSessionTo("iqn.2024-01.io.mountplan.test:other") // sdb, 8:16
	// A partition of the session's disk: 8:1.
	disk, err := filepath.EvalSymlinks(f.Sys("dev", "block", "8:0"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(disk, "sda1"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(disk, "sda1"), f.Sys("dev", "block", "8:1")); err != nil {
		t.Fatal(err)
	}
	// A disk that is no iSCSI session's: 8:32.
	if err := os.MkdirAll(f.Sys("devices", "pci0000:00", "host0", "target0:0:0", "0:0:0:0", "block", "sdc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(f.Sys("devices", "pci0000:00", "host0", "target0:0:0", "0:0:0:0", "block", "sdc"), f.Sys("dev", "block", "8:32")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name         string
		major, minor uint32
		want         bool
	}{
		{"the session's disk", 8, 0, true},
		{"a partition of it", 8, 1, false},
		{"a disk of another target's session", 8, 16, false},
		{"a disk of no session", 8, 32, false},
		{"no such device", 8, 48, false},
	} {
		if got := n.OwnsISCSI(tc.major, tc.minor); got != tc.want {
			t.Errorf("%s (%d:%d): %v, want %v", tc.name, tc.major, tc.minor, got, tc.want)
		}
	}
	// The session's SID now shows another target: not the mounter's.
	tn := f.Sys("class", "iscsi_session", "session"+strconv.Itoa(s.SID), "targetname")
	if err := os.WriteFile(tn, []byte("iqn.2024-01.io.mountplan.test:other\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if n.OwnsISCSI(8, 0) {
		t.Fatal("a disk of a session that shows another target is accepted")
	}
}

// TestISCSIRequestChecks: malformed requests and portals the mounter's
// config does not allow run nothing.
func TestISCSIRequestChecks(t *testing.T) {
	f := iscsitest.NewFakeNode(t)
	n := iscsiNode(t, f, "", false)
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		l    mounter.ISCSILogin
		want error
	}{
		{"portal not allowed", mounter.ISCSILogin{IQN: iscsitest.FakeIQN, Portal: "192.0.2.1:3260", CHAP: chap()}, errdefs.ErrPermissionDenied},
		{"portal without a port", mounter.ISCSILogin{IQN: iscsitest.FakeIQN, Portal: "127.0.0.1", CHAP: chap()}, errdefs.ErrInvalidArgument},
		{"not an IQN", mounter.ISCSILogin{IQN: "disk; rm -rf /", Portal: iscsitest.FakePortal, CHAP: chap()}, errdefs.ErrInvalidArgument},
		{"LUN out of range", mounter.ISCSILogin{IQN: iscsitest.FakeIQN, Portal: iscsitest.FakePortal, LUN: 1 << 20, CHAP: chap()}, errdefs.ErrInvalidArgument},
		{"a line break in the password", login(&mounter.CHAP{User: "alice", Password: canary + "\nnode.startup = automatic"}), errdefs.ErrInvalidArgument},
		{"a user without a password", login(&mounter.CHAP{User: "alice"}), errdefs.ErrInvalidArgument},
		{"mutual CHAP without one-way", login(&mounter.CHAP{UserIn: "tgt", PasswordIn: canaryIn}), errdefs.ErrInvalidArgument},
	} {
		_, err := n.LoginISCSI(ctx, tc.l)
		wantErr(t, tc.name, err, tc.want)
	}
	if calls := f.Calls(); len(calls) != 0 || f.Record() != "" {
		t.Fatalf("iscsiadm calls %q, node record %q", calls, f.Record())
	}
}

// TestWriteAuth: the CHAP fields replace the record's own, the file stays
// 0600 and no temp file is left.
func TestWriteAuth(t *testing.T) {
	dir := t.TempDir()
	rec := filepath.Join(dir, "default")
	orig := "node.name = iqn.x:y\nnode.session.auth.authmethod = None\nnode.session.auth.chap_algs = MD5\nnode.session.auth.password = old\nnode.conn[0].port = 3260\n"
	if err := os.WriteFile(rec, []byte(orig), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := mounter.WriteAuth(rec, mounter.CHAP{User: "alice", Password: "s3cret", UserIn: "tgt", PasswordIn: "back"}); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(rec)
	got := string(b)
	for _, want := range []string{"node.name = iqn.x:y\n", "chap_algs = MD5\n", "node.conn[0].port = 3260\n",
		"node.session.auth.authmethod = CHAP\n", "node.session.auth.username = alice\n", "node.session.auth.password = s3cret\n",
		"node.session.auth.username_in = tgt\n", "node.session.auth.password_in = back\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("record lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "= old") || strings.Count(got, "authmethod") != 1 {
		t.Errorf("old auth fields kept:\n%s", got)
	}
	if fi, _ := os.Stat(rec); fi.Mode().Perm() != 0o600 {
		t.Errorf("record mode %v, want 0600", fi.Mode().Perm())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("temp files left: %v", ents)
	}
	if err := mounter.WriteAuth(rec, mounter.CHAP{}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(rec); strings.Contains(string(b), "s3cret") || !strings.Contains(string(b), "authmethod = None") {
		t.Errorf("clearing auth left:\n%s", b)
	}
	if s := (mounter.CHAP{User: "alice", Password: canary}); strings.Contains(fmtAll(s), canary) {
		t.Error("CHAP prints its password")
	}
}

func fmtAll(v any) string { return fmt.Sprintf("%v %+v %#v %s", v, v, v, v) }
