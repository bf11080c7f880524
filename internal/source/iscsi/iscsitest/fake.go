package iscsitest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// FakeNode is a node's iSCSI side without a kernel: a sysfs tree (SysDir),
// a /dev (DevDir) and open-iscsi's node records (NodeDBDir), and an
// iscsiadm (Exec, for mounter.Local.SetISCSITestHooks) that makes and ends
// sessions to one target in them, as the kernel shows a login, and records
// its calls. The target is FakeIQN at FakePortal, TPGT 1, with LUN FakeLUN.
type FakeNode struct {
	t                         testing.TB
	SysDir, DevDir, NodeDBDir string

	mu      sync.Mutex
	calls   [][]string
	nextSID int
	disk    int
	// loginStatus, when set, is the exit status --login fails with.
	loginStatus int
	// chapUser and chapPassword, when set, are what the target accepts: a
	// login from a record with other CHAP fields fails as iscsiadm's does
	// (status 24).
	chapUser, chapPassword string
}

// The fake target.
const (
	FakeIQN    = "iqn.2024-01.io.mountplan.test:disk"
	FakePortal = "127.0.0.1:3260"
	FakeLUN    = 1
)

// NewFakeNode makes the trees in temp dirs, with the iscsi_tcp module
// loaded.
func NewFakeNode(t testing.TB) *FakeNode {
	t.Helper()
	n := &FakeNode{t: t, SysDir: t.TempDir(), DevDir: t.TempDir(), NodeDBDir: t.TempDir(), nextSID: 1}
	if err := os.MkdirAll(n.Sys("module", "iscsi_tcp"), 0o755); err != nil {
		t.Fatal(err)
	}
	return n
}

// RequireCHAP makes the target accept logins with these credentials only.
func (n *FakeNode) RequireCHAP(user, password string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.chapUser, n.chapPassword = user, password
}

// FailLogins makes --login exit with status (0: succeed again).
func (n *FakeNode) FailLogins(status int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.loginStatus = status
}

// Sys is a path below SysDir.
func (n *FakeNode) Sys(parts ...string) string {
	return filepath.Join(append([]string{n.SysDir}, parts...)...)
}

func (n *FakeNode) write(path, content string) {
	n.t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		n.t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content+"\n"), 0o644); err != nil {
		n.t.Fatal(err)
	}
}

// AddSession makes a session to the fake target, as a login outside the
// mounter would, and returns its SID.
func (n *FakeNode) AddSession() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.addSession(FakeIQN)
}

// AddSessionTo makes a session to another target at the same portal.
func (n *FakeNode) AddSessionTo(iqn string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.addSession(iqn)
}

// addSession makes session SID on SCSI host SID+10 with LUN FakeLUN's
// disk sdX, as the kernel shows a login: the session and connection
// classes, the disk below the session's device, /sys/class/block,
// /sys/dev/block and the node in DevDir.
func (n *FakeNode) addSession(iqn string) int {
	n.t.Helper()
	sid, host := n.nextSID, n.nextSID+10
	n.nextSID++
	hostDir := n.Sys("devices", "platform", fmt.Sprintf("host%d", host))
	sessDev := filepath.Join(hostDir, fmt.Sprintf("session%d", sid))
	name := "sd" + string(rune('a'+n.disk))
	devnum := "8:" + strconv.Itoa(16*n.disk)
	n.disk++
	hctl := fmt.Sprintf("%d:0:0:%d", host, FakeLUN)
	block := filepath.Join(sessDev, fmt.Sprintf("target%d:0:0", host), hctl, "block", name)
	n.write(filepath.Join(block, "dev"), devnum)
	sess := n.Sys("class", "iscsi_session", fmt.Sprintf("session%d", sid))
	n.write(filepath.Join(sess, "targetname"), iqn)
	n.write(filepath.Join(sess, "state"), "LOGGED_IN")
	if err := os.Symlink(sessDev, filepath.Join(sess, "device")); err != nil {
		n.t.Fatal(err)
	}
	conn := n.Sys("class", "iscsi_connection", fmt.Sprintf("connection%d:0", sid))
	n.write(filepath.Join(conn, "persistent_address"), "127.0.0.1")
	n.write(filepath.Join(conn, "persistent_port"), "3260")
	n.write(n.Sys("class", "scsi_host", fmt.Sprintf("host%d", host), "scan"), "")
	n.write(n.Sys("class", "block", name, "dev"), devnum)
	if err := os.MkdirAll(n.Sys("dev", "block"), 0o755); err != nil {
		n.t.Fatal(err)
	}
	if err := os.Symlink(block, n.Sys("dev", "block", devnum)); err != nil {
		n.t.Fatal(err)
	}
	n.write(filepath.Join(n.DevDir, name), "")
	return sid
}

