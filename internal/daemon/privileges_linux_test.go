package daemon

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/testenv"
)

// spawnSleeper starts sleep 30 with c's user and capabilities and kills it
// at the end of the test.
func spawnSleeper(t *testing.T, c Command) Proc {
	t.Helper()
	c.Path, c.Args, c.Log = "/bin/sleep", []string{"30"}, filepath.Join(t.TempDir(), "daemon.log")
	p, err := LocalSpawner{}.Spawn(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(p.PID, syscall.SIGKILL)
		for i := 0; i < 500 && p.Alive(); i++ {
			time.Sleep(10 * time.Millisecond)
		}
	})
	// The exec may not have happened yet: wait for sleep itself.
	for i := 0; i < 500; i++ {
		if b, _ := os.ReadFile("/proc/" + strconv.Itoa(p.PID) + "/comm"); strings.TrimSpace(string(b)) == "sleep" {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	return p
}

// TestDaemonPrivileges (review finding 6c, ported from
// TestHostileOld_6c_DaemonPrivileges): every daemon runs with no_new_privs,
// its bounding and effective sets hold nothing beyond its command's
// capabilities, nothing is inheritable, and a daemon of another user gets
// its capabilities as ambient ones and no supplementary group.
func TestDaemonPrivileges(t *testing.T) {
	testenv.RequireRoot(t)
	sysAdmin := CapabilityMask([]string{"SYS_ADMIN"})
	tests := []struct {
		name     string
		c        Command
		uid      string
		eff, amb uint64
		wantCaps []string
		noGroups bool
	}{
		{name: "no capabilities", c: Command{}, uid: "0", eff: 0, amb: 0},
		{name: "root with SYS_ADMIN", c: Command{Capabilities: []string{"SYS_ADMIN"}}, uid: "0", eff: sysAdmin, amb: 0},
		{name: "root with two", c: Command{Capabilities: []string{"DAC_READ_SEARCH", "SYS_ADMIN"}}, uid: "0",
			eff: CapabilityMask([]string{"DAC_READ_SEARCH", "SYS_ADMIN"})},
		{name: "another user with SYS_ADMIN", c: Command{RunAs: &User{UID: 65534, GID: 65534}, Capabilities: []string{"SYS_ADMIN"}},
			uid: "65534", eff: sysAdmin, amb: sysAdmin, noGroups: true},
		{name: "another user with none", c: Command{RunAs: &User{UID: 65534, GID: 65534}}, uid: "65534", noGroups: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := spawnSleeper(t, tt.c)
			st := mountnstest.ProcStatus(t, p.PID)
			if st["NoNewPrivs"] != "1" {
				t.Errorf("NoNewPrivs %q, want 1", st["NoNewPrivs"])
			}
			if uid := strings.Fields(st["Uid"]); len(uid) == 0 || uid[0] != tt.uid {
				t.Errorf("Uid %q, want %s", st["Uid"], tt.uid)
			}
			allowed := CapabilityMask(tt.c.Capabilities)
			for _, f := range []string{"CapEff", "CapPrm", "CapBnd"} {
				if got := mountnstest.CapSet(t, st, f); got&^allowed != 0 {
					t.Errorf("%s %016x holds capabilities beyond %v (%016x)", f, got, tt.c.Capabilities, allowed)
				}
			}
			if got := mountnstest.CapSet(t, st, "CapEff"); got != tt.eff {
				t.Errorf("CapEff %016x, want %016x", got, tt.eff)
			}
			if got := mountnstest.CapSet(t, st, "CapInh"); got&^tt.amb != 0 {
				t.Errorf("CapInh %016x, want at most %016x", got, tt.amb)
			}
			if got := mountnstest.CapSet(t, st, "CapAmb"); got != tt.amb {
				t.Errorf("CapAmb %016x, want %016x", got, tt.amb)
			}
			if tt.noGroups && st["Groups"] != "" {
				t.Errorf("Groups %q, want none", st["Groups"])
			}
		})
	}
	// The spawning process keeps what it had: only the daemon's thread
	// was restricted.
	self := mountnstest.ProcStatus(t, os.Getpid())
	if self["NoNewPrivs"] != "0" || mountnstest.CapSet(t, self, "CapBnd")&sysAdmin == 0 {
		t.Errorf("the spawner lost its own privileges: NoNewPrivs %s CapBnd %s", self["NoNewPrivs"], self["CapBnd"])
	}
}

