// Command mountplan-sidecar is mountplan's mounter. It asks the plugin for a
// volume's mount plan and performs it inside a consumer's mount namespace
// (mount, unmount), or serves the mounter's calls (internal/unixrpc, not
// gRPC) that the plugin hands every privileged act to (serve). Besides the wiring, this
// holds the mount command's client flow (prepare.go); plans are performed
// by internal/mounter and internal/mountns, served by internal/mounter/service, and
// daemons are started as internal/fuseprofile/policy allows.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/toolrun"
	"github.com/mountplan/mountplan/internal/version"
	"k8s.io/klog/v2"
)

const usage = `usage: mountplan-sidecar <command> [flags]

commands:
  mount    ask the plugin for a volume's plan and perform it in a process's mount namespace
  unmount  unmount everything at and below a target in a process's mount namespace, then release the claim
  serve    serve the mounter (every privileged act of the plugin) on a unix socket, and the NRI hook
  volumes  list what is mounted where: every volume, its source, device, stage, health and consumers,
           from the plugin's /debug/volumes, each consumer checked against the kernel (read only)
  probe    ask serve (--endpoint) or the plugin (--plugin-endpoint) for an answer: exit 0 when it answers, 1 with the reason
           (the mounter container's liveness probe)
  version  print the version, git revision, build date and Go version (also --version)

Run "mountplan-sidecar <command> -h" for the flags of a command.
`

func main() {
	toolrun.ServeSpawnerIfAsked() // this process may be serve's tool spawner
	daemon.ServeSandboxIfAsked()  // or the sandbox of a daemon in fd mode
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	if os.Args[1] == "serve" {
		// serve's tools (mkfs, blkid, ...) are started by a small child
		// made now, before it holds one open file per loop device. (Here,
		// not in run: a test binary is no spawner.)
		if err := toolrun.StartSpawner(); err != nil {
			klog.ErrorS(err, "Cannot start the tool spawner; tools are started directly")
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	err := run(ctx, os.Args[1], os.Args[2:])
	stop()
	klog.Flush()
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case errors.Is(err, errUsage):
		fmt.Fprintf(os.Stderr, "mountplan-sidecar %s: %v\n", os.Args[1], err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintf(os.Stderr, "mountplan-sidecar %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

// errUsage marks errors in the command line (exit status 2).
var errUsage = errors.New("bad command line")

func run(ctx context.Context, cmd string, args []string) error {
	switch cmd {
	case "mount":
		return runMount(ctx, args)
	case "unmount":
		return runUnmount(ctx, args)
	case "serve":
		return runServe(ctx, args)
	case "volumes":
		return runVolumes(ctx, args, os.Stdout)
	case "probe":
		return runProbe(ctx, args, os.Stdout)
	case "version", "--version", "-version":
		version.Get().Print(os.Stdout, "mountplan-sidecar")
		return nil
	case "-h", "--help", "help":
		fmt.Print(usage)
		return nil
	}
	fmt.Fprint(os.Stderr, usage)
	return fmt.Errorf("unknown command %q: %w", cmd, errUsage)
}