// DropSession is a logout behind the mounter's back (or a reboot).
func (n *FakeNode) DropSession(sid int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.dropSession(sid)
}

func (n *FakeNode) dropSession(sid int) {
	sess := n.Sys("class", "iscsi_session", fmt.Sprintf("session%d", sid))
	link, _ := os.Readlink(filepath.Join(sess, "device"))
	blocks, _ := filepath.Glob(filepath.Join(link, "target*", "*", "block", "*"))
	for _, b := range blocks {
		devnum, _ := os.ReadFile(filepath.Join(b, "dev"))
		os.Remove(n.Sys("dev", "block", strings.TrimSpace(string(devnum))))
		os.RemoveAll(n.Sys("class", "block", filepath.Base(b)))
		os.Remove(filepath.Join(n.DevDir, filepath.Base(b)))
	}
	os.RemoveAll(filepath.Dir(link))
	os.RemoveAll(sess)
	os.RemoveAll(n.Sys("class", "iscsi_connection", fmt.Sprintf("connection%d:0", sid)))
}

// Sessions lists the SIDs sysfs shows.
func (n *FakeNode) Sessions() []int {
	dirs, _ := filepath.Glob(n.Sys("class", "iscsi_session", "session*"))
	var out []int
	for _, d := range dirs {
		if sid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), "session")); err == nil {
			out = append(out, sid)
		}
	}
	return out
}

// RecordDir is the fake target's node record directory.
func (n *FakeNode) RecordDir() string {
	return filepath.Join(n.NodeDBDir, FakeIQN, "127.0.0.1,3260,1")
}

// Record is the node record's content ("" when there is none).
func (n *FakeNode) Record() string {
	b, _ := os.ReadFile(filepath.Join(n.RecordDir(), "default"))
	return string(b)
}

// Calls returns the iscsiadm calls so far and forgets them.
func (n *FakeNode) Calls() [][]string {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := n.calls
	n.calls = nil
	return c
}

// Exec is the fake iscsiadm.
func (n *FakeNode) Exec(_ context.Context, name string, args []string) ([]byte, int, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if name != "iscsiadm" {
		n.t.Errorf("unexpected tool %s %q", name, args)
		return nil, 1, nil
	}
	n.calls = append(n.calls, args)
	a := strings.Join(args, " ")
	switch {
	case strings.HasPrefix(a, "-m node -o new -T "+FakeIQN+" -p "+FakePortal+",1"):
		n.write(filepath.Join(n.RecordDir(), "default"), "node.name = "+FakeIQN+"\nnode.session.auth.authmethod = None")
	case a == "-m node -T "+FakeIQN+" -p "+FakePortal+" --login":
		if n.loginStatus != 0 {
			return []byte("iscsiadm: login failed"), n.loginStatus, nil
		}
		rec, err := os.ReadFile(filepath.Join(n.RecordDir(), "default"))
		if err != nil {
			return []byte("iscsiadm: No records found"), 21, nil
		}
		if n.chapUser != "" && (!strings.Contains(string(rec), "node.session.auth.username = "+n.chapUser+"\n") ||
			!strings.Contains(string(rec), "node.session.auth.password = "+n.chapPassword+"\n")) {
			return []byte("iscsiadm: Login failed to authenticate with target\nnode.session.auth.password = " + n.chapPassword), 24, nil
		}
		for _, sid := range n.sessionsLocked() {
			if t, _ := os.ReadFile(n.Sys("class", "iscsi_session", fmt.Sprintf("session%d", sid), "targetname")); strings.TrimSpace(string(t)) == FakeIQN {
				return []byte("iscsiadm: session exists"), 15, nil
			}
		}
		n.addSession(FakeIQN)
	case strings.HasPrefix(a, "-m session -r ") && strings.HasSuffix(a, " --logout"):
		sid, _ := strconv.Atoi(args[3])
		if _, err := os.Stat(n.Sys("class", "iscsi_session", fmt.Sprintf("session%d", sid))); err != nil {
			return []byte("iscsiadm: no session"), 2, nil
		}
		n.dropSession(sid)
	case a == "-m node -o delete -T "+FakeIQN+" -p "+FakePortal:
		if _, err := os.Stat(n.RecordDir()); err != nil {
			return []byte("iscsiadm: No records found"), 21, nil
		}
		os.RemoveAll(filepath.Join(n.NodeDBDir, FakeIQN))
	default:
		n.t.Errorf("unexpected iscsiadm %s", a)
		return nil, 1, nil
	}
	return nil, 0, nil
}

func (n *FakeNode) sessionsLocked() []int { return n.Sessions() }
