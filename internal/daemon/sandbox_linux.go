package daemon

// The sandbox of a daemon in fd mode (issue 34): the daemon runs in mount,
// PID, IPC and UTS namespaces of its own, its root a tmpfs that holds the
// system's directories read-only, a /dev of four harmless devices, a /proc
// of its own PID namespace, and of the node only what its Sandbox names
// (its volume's work/ and secrets/, its source's root). Go's os/exec runs
// nothing between fork and exec, so the namespaces are made by clone
// flags and the root by a shim: this binary again (/proc/self/exe, which
// must call ServeSandboxIfAsked first thing in main), still root inside
// the new namespaces, which builds the root, pivots into it, drops to the
// daemon's user with no capability and no_new_privs, and execs the daemon
// in its place: the daemon is then PID 1 of its PID namespace, and the PID
// the spawner recorded (the shim's) is the daemon's.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Sandbox is what a sandboxed daemon's root holds of the node besides
// SystemPaths: host paths bound at the same paths, so that a command line
// rendered for the host (its {workdir}, {secret:...}, {source}) resolves
// in it unchanged. Paths are not secrets; they may be recorded.
type Sandbox struct {
	// ReadOnly are files or directories bound read-only (with what is
	// mounted below them): the source's root, the secrets' tmpfs, a
	// binary outside SystemPaths.
	ReadOnly []string `json:"readOnly,omitempty"`
	// Writable are directories bound writable: the volume's work dir.
	Writable []string `json:"writable,omitempty"`
}

// SystemPaths are the host's directories every sandboxed daemon's root
// binds read-only (nosuid, nodev), where they exist: the daemon's binary
// and its shared libraries, and /etc for the user database (ssh looks up
// its user), name resolution (resolv.conf, hosts, nsswitch.conf: sshfs and
// rclone reach a server by name) and CA certificates. None is a secret of
// the node's: in the chart they are the mounter image's own. A symlink
// among them (/lib -> usr/lib on a merged /usr) is copied as a symlink.
var SystemPaths = []string{"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"}

// SandboxDevices are the device nodes a sandboxed daemon's /dev holds,
// bound from the host's: what libraries and ssh open as a matter of
// course. No /dev/fuse (the daemon has its descriptor), no disk.
var SandboxDevices = []string{"null", "zero", "random", "urandom"}

// SandboxExe is the binary that becomes a daemon's sandbox: this one.
const SandboxExe = "/proc/self/exe"

const (
	// sandboxName is the shim's argv[0] and sandboxEnv its one variable:
	// both mark a process as the shim for ServeSandboxIfAsked.
	sandboxName = "mountplan-daemon-sandbox"
	sandboxEnv  = "MOUNTPLAN_DAEMON_SANDBOX"
	// sandboxFd is where the shim reads its sandboxRequest: fd 3 is the
	// FUSE descriptor.
	sandboxFd = 4
	// maxSandboxRequest fits the pipe's buffer, written whole before the
	// start: the spawner never blocks on a shim that does not read.
	maxSandboxRequest = 60 << 10
	// sandboxCloneFlags are the daemon's new namespaces. No network
	// namespace: sshfs and other remote daemons need the node's network.
	sandboxCloneFlags = unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS
)

// sandboxRequest is what the spawner hands the shim on a pipe (not on the
// command line: nothing of it needs to show in ps).
type sandboxRequest struct {
	Path    string   `json:"path"`
	Args    []string `json:"args"`
	Env     []string `json:"env"`
	RunAs   User     `json:"runAs"`
	Sandbox Sandbox  `json:"sandbox"`
}

// sandboxed turns the start of c into the start of its shim: the
// binary, arguments and environment to start instead, the request's pipe
// appended to files as fd 4, and sys given the new namespaces. The
// caller closes the returned pipe after the start.
func sandboxed(c Command, files []*os.File, sys *syscall.SysProcAttr) (path string, argv, env []string, _ []*os.File, pipe *os.File, err error) {
	if c.RunAs == nil || c.RunAs.UID == 0 || c.RunAs.GID == 0 || len(c.Capabilities) > 0 {
		return "", nil, nil, nil, nil, fmt.Errorf("a sandboxed daemon runs as a user other than root without capabilities: %w", errdefs.ErrInvalidArgument)
	}
	b, err := json.Marshal(sandboxRequest{Path: c.Path, Args: c.Args, Env: c.Env, RunAs: *c.RunAs, Sandbox: *c.Sandbox})
	if err != nil {
		return "", nil, nil, nil, nil, fmt.Errorf("the sandbox's request: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	if len(b) > maxSandboxRequest {
		return "", nil, nil, nil, nil, fmt.Errorf("the daemon's command line and sandbox take %d bytes, more than %d: %w", len(b), maxSandboxRequest, errdefs.ErrInvalidArgument)
	}
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return "", nil, nil, nil, nil, fmt.Errorf("the sandbox's request: %w: %w", os.NewSyscallError("pipe2", err), errdefs.ErrUnavailable)
	}
	r, w := os.NewFile(uintptr(p[0]), "sandbox-request"), os.NewFile(uintptr(p[1]), "sandbox-request")
	_, err = w.Write(b)
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		r.Close()
		return "", nil, nil, nil, nil, fmt.Errorf("the sandbox's request: %w: %w", err, errdefs.ErrUnavailable)
	}
	for len(files) < sandboxFd {
		files = append(files, nil) // no FUSE descriptor: fd 3 stays closed
	}
	// The shim is root in its namespaces: it drops to RunAs itself, after
	// building the root, so no Credential here.
	sys.Cloneflags |= sandboxCloneFlags
	return SandboxExe, []string{sandboxName}, []string{sandboxEnv + "=1"}, append(files, r), r, nil
}

// ServeSandboxIfAsked makes this process a daemon's sandbox shim when it
// was started as one (see the file's comment), and then never returns: it
// execs the daemon or exits with status 127, its error on its standard
// error, which is the daemon's log. Call it first thing in main (and in
// the TestMain of a test binary that starts daemons in fd mode).
func ServeSandboxIfAsked() {
	if os.Getenv(sandboxEnv) == "" || len(os.Args) == 0 || os.Args[0] != sandboxName {
		return
	}
	err := runSandbox()
	fmt.Fprintf(os.Stderr, "mountplan: the daemon's sandbox: %v\n", err)
	os.Exit(127)
}

// readSandboxRequest reads and closes the request's pipe.
func readSandboxRequest() (sandboxRequest, error) {
	f := os.NewFile(sandboxFd, "sandbox-request")
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxSandboxRequest+1))
	if err != nil {
		return sandboxRequest{}, fmt.Errorf("reading the request: %w", err)
	}
	var req sandboxRequest
	if err := json.Unmarshal(b, &req); err != nil {
		return sandboxRequest{}, fmt.Errorf("the request: %w", err)
	}
	if req.RunAs.UID == 0 || req.RunAs.GID == 0 {
		return sandboxRequest{}, errors.New("the request names root as the daemon's user")
	}
	return req, nil
}
