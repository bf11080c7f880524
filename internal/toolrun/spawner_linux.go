package toolrun

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// A process that holds many open files pays for them at every fork: the
// child gets a copy of the whole file table, which exec then closes entry
// by entry. The plugin holds one open loop device per staged volume, so
// with 10,000 volumes every mkfs or blkid it started cost milliseconds
// more than with 10 (exec of /bin/true: 0.60 ms with 10 open files, 1.46
// ms with 10,000). The spawner is a child the plugin starts before it
// opens any of them: a second copy of the plugin's own binary that does
// nothing but start tools on request, from a small file table.
//
// Requests travel over a private socketpair made at start, never a path
// anyone else can reach. Each carries the tool's absolute path, arguments
// and extra environment as JSON, and two descriptors: the output file
// the tool writes to, and one end of a fresh socketpair that the reply
// comes back on. The plugin closing its end of that pair (its context
// ended) makes the spawner kill the tool. The spawner ends when the
// plugin does: it reads EOF on the control socket and kills what it runs.

// spawnerEnv marks the process a spawner, read by ServeSpawnerIfAsked.
const spawnerEnv = "MOUNTPLAN_TOOLRUN_SPAWNER"

// maxRequest bounds one request's JSON: a tool's arguments are short; a
// larger request is run directly instead.
const maxRequest = 32 << 10

type spawnRequest struct {
	Path string   `json:"path"`
	Args []string `json:"args"`
	Env  []string `json:"env,omitempty"`
}

// spawnReply is exitStatus's answer: Status when Err is empty (the tool
// exited), else why it did not exit by itself.
type spawnReply struct {
	Status int    `json:"status"`
	Err    string `json:"err,omitempty"`
}

// spawner is the plugin's end of a running spawner.
type spawner struct {
	ctl  *os.File // SOCK_SEQPACKET control socket
	pid  int
	dead atomic.Bool
}

var active atomic.Pointer[spawner]

// StartSpawner starts the spawner (this binary again, which must call
// ServeSpawnerIfAsked first thing in main) and makes every later tool run
// go through it. Call it early, before the process opens many files. On
// error tools keep being started directly.
func StartSpawner() error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return os.NewSyscallError("socketpair", err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "spawner-control"), os.NewFile(uintptr(fds[1]), "spawner-control")
	defer theirs.Close()
	cmd := exec.Command(self)
	cmd.Args = []string{SpawnerName}
	cmd.Env = append(withoutSpawnerEnv(os.Environ()), spawnerEnv+"=1")
	cmd.ExtraFiles = []*os.File{theirs} // fd 3
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		ours.Close()
		return err
	}
	s := &spawner{ctl: ours, pid: cmd.Process.Pid}
	go func() {
		err := cmd.Wait()
		s.dead.Store(true)
		klog.ErrorS(err, "The tool spawner ended; tools are started directly from now on", "pid", cmd.Process.Pid)
	}()
	active.Store(s)
	return nil
}

// viaSpawner runs name through the spawner when one was started. ok is
// false when there is none or it could not take the request: the caller
// then starts the tool itself.
func viaSpawner(ctx context.Context, name string, args, env []string, out *os.File) (status int, ok bool, err error) {
	s := active.Load()
	if s == nil {
		return 0, false, nil
	}
	path, err := exec.LookPath(name)
	if err != nil {
		return -1, true, err // wraps exec.ErrNotFound when missing
	}
	return s.run(ctx, path, args, env, out)
}

// run runs path through the spawner. ok is false when the spawner could
// not take the request (it is gone, or the request is too big): the
// caller then runs the tool itself.
func (s *spawner) run(ctx context.Context, path string, args, env []string, out *os.File) (status int, ok bool, err error) {
	if s.dead.Load() {
		return 0, false, nil
	}
	if err := ctx.Err(); err != nil {
		return -1, true, err // a call already ended starts nothing
	}
	req, err := json.Marshal(spawnRequest{Path: path, Args: args, Env: env})
	if err != nil || len(req) > maxRequest {
		return 0, false, nil
	}
	// Non-blocking, both ends (they share the flag): reads wait in the
	// poller, and the spawner's Close of its end wakes its own reader.
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return 0, false, nil
	}
	reply := os.NewFile(uintptr(fds[0]), "spawner-reply")
	defer reply.Close()
	sendErr := sendWithFds(s.ctl, req, int(out.Fd()), fds[1])
	runtime.KeepAlive(out)
	unix.Close(fds[1])
	if sendErr != nil {
		return 0, false, nil
	}
	type result struct {
		r   spawnReply
		err error
	}
	got := make(chan result, 1)
	go func() {
		buf := make([]byte, 4096)
		n, err := reply.Read(buf)
		var r spawnReply
		if err == nil {
			err = json.Unmarshal(buf[:n], &r)
		}
		got <- result{r, err}
	}()
	var res result
	select {
	case <-ctx.Done():
		// Shutting our sending side makes the spawner kill the tool; its
		// reply, sent once the tool is reaped, then ends the read above,
		// so that the caller never cleans up after a tool still running.
		_ = unix.Shutdown(fds[0], unix.SHUT_WR)
		if res = <-got; res.err != nil || res.r.Err != "" {
			return -1, true, ctx.Err()
		}
		// The tool had finished on its own: its result stands, as
		// exec.Cmd.Wait reports it for a context that ends too late.
	case res = <-got:
	}
	switch {
	case errors.Is(res.err, io.EOF):
		// The spawner died (its tools get SIGKILL with it): what the
		// tool did is unknown, so the call failed.
		return -1, true, errors.New("the tool spawner ended during the call; the tool was killed")
	case res.err != nil:
		return -1, true, fmt.Errorf("tool spawner: %w", res.err)
	case res.r.Err != "":
		return -1, true, errors.New(res.r.Err)
	}
	return res.r.Status, true, nil
}

