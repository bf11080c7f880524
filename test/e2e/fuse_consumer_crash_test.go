package e2e

// What a consumer sees when a FUSE daemon dies (issue 34): the heal
// (TestFuseHealEveryCopy) swaps a fresh mount in where the dead one was, so
// a path opened after the heal works; but a descriptor opened before the
// kill, and a working directory entered before it, belong to the dead
// connection, and no heal can move them. This test measures it, for a
// read-only (squashfuse) and a writable (sshfs) volume, with the daemon
// mounting by itself and in fd mode, inside a container that got the
// volume as a pod does (the runtime's bind of kubelet's publish target).
//
// The container's agent (a busybox shell) enters /data/sub, opens
// /data/hello.txt twice (fd 3 never read, fd 5 read to the end) and
// /data/sub (fd 4), and then runs the commands the test sends it through a
// FIFO, so that each command is a child of it: same working directory,
// same descriptors. After kill -9 of the daemon and the heal, the test
// takes the agent's descriptors (pidfd_getfd: the same open files, not a
// reopen) and reads them, reads /proc/PID/cwd from the host, and asks the
// agent to list, print and read its working directory, to re-enter it by
// path and to read a file by path. The facts are asserted, and the table
// of what each saw is logged: it is the measurement that docs/fuse.md
// quotes.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/test/testutil"
)

// fuseCrashProfiles are the example squashfuse and sshfs profiles as they
// were before fd mode: the daemon mounts by itself (as root: where
// /dev/fuse is 0600 a runAs daemon cannot open it). squashRoot is their
// squashfuse root.
func fuseCrashProfiles(squashRoot string) string {
	return fmt.Sprintf(`
- name: squashfuse-own
  binary: /usr/bin/squashfuse
  args: [-f, "{source}", "{mountpoint}", -o, allow_other]
  source: {roots: [%q]}
  readyTimeout: 10s
- name: sshfs-own
  binary: /usr/bin/sshfs
  args: [-f, "{source}", "{mountpoint}", -F, /dev/null,
         -o, "IdentityFile={secret:sshKey}", -o, "UserKnownHostsFile={secret:knownHosts}",
         -o, GlobalKnownHostsFile=/dev/null, -o, StrictHostKeyChecking=yes,
         -o, BatchMode=yes, -o, IdentitiesOnly=yes, -o, ServerAliveInterval=15,
         -o, reconnect, -o, allow_other, -o, default_permissions, "{options}"]
  source: {pattern: '[A-Za-z0-9_][A-Za-z0-9_.-]*@[A-Za-z0-9.-]+:[A-Za-z0-9._/~+-]*'}
  options:
  - {name: port, pattern: '[0-9]{1,5}', args: [-p, "{value}"]}
  secrets:
  - {name: sshKey}
  - {name: knownHosts}
  readyTimeout: 20s
`, squashRoot)
}

const (
	crashHello = "hello through the volume\n"
	crashInner = "inside sub\n"
)

// crashRow is what one mode and volume saw after the heal.
type crashRow struct {
	mode, volume string
	cells        map[string]string
}

var crashColumns = []string{
	"old fd read (file never read)", "old fd pread 0 (page read before)", "old fd write", "old dir fd getdents",
	"cwd: ls .", "cwd: cat ./inner.txt", "cwd: pwd -P (sh builtin)",
	"host: readlink /proc/PID/cwd", "host: readdir /proc/PID/cwd",
	"cd /data/sub by path, cat ./inner.txt", "fresh open /data/hello.txt",
}