func TestParseCapabilities(t *testing.T) {
	got, err := ParseCapabilities([]string{"cap_sys_admin", "DAC_READ_SEARCH", "SYS_ADMIN"})
	if err != nil || strings.Join(got, ",") != "DAC_READ_SEARCH,SYS_ADMIN" {
		t.Errorf("ParseCapabilities = %v, %v", got, err)
	}
	if _, err := ParseCapabilities([]string{"ALL"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("ParseCapabilities(ALL) = %v, want InvalidArgument", err)
	}
	if CapabilityMask([]string{"SYS_ADMIN"}) != 1<<21 || CapabilityMask([]string{"CHECKPOINT_RESTORE"}) != 1<<40 {
		t.Error("CapabilityMask does not follow linux/capability.h")
	}
}

// TestSpawnHostilePaths (review finding 5b, ported from
// TestHostileOld_5b_LogRotationEscapes): a daemon's log and standard input
// are opened, and a big log rotated, without following a symlink anywhere
// in their paths: a directory replaced by a symlink to one outside (the
// plugin writes below the state dir) fails the spawn with
// PermissionDenied, and the file of the log's name there, big enough to be
// rotated, stays as it was, alone.
func TestSpawnHostilePaths(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	hostLog := filepath.Join(outside, "daemon.log")
	content := bytes.Repeat([]byte("host's own file\n"), MaxLog/16+1)
	if err := os.WriteFile(hostLog, content, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("host's secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	vol := filepath.Join(root, "fuse", "vol")
	if err := os.MkdirAll(vol, 0o700); err != nil {
		t.Fatal(err)
	}
	linkedDir := filepath.Join(vol, "logs")
	if err := os.Symlink(outside, linkedDir); err != nil {
		t.Fatal(err)
	}
	linkedVol := filepath.Join(root, "fuse", "linked")
	if err := os.Symlink(outside, linkedVol); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(hostLog, filepath.Join(vol, "daemon.log")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(vol, "fifo.log"), 0o600); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(t.TempDir(), "daemon.log")
	tests := []struct {
		name string
		c    Command
		want error
	}{
		{"log below a symlinked directory", Command{Log: filepath.Join(linkedDir, "daemon.log")}, errdefs.ErrPermissionDenied},
		{"log below a symlinked volume directory", Command{Log: filepath.Join(linkedVol, "daemon.log")}, errdefs.ErrPermissionDenied},
		{"log a symlink", Command{Log: filepath.Join(vol, "daemon.log")}, errdefs.ErrPermissionDenied},
		{"log a FIFO", Command{Log: filepath.Join(vol, "fifo.log")}, errdefs.ErrPermissionDenied},
		{"stdin below a symlinked directory", Command{Log: good, Stdin: filepath.Join(linkedDir, "secret")}, errdefs.ErrPermissionDenied},
		{"relative log", Command{Log: "daemon.log"}, errdefs.ErrInvalidArgument},
		{"unknown capability", Command{Log: good, Capabilities: []string{"ALL"}}, errdefs.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.c.Path, tt.c.Args = "/bin/sh", []string{"-c", "echo daemon output; exec sleep 30"}
			p, err := LocalSpawner{}.Spawn(context.Background(), tt.c)
			if err == nil {
				_ = syscall.Kill(p.PID, syscall.SIGKILL)
			}
			if !errors.Is(err, tt.want) {
				t.Errorf("Spawn = %v, want %v", err, tt.want)
			}
		})
	}
	got, err := os.ReadFile(hostLog)
	ents, _ := os.ReadDir(outside)
	if err != nil || !bytes.Equal(got, content) || len(ents) != 2 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("the host's file outside now reads %d bytes (%v, was %d) and its directory holds %q, want daemon.log and secret, untouched",
			len(got), err, len(content), names)
	}
}

// A big log is rotated once, in its own directory.
func TestLogRotation(t *testing.T) {
	dir := t.TempDir()
	log := filepath.Join(dir, "daemon.log")
	if err := os.WriteFile(log, bytes.Repeat([]byte("x"), MaxLog+1), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := OpenLog(log)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if fi, err := os.Stat(log + ".1"); err != nil || fi.Size() != MaxLog+1 {
		t.Errorf("rotated log: %v %v", fi, err)
	}
	if fi, err := os.Stat(log); err != nil || fi.Size() != 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("new log: %v %v", fi, err)
	}
}

func TestRedactor(t *testing.T) {
	key := "-----BEGIN KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmU\nAAAAC3NzaC1lZDI1NTE5AAAAIGJ3\n-----END KEY-----\n"
	r := RedactorOf([]string{key, "hunter2!"})
	in := "ssh: bad key b3BlbnNzaC1rZXktdjEAAAAABG5vbmU; password hunter2! rejected\n" + key
	out := r.Apply(in)
	for _, s := range []string{"b3BlbnNzaC1rZXktdjEAAAAABG5vbmU", "AAAAC3NzaC1lZDI1NTE5AAAAIGJ3", "hunter2!"} {
		if strings.Contains(out, s) {
			t.Errorf("%q survived redaction: %q", s, out)
		}
	}
	if !strings.Contains(out, "ssh: bad key [redacted]") {
		t.Errorf("redaction changed the rest: %q", out)
	}
	dir := t.TempDir()
	log := filepath.Join(dir, "daemon.log")
	body := strings.Repeat("noise line\n", 1000) + "fatal: password hunter2! rejected\x1b[0m\n"
	if err := os.WriteFile(log, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	tail := LogTail(log, 200, r)
	if strings.Contains(tail, "hunter2") || !strings.HasSuffix(tail, "fatal: password [redacted] rejected?[0m") || len(tail) > 200 {
		t.Errorf("tail %q", tail)
	}
	// Not through a symlink.
	link := filepath.Join(dir, "link.log")
	if err := os.Symlink(log, link); err != nil {
		t.Fatal(err)
	}
	if tail := LogTail(link, 200, r); tail != "" {
		t.Errorf("LogTail followed a symlink: %q", tail)
	}
}

// Terminate ends a daemon's whole session: SIGTERM first, and SIGKILL for
// what ignores it.
func TestTerminate(t *testing.T) {
	p, err := LocalSpawner{}.Spawn(context.Background(), Command{Path: "/bin/sh",
		Args: []string{"-c", "trap '' TERM; sleep 30 & sleep 30 & wait"}, Log: filepath.Join(t.TempDir(), "log")})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	exited, stop := WatchExit(p)
	defer stop()
	start := time.Now()
	if err := Terminate(context.Background(), p, 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if SessionAlive(p) {
		t.Error("the session lives on after Terminate")
	}
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
		t.Error("WatchExit did not see the exit")
	}
	t.Logf("terminated in %v", time.Since(start).Round(time.Millisecond))
	if err := Wait(context.Background(), p); err != nil {
		t.Errorf("Wait of a gone daemon: %v", err)
	}
}
