package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestProcIdentity(t *testing.T) {
	self, err := Identify(os.Getpid())
	if err != nil || !self.Alive() {
		t.Fatalf("self %+v %v", self, err)
	}
	if (Proc{PID: self.PID, StartTime: self.StartTime + 1}).Alive() {
		t.Error("a PID with another start time counts as alive")
	}
	if (Proc{}).Alive() {
		t.Error("the zero Proc counts as alive")
	}
}

// TestLocalSpawner starts a shell that reports what it got: its own
// session, / as its directory, the given environment and standard input,
// and no descriptor besides 0, 1 and 2.
func TestLocalSpawner(t *testing.T) {
	dir := t.TempDir()
	in, log := filepath.Join(dir, "in"), filepath.Join(dir, "daemon.log")
	if err := os.WriteFile(in, []byte("from stdin\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// An inheritable-looking descriptor of this process must not leak.
	f, err := os.Open(in)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	script := `echo "env=$GREETING"; echo "pwd=$(pwd)"; cat; echo done`
	p, err := LocalSpawner{}.Spawn(context.Background(), Command{Path: "/bin/sh", Args: []string{"-c", script},
		Env: []string{"GREETING=hello", "PATH=/usr/bin:/bin"}, Stdin: in, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	if st, ok := ReadStat(p.PID); ok && st.Session != p.PID {
		t.Errorf("daemon %s runs in session %d, want its own", p, st.Session)
	}
	deadline := time.Now().Add(10 * time.Second)
	var out string
	for {
		b, _ := os.ReadFile(log)
		if out = string(b); strings.Contains(out, "done") || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, want := range []string{"env=hello\n", "pwd=/\n", "from stdin\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("daemon log lacks %q:\n%s", want, out)
		}
	}
	for time.Now().Before(deadline) && p.Alive() {
		time.Sleep(10 * time.Millisecond)
	}
	if p.Alive() {
		t.Errorf("daemon %s still runs", p)
	}

	// A daemon that stays: exactly three descriptors.
	p, err = LocalSpawner{}.Spawn(context.Background(), Command{Path: "/bin/sleep", Args: []string{"30"}, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Kill(p.PID, syscall.SIGKILL) //nolint:errcheck // best effort
	// Right after exec the dynamic loader holds a descriptor for a moment
	// (the library it maps): an inherited one would stay, so wait for the
	// set to settle rather than read it once.
	var fds string
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.PID))
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		if fds = strings.Join(names, " "); fds == "0 1 2" || time.Now().After(deadline) {
			break
		}
	}
	if fds != "0 1 2" {
		t.Errorf("daemon %s holds descriptors %s, want 0 1 2", p, fds)
	}
}

func TestLocalSpawnerErrors(t *testing.T) {
	dir := t.TempDir()
	ctx := context.Background()
	if _, err := (LocalSpawner{}).Spawn(ctx, Command{Path: "/bin/true", Stdin: filepath.Join(dir, "missing"), Log: filepath.Join(dir, "log")}); err == nil {
		t.Error("a missing standard input was accepted")
	}
	if _, err := (LocalSpawner{}).Spawn(ctx, Command{Path: filepath.Join(dir, "no-such-binary"), Log: filepath.Join(dir, "log")}); err == nil {
		t.Error("a missing binary was started")
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := (LocalSpawner{}).Spawn(cancelled, Command{Path: "/bin/true", Log: filepath.Join(dir, "log")}); err == nil {
		t.Error("a cancelled context started a daemon")
	}
}

func TestReadStatSelf(t *testing.T) {
	st, ok := ReadStat(os.Getpid())
	if !ok {
		t.Fatal("ReadStat of this process: not found")
	}
	if st.PPID != os.Getppid() {
		t.Errorf("PPID = %d, want %d", st.PPID, os.Getppid())
	}
	if st.State != 'R' && st.State != 'S' {
		t.Errorf("State = %q, want R or S", st.State)
	}
	if st.StartTime == 0 {
		t.Error("StartTime = 0")
	}
	for start := time.Now(); time.Since(start) < 50*time.Millisecond; {
	}
	if again, _ := ReadStat(os.Getpid()); again.UTime+again.STime == 0 {
		t.Error("no CPU time after 50ms of spinning")
	}
}