func TestFuseConsumerAcrossDaemonCrash(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommands(t, "containerd", "ctr", "runc", "busybox", "nsenter", "squashfuse", "sshfs", "mksquashfs")
	testutil.RequireFile(t, "/dev/fuse", "the FUSE device")
	var (
		mu   sync.Mutex
		rows []crashRow
	)
	for _, mode := range []string{"own mount", "fd mode"} {
		for _, volume := range []string{"squashfuse", "sshfs"} {
			t.Run(strings.ReplaceAll(mode, " ", "-")+"/"+volume, func(t *testing.T) {
				cells := fuseConsumerAcrossCrash(t, mode == "fd mode", volume)
				mu.Lock()
				rows = append(rows, crashRow{mode, volume, cells})
				mu.Unlock()
			})
		}
	}
	var b strings.Builder
	b.WriteString("what a consumer's descriptors and working directory see after kill -9 of the daemon and the heal:\n")
	b.WriteString("| mode | volume | " + strings.Join(crashColumns, " | ") + " |\n")
	b.WriteString("|---|---|" + strings.Repeat("---|", len(crashColumns)) + "\n")
	for _, r := range rows {
		b.WriteString("| " + r.mode + " | " + r.volume + " |")
		for _, c := range crashColumns {
			b.WriteString(" " + r.cells[c] + " |")
		}
		b.WriteString("\n")
	}
	t.Log(b.String())
}