func sendWithFds(f *os.File, msg []byte, fds ...int) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var sendErr error
	if err := rc.Write(func(fd uintptr) bool {
		sendErr = unix.Sendmsg(int(fd), msg, unix.UnixRights(fds...), nil, 0)
		return !errors.Is(sendErr, unix.EAGAIN)
	}); err != nil {
		return err
	}
	return sendErr
}

func withoutSpawnerEnv(env []string) []string {
	return slices.DeleteFunc(slices.Clone(env), func(kv string) bool { return strings.HasPrefix(kv, spawnerEnv+"=") })
}

// init names a spawner SpawnerComm. Package init runs on the main thread,
// whose name is the process's command name.
func init() {
	if os.Getenv(spawnerEnv) != "1" {
		return
	}
	if name, err := unix.BytePtrFromString(SpawnerComm); err == nil {
		_ = unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(name)), 0, 0, 0)
	}
}

// ServeSpawnerIfAsked serves as the spawner and exits when this process
// was started as one by StartSpawner; otherwise it returns at once. Call
// it first thing in main.
func ServeSpawnerIfAsked() {
	if os.Getenv(spawnerEnv) != "1" {
		return
	}
	os.Unsetenv(spawnerEnv)
	// No descriptor but the standard three reaches a tool: not the
	// control socket (a tool could read other tools' requests from it),
	// nor anything this process inherited without close-on-exec.
	if err := unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC); err != nil {
		os.Exit(2)
	}
	// Ctrl-C reaches the whole process group and a stop may signal every
	// process: the spawner stays until the plugin is gone (EOF), so that
	// the calls the plugin is still finishing keep their tools. Caught,
	// not ignored: an ignored signal would stay ignored in the tools.
	signal.Notify(make(chan os.Signal, 1), unix.SIGINT, unix.SIGTERM)
	serveSpawner(os.NewFile(3, "spawner-control"))
	os.Exit(0)
}

// serveSpawner takes requests until the control socket ends (the plugin
// is gone), then kills the tools still running and returns.
func serveSpawner(ctl *os.File) {
	ctx, cancel := context.WithCancel(context.Background())
	var running sync.WaitGroup
	defer func() {
		cancel()
		running.Wait()
	}()
	buf := make([]byte, maxRequest+1)
	oob := make([]byte, unix.CmsgSpace(2*4))
	for {
		n, oobn, _, _, err := unix.Recvmsg(int(ctl.Fd()), buf, oob, unix.MSG_CMSG_CLOEXEC)
		if err != nil && errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || n == 0 {
			return // the plugin is gone
		}
		fds := receivedFds(oob[:oobn])
		if len(fds) != 2 {
			for _, fd := range fds {
				unix.Close(fd)
			}
			continue
		}
		var req spawnRequest
		out, reply := os.NewFile(uintptr(fds[0]), "tool-output"), os.NewFile(uintptr(fds[1]), "spawner-reply")
		if err := json.Unmarshal(buf[:n], &req); err != nil {
			out.Close()
			reply.Close()
			continue
		}
		running.Add(1)
		go func() {
			defer running.Done()
			spawnOne(ctx, req, out, reply)
		}()
	}
}

func receivedFds(oob []byte) []int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for _, m := range msgs {
		if rights, err := unix.ParseUnixRights(&m); err == nil {
			fds = append(fds, rights...)
		}
	}
	return fds
}

// spawnOne runs one request: the tool is killed when the plugin shuts
// its end of reply (its call's context ended) or the spawner stops.
func spawnOne(ctx context.Context, req spawnRequest, out, reply *os.File) {
	defer out.Close()
	defer reply.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		// The plugin never writes on the reply socket: a read returns
		// only when it shut or closed its end.
		var b [1]byte
		_, _ = reply.Read(b[:])
		cancel()
	}()
	// A call that ended while its request was on the way starts nothing:
	// the plugin shut its end of reply (a read there returns 0 at once).
	var peek [1]byte
	if n, _, err := unix.Recvfrom(int(reply.Fd()), peek[:], unix.MSG_PEEK|unix.MSG_DONTWAIT); n == 0 && err == nil {
		r, _ := json.Marshal(spawnReply{Err: "cancelled before it started"})
		_, _ = reply.Write(r)
		return
	}
	cmd := command(ctx, req.Path, req.Args, req.Env, out)
	// A spawner that dies (killed, out of memory) takes its tools along:
	// the plugin then reports the call failed, and no tool it gave up on
	// runs on beside the retry.
	cmd.SysProcAttr = &unix.SysProcAttr{Pdeathsig: unix.SIGKILL}
	var r spawnReply
	var err error
	if r.Status, err = exitStatus(cmd.Run()); err != nil {
		r.Err = err.Error()
	}
	b, _ := json.Marshal(r)
	_, _ = reply.Write(b)
}
