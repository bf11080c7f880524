//go:build linux

package fuse

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/fuseprofile"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/testenv"
	"github.com/mountplan/mountplan/test/testutil"
)

// TestSupervisorWithTheMounter stages a squashfuse volume for a pod's
// fsGroup through a mounter in process and has the supervisor replace its
// daemon when it is killed (WaitDaemon) and when it hangs (its statfs
// probe unanswered while DaemonStatus shows requests waiting), each new
// daemon giving the files to the group again; the unstage leaves nothing.
// Both ways: the daemon mounts, and fd mode, where the mounter makes a
// fresh mount for each new daemon (which runs as nobody without a
// capability).
func TestSupervisorWithTheMounter(t *testing.T) {
	for _, fd := range []bool{false, true} {
		name := "daemon-mounts"
		if fd {
			name = "fd-mode"
		}
		t.Run(name, func(t *testing.T) { supervisorWithTheMounter(t, fd) })
	}
}

func supervisorWithTheMounter(t *testing.T, fd bool) {
	mountnstest.RequireRoot(t)
	mountnstest.RequireTool(t, "squashfuse", "mksquashfs")
	testenv.RequireFile(t, "/dev/fuse", "the FUSE device")
	testutil.NoLeaks(t)
	dir := mountnstest.Scratch(t)
	state, images := filepath.Join(dir, "state"), filepath.Join(dir, "images")
	content := filepath.Join(dir, "content")
	for _, d := range []string{state, images, content} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(content, "hello.txt"), []byte("from squashfs\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(images, "img.sqfs")
	mountnstest.Squashfs(t, content, img)
	prof := fuseprofile.Profile{Name: "squashfuse", Binary: "/usr/bin/squashfuse",
		Args: []string{"-f", "{source}", "{mountpoint}"}, Source: fuseprofile.SourceRule{Roots: []string{images}},
		MountGroupArgs: []string{"-o", "gid={gid},umask=0002"}}
	if fd {
		// The test reads as root, another user than the daemon's.
		prof.FdMount, prof.MountOptions = true, []string{"allow_other"}
		// The daemon of user nobody reaches its image.
		for d := dir; d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
			if err := os.Chmod(d, 0o711); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chmod(img, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cfg := &config.Config{FuseProfiles: []fuseprofile.Profile{prof}}
	ctx := context.Background()
	node, err := mounter.NewNode(ctx, mounter.Options{StateDir: state, KubeletDir: state, RecordsDir: filepath.Join(dir, "records"), Config: cfg})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close()
	s, err := New(Options{StateDir: state, Profiles: cfg.FuseProfiles, Daemons: node, ProbeInterval: 100 * time.Millisecond, ProbeTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer s.stop()
	v := source.Volume{ID: "vol", Parameters: map[string]string{"profile": "squashfuse", "source": img}}
	gid := uint32(2000)
	raw, err := s.Stage(ctx, v, source.StageRequest{MountGroup: &gid})
	if err != nil {
		t.Fatal(err)
	}
	v.State, v.Staging = raw, true
	var st State
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	read := func() bool {
		b, err := os.ReadFile(filepath.Join(st.MountPoint, "hello.txt"))
		fi, serr := os.Stat(filepath.Join(st.MountPoint, "hello.txt"))
		return err == nil && string(b) == "from squashfs\n" && serr == nil && fi.Sys().(*syscall.Stat_t).Gid == gid
	}
	if !read() {
		t.Fatal("the staged volume does not read, or its file is not the mount group's")
	}
	if h := s.Health(ctx, v); h.Abnormal {
		t.Errorf("health of a serving volume: %+v", h)
	}
	if _, err := s.Stats(ctx, v, ""); err != nil {
		t.Errorf("stats: %v", err)
	}
	// replaced waits for the supervisor's next generation, serving.
	replaced := func(gen int) Daemon {
		t.Helper()
		var d Daemon
		if !testutil.Poll(10*time.Second, 20*time.Millisecond, func() bool {
			d = s.supervisorOf(v.ID).daemon()
			return d.Generation == gen && d.Alive() && !s.Health(ctx, v).Abnormal
		}) {
			t.Fatalf("no healthy generation %d within 10s: %+v, health %+v", gen, d, s.Health(ctx, v))
		}
		return d
	}
	if err := syscall.Kill(st.Daemon.PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	second := replaced(2)
	if fd {
		// The restarted daemon is fd mode's too: nobody, no capability,
		// PID 1 of a PID namespace of its own, in a mount namespace of
		// its own.
		ps := mountnstest.ProcStatus(t, second.PID)
		if uid := strings.Fields(ps["Uid"]); len(uid) == 0 || uid[0] != "65534" || mountnstest.CapSet(t, ps, "CapEff") != 0 || mountnstest.CapSet(t, ps, "CapBnd") != 0 {
			t.Errorf("generation 2: Uid %q CapEff %s CapBnd %s; want 65534 and none", ps["Uid"], ps["CapEff"], ps["CapBnd"])
		}
		if nspid := strings.Fields(ps["NSpid"]); len(nspid) != 2 || nspid[1] != "1" {
			t.Errorf("generation 2: NSpid %q, want a PID namespace of its own", ps["NSpid"])
		}
		mine, _ := os.Readlink("/proc/self/ns/mnt")
		if its, err := os.Readlink("/proc/" + strconv.Itoa(second.PID) + "/ns/mnt"); err != nil || its == mine {
			t.Errorf("generation 2: mount namespace %q (%v), the mounter's %q: want one of its own", its, err, mine)
		}
	}
	if !read() {
		t.Error("the volume does not read after the restart, or its file is not the mount group's")
	}
	if err := syscall.Kill(second.PID, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer syscall.Kill(second.PID, syscall.SIGKILL) //nolint:errcheck // best effort
	replaced(3)
	if !testutil.Poll(5*time.Second, 20*time.Millisecond, func() bool { return !second.Alive() }) {
		t.Error("the hung daemon still runs")
	}
	if err := s.Unstage(ctx, v); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(filepath.Join(state, "fuse", v.ID)); err == nil {
		t.Error("the volume's directory outlived its unstage")
	}
}