// fuseConsumerAcrossCrash runs one case and returns its row.
func fuseConsumerAcrossCrash(t *testing.T, fdMode bool, volume string) map[string]string {
	testutil.NoLeaks(t)
	ctrd := testutil.StartContainerd(t)
	ownSquash := filepath.Join(t.TempDir(), "squash-own")
	if err := os.Mkdir(ownSquash, 0o755); err != nil {
		t.Fatal(err)
	}
	e := newFuseEnv(t, fuseCrashProfiles(ownSquash))
	e.startMounter("")
	e.startPlugin("", "--v=4")

	profile := volume
	if !fdMode {
		profile += "-own"
	}
	var vctx, secrets map[string]string
	var backend func(string) string // a file of sshfs's backend, read directly
	switch volume {
	case "squashfuse":
		src := filepath.Join(e.dir, "crash-src")
		fuseCrashTree(t, src)
		root := e.squashRoot
		if !fdMode {
			root = ownSquash
		}
		img := filepath.Join(root, "crash.sqfs")
		if out, err := exec.Command("mksquashfs", src, img, "-quiet", "-noappend").CombinedOutput(); err != nil {
			t.Fatalf("mksquashfs: %v: %s", err, out)
		}
		vctx = map[string]string{"type": "fuse", "profile": profile, "source": img}
	case "sshfs":
		s := startFuseSSHD(t)
		fuseCrashTree(t, s.Data)
		vctx = map[string]string{"type": "fuse", "profile": profile, "source": "root@127.0.0.1:" + s.Data, "port": fmt.Sprint(s.Port)}
		secrets = map[string]string{"sshKey": s.UserKey, "knownHosts": s.KnownHosts + "\n"}
		backend = fuseReader(s.Data)
	}
	id := "fuse-crash-" + volume
	if err := e.tryStage(id, mountCap("", rwo), vctx, secrets); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	first := e.daemon(id)
	if !fuseAlive(first) || first.Conn == 0 {
		t.Fatalf("after stage the journal records daemon %+v", first)
	}
	if got := fuseFdModeDaemon(first.PID); got != fdMode {
		t.Fatalf("daemon %d serves /dev/fd/3: %t, want %t (the profile %s)", first.PID, got, fdMode, profile)
	}
	target := e.target(id, "mount")
	e.publish(id, target, mountCap("", rwo), false, nil)

	// The agent: cwd /data/sub; fd 3 /data/cold.txt (never read by
	// anyone: none of its pages is cached), fd 4 /data/sub, fd 5
	// /data/hello.txt read to the end, and on a writable volume fd 6
	// /data/sub/log.txt for appending, written once; then it runs each line
	// written to /tmp/cmd as a child (same cwd and descriptors), output and
	// status in /tmp/out.
	writable := ""
	if volume == "sshfs" {
		writable = "exec 6>>/data/sub/log.txt\necho before >&6\n"
	}
	agent := `set -e
cd /data/sub
exec 3</data/cold.txt 4</data/sub 5</data/hello.txt
cat <&5 >/dev/null
` + writable + `mkfifo /tmp/cmd
set +e
echo ready > /tmp/ready
while :; do
  read -r line < /tmp/cmd
  sh -c "$line" > /tmp/out.new 2>&1
  echo "rc=$?" >> /tmp/out.new
  mv /tmp/out.new /tmp/out
done`
	ctr := ctrd.RunWithBinds(t, "consumer", testutil.BusyboxRootfs(t), map[string]string{"/data": target}, "sh", "-c", agent)
	pid := ctr.PID()
	if !testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool {
		out, err := testutil.Exec(t, pid, "cat", "/tmp/ready")
		return err == nil && out == "ready\n"
	}) {
		t.Fatalf("the agent did not start; its output:\n%s", readFileString(ctr.LogPath))
	}
	ask := func(cmd string) (string, int) {
		t.Helper()
		return fuseCrashAsk(t, pid, cmd)
	}
	wantLs := "inner.txt\n"
	if volume == "sshfs" {
		wantLs = "inner.txt\nlog.txt\n"
	}
	if out, rc := ask("cat ./inner.txt && cat /data/hello.txt && pwd -P && ls ."); rc != 0 || out != crashInner+crashHello+"/data/sub\n"+wantLs {
		t.Fatalf("before the kill, the agent sees %q (rc %d)", out, rc)
	}
	fuseCheckBind(t, pid, "/data", first.Conn)

	// kill -9 of the daemon; the heal is there once a path opened afresh
	// reads again inside the container.
	if err := syscall.Kill(first.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	var fresh string
	if !testutil.Poll(30*time.Second, 20*time.Millisecond, func() bool {
		var rc int
		fresh, rc = ask("cat /data/hello.txt")
		return rc == 0
	}) {
		t.Fatalf("no fresh read inside the container within 30s of the kill: %q", fresh)
	}
	t.Logf("healed: a fresh open reads again %v after the kill", time.Since(killed).Round(time.Millisecond))
	// The journal records the new daemon once the heal's calls return.
	var second = e.daemon(id)
	testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool { second = e.daemon(id); return second.Generation == 2 })
	if second.Generation != 2 || second.Conn == first.Conn || !fuseAlive(second) {
		t.Fatalf("after the heal the journal records %+v (the first: %+v)", second, first)
	}
	fuseCheckBind(t, pid, "/data", second.Conn)

	cells := map[string]string{}
	wantErr := func(col, got string) {
		t.Helper()
		cells[col] = got
		if !fuseCrashDeadConn(got) {
			t.Errorf("%s on the dead connection: %s; want ENOTCONN or ECONNABORTED", col, got)
		}
	}

	// The agent's descriptors themselves, taken with pidfd_getfd.
	fd3, fd4, fd5 := fuseCrashGetfd(t, pid, 3), fuseCrashGetfd(t, pid, 4), fuseCrashGetfd(t, pid, 5)
	wantErr("old fd read (file never read)", fuseCrashIO(t, func() (string, error) {
		buf := make([]byte, 4096)
		n, err := unix.Pread(fd3, buf, 0)
		return string(buf[:max(n, 0)]), err
	}))
	// A page read before the kill may still be in the page cache: what
	// comes back is then the file's content (never anything else), or the
	// error.
	warm := fuseCrashIO(t, func() (string, error) {
		buf := make([]byte, 4096)
		n, err := unix.Pread(fd5, buf, 0)
		return string(buf[:max(n, 0)]), err
	})
	cells["old fd pread 0 (page read before)"] = warm
	if warm != fmt.Sprintf("ok %q", crashHello) && !fuseCrashDeadConn(warm) {
		t.Errorf("pread of a page read before the kill: %s; want the content or ENOTCONN/ECONNABORTED", warm)
	}
	cells["old fd write"] = "n/a (read-only)"
	if volume == "sshfs" {
		fd6 := fuseCrashGetfd(t, pid, 6)
		wantErr("old fd write", fuseCrashIO(t, func() (string, error) {
			n, err := unix.Write(fd6, []byte("after the kill\n"))
			return fmt.Sprint(n), err
		}))
		unix.Close(fd6)
	}
	wantErr("old dir fd getdents", fuseCrashIO(t, func() (string, error) {
		buf := make([]byte, 8192)
		n, err := unix.Getdents(fd4, buf)
		if err != nil {
			return "", err
		}
		var names []string
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
		return strings.Join(names, ","), nil
	}))
	for _, fd := range []int{fd3, fd4, fd5} {
		unix.Close(fd)
	}

	// The working directory, from the agent's children.
	// Seen now and then (about 1 run in 15, both modes): an ls or a cat in
	// the dead directory succeeds and prints nothing instead of ENOTCONN.
	// Never the old listing or content; which the kernel answered is in
	// the table.
	for _, c := range []struct{ col, cmd string }{{"cwd: ls .", "ls ."}, {"cwd: cat ./inner.txt", "cat ./inner.txt"}} {
		if got := fuseCrashShell(ask(c.cmd)); got == `ok ""` {
			cells[c.col] = got + " (empty; the usual answer is ENOTCONN)"
		} else {
			wantErr(c.col, got)
		}
	}
	pwd := fuseCrashShell(ask("pwd -P"))
	cells["cwd: pwd -P (sh builtin)"] = pwd
	if pwd != `ok "\n"` {
		t.Errorf("pwd -P (busybox sh) in the dead directory: %s; want an empty line (getcwd names no reachable path)", pwd)
	}
	// The working directory from the host.
	link, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid))
	cells["host: readlink /proc/PID/cwd"] = fuseCrashResult(fmt.Sprintf("%q", link), err)
	if err != nil || link != "/sub" {
		t.Errorf("readlink /proc/%d/cwd: %q, %v; want /sub (the path inside the dead mount, which is detached)", pid, link, err)
	}
	wantErr("host: readdir /proc/PID/cwd", fuseCrashIO(t, func() (string, error) {
		ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/cwd", pid))
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		return strings.Join(names, ","), err
	}))

	// What an application must do: open again, enter again by path.
	reenter := fuseCrashShell(ask("cd /data/sub && cat ./inner.txt"))
	cells["cd /data/sub by path, cat ./inner.txt"] = reenter
	if reenter != fmt.Sprintf("ok %q", crashInner) {
		t.Errorf("re-entering /data/sub by path after the heal: %s", reenter)
	}
	cells["fresh open /data/hello.txt"] = fuseCrashShell(ask("cat /data/hello.txt"))
	if cells["fresh open /data/hello.txt"] != fmt.Sprintf("ok %q", crashHello) {
		t.Errorf("a fresh open after the heal: %s", cells["fresh open /data/hello.txt"])
	}
	if volume == "sshfs" {
		if out, rc := ask("cd /data/sub && echo after > ./written.txt && cat ./written.txt"); rc != 0 || out != "after\n" {
			t.Errorf("a write through the re-entered directory after the heal: %q (rc %d)", out, rc)
		}
		if !fuseBackendHolds(backend, "sub/written.txt", "after\n") {
			t.Errorf("the backend holds %q for sub/written.txt, want the write made after the heal", backend("sub/written.txt"))
		}
		// The write on the dead descriptor went nowhere.
		if got := backend("sub/log.txt"); got != "before\n" {
			t.Errorf("the backend holds %q for sub/log.txt, want only the write made before the kill", got)
		}
	}
	for _, c := range crashColumns {
		t.Logf("%-40s %s", c+":", cells[c])
	}

	ctr.Kill(t)
	e.unpublish(id, target)
	e.unstage(id)
	e.checkClean(id)
	return cells
}

