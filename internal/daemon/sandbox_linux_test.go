package daemon

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"slices"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// TestSandboxedStart: a sandboxed daemon's start is its shim's, this
// binary again, marked as the shim, in new mount, PID, IPC and UTS
// namespaces (no network one), with the request on fd 4 of a pipe, never
// on its command line; a root daemon or one with capabilities is refused.
func TestSandboxedStart(t *testing.T) {
	nobody := &User{UID: 65534, GID: 65534}
	sb := &Sandbox{ReadOnly: []string{"/srv/images"}, Writable: []string{"/st/fuse/v/work"}}
	for name, c := range map[string]Command{
		"no user":      {Path: "/usr/bin/squashfuse", Sandbox: sb},
		"root":         {Path: "/usr/bin/squashfuse", Sandbox: sb, RunAs: &User{UID: 0, GID: 65534}},
		"root group":   {Path: "/usr/bin/squashfuse", Sandbox: sb, RunAs: &User{UID: 65534, GID: 0}},
		"capabilities": {Path: "/usr/bin/squashfuse", Sandbox: sb, RunAs: nobody, Capabilities: []string{"SYS_ADMIN"}},
	} {
		if _, _, _, _, _, err := sandboxed(c, nil, &syscall.SysProcAttr{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: sandboxed = %v, want InvalidArgument", name, err)
		}
	}
	c := Command{Path: "/usr/bin/squashfuse", Args: []string{"-f", "/srv/images/a.sqfs", "/dev/fd/3"}, Env: []string{"PATH=/usr/bin"},
		RunAs: nobody, Sandbox: sb}
	sys := &syscall.SysProcAttr{Setsid: true}
	path, argv, env, files, pipe, err := sandboxed(c, []*os.File{os.Stdin, os.Stdout, os.Stdout}, sys)
	if err != nil {
		t.Fatal(err)
	}
	defer pipe.Close()
	if path != SandboxExe || !slices.Equal(argv, []string{sandboxName}) || !slices.Equal(env, []string{sandboxEnv + "=1"}) {
		t.Errorf("the shim's start: %s %q %q", path, argv, env)
	}
	if len(files) != sandboxFd+1 || files[3] != nil || files[sandboxFd] != pipe {
		t.Errorf("the shim's files: %v; want fd 3 closed (no FUSE descriptor given) and the request on fd %d", files, sandboxFd)
	}
	want := uintptr(unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS)
	if sys.Cloneflags != want || sys.Credential != nil || !sys.Setsid {
		t.Errorf("the shim's SysProcAttr: clone flags %#x (want %#x, no CLONE_NEWNET), credential %v, setsid %t", sys.Cloneflags, want, sys.Credential, sys.Setsid)
	}
	b, err := io.ReadAll(pipe)
	if err != nil {
		t.Fatal(err)
	}
	var req sandboxRequest
	if err := json.Unmarshal(b, &req); err != nil {
		t.Fatal(err)
	}
	if req.Path != c.Path || !slices.Equal(req.Args, c.Args) || req.RunAs != *nobody || !slices.Equal(req.Sandbox.ReadOnly, sb.ReadOnly) || !slices.Equal(req.Sandbox.Writable, sb.Writable) {
		t.Errorf("the request on the pipe: %+v", req)
	}
}