// fuseCrashTree writes hello.txt, cold.txt and sub/inner.txt under dir.
func fuseCrashTree(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "hello.txt"), []byte(crashHello), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cold.txt"), []byte("never read\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "sub", "inner.txt"), []byte(crashInner), 0o644); err != nil {
		t.Fatal(err)
	}
}

// fuseFdModeDaemon reports whether pid serves its mount on fd 3, which is
// /dev/fuse (fd mode), rather than having opened /dev/fuse itself.
func fuseFdModeDaemon(pid int) bool {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return strings.Contains("\x00"+string(b)+"\x00", "\x00/dev/fd/3\x00")
}

// fuseCrashAsk has the agent in pid's mount namespace run cmd and returns
// its output and status; 255 when the agent did not answer in 15s.
func fuseCrashAsk(t *testing.T, pid int, cmd string) (string, int) {
	t.Helper()
	script := `rm -f /tmp/out; printf '%s\n' "$1" > /tmp/cmd; i=0
while [ ! -e /tmp/out ]; do i=$((i+1)); [ $i -gt 300 ] && exit 9; sleep 0.05; done; cat /tmp/out`
	out, err := testutil.Exec(t, pid, "sh", "-c", script, "sh", cmd)
	if err != nil {
		t.Fatalf("the agent did not answer %q: %v", cmd, err)
	}
	i := strings.LastIndex(out, "rc=")
	if i < 0 {
		t.Fatalf("the agent's answer to %q has no status: %q", cmd, out)
	}
	var rc int
	fmt.Sscanf(out[i:], "rc=%d", &rc)
	return out[:i], rc
}

// fuseCrashGetfd duplicates pid's descriptor fd into this process: the
// same open file, not a reopen.
func fuseCrashGetfd(t *testing.T, pid, fd int) int {
	t.Helper()
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatalf("pidfd_open %d: %v", pid, err)
	}
	defer unix.Close(pidfd)
	got, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		t.Fatalf("pidfd_getfd %d of %d: %v", fd, pid, err)
	}
	return got
}

// fuseCrashIO runs op with a deadline (a request to a connection nobody
// serves would block) and returns its result: "ok <output>" or the
// errno's name.
func fuseCrashIO(t *testing.T, op func() (string, error)) string {
	t.Helper()
	type res struct {
		out string
		err error
	}
	ch := make(chan res, 1)
	go func() { out, err := op(); ch <- res{out, err} }()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	select {
	case r := <-ch:
		return fuseCrashResult(fmt.Sprintf("%q", r.out), r.err)
	case <-ctx.Done():
		t.Fatal("an operation on the dead connection blocked for 15s")
		return ""
	}
}

func fuseCrashResult(quoted string, err error) string {
	if err == nil {
		return "ok " + quoted
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return unix.ErrnoName(errno)
	}
	return "error " + err.Error()
}

// fuseCrashShell names what a busybox command said: "ok <output>" when it
// succeeded, else the errno whose message its error carries.
func fuseCrashShell(out string, rc int) string {
	if rc == 0 {
		return fmt.Sprintf("ok %q", out)
	}
	for _, e := range []syscall.Errno{unix.ENOTCONN, unix.ECONNABORTED, unix.EIO, unix.ENOENT, unix.ESTALE, unix.EACCES} {
		if strings.Contains(strings.ToLower(out), strings.ToLower(e.Error())) {
			return unix.ErrnoName(e)
		}
	}
	return fmt.Sprintf("rc %d %q", rc, out)
}

// fuseCrashDeadConn: the error a request to an aborted FUSE connection
// gets.
func fuseCrashDeadConn(got string) bool {
	return got == "ENOTCONN" || got == "ECONNABORTED"
}

func readFileString(p string) string {
	b, _ := os.ReadFile(p)
	return string(b)
}
