package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/endpoint"
	"github.com/mountplan/mountplan/internal/fdlimit"
	"github.com/mountplan/mountplan/internal/flagalias"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/internal/mountns"
	"github.com/mountplan/mountplan/internal/peer"
	"github.com/mountplan/mountplan/internal/periodic"
	"github.com/mountplan/mountplan/internal/preflight"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
)

func runMount(ctx context.Context, args []string) error {
	fs := newFlagSet("mount")
	endpoint := fs.String("plugin-endpoint", "", "the plugin's CSI socket, unix:///path (required)")
	r := mountRequest{}
	fs.StringVar(&r.VolumeID, "volume-id", "", "volume to prepare (required)")
	fs.StringVar(&r.StagingPath, "staging-path", "", "the volume's staging target path (required)")
	fs.BoolVar(&r.ReadOnly, "readonly", false, "ask for read-only access (SINGLE_NODE_READER_ONLY); a plan with a writable mount is refused")
	fs.BoolVar(&r.Block, "block", false, "ask for raw block access instead of a filesystem")
	cf := consumerFlags(fs)
	nf := addNodeFlags(fs)
	timeout := fs.Duration("timeout", 2*time.Minute, "give up after this long")
	if err := parse(fs, args, "plugin-endpoint", "volume-id", "staging-path", "pid", "target"); err != nil {
		return err
	}
	opts, err := nf.options()
	if err != nil {
		return err
	}
	// This command only looks at the records of the mounter that set the
	// devices up (serve, or the plugin's own): it holds and writes nothing.
	opts.Observe = true
	r.Consumer = cf.consumer()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	if err := mountns.Supported(); err != nil {
		return err
	}
	np, closeConn, err := dialPlugin(*endpoint)
	if err != nil {
		return err
	}
	defer closeConn()
	node, err := mounter.NewNode(ctx, opts)
	if err != nil {
		return err
	}
	defer node.Close()
	c, err := prepareAndMount(ctx, np, node, r)
	if err != nil {
		return err
	}
	// The admin named the consumer: the mounter beside this command then
	// accepts it too (a FUSE heal re-attaches there on the plugin's
	// request), as it accepts the runtime's containers.
	if _, err := node.Attribute(ctx, c.PID, mounter.ByAdmin, ""); err != nil {
		return fmt.Errorf("volume %s is mounted, but the mounter will not re-attach it there: %w", r.VolumeID, err)
	}
	fmt.Printf("mounted volume %s at %s for pid %d\n", r.VolumeID, c.MountPoint, c.PID)
	switch {
	case c.Namespace.ID != 0:
		fmt.Printf("mount namespace %d, id %d (pass --mnt-ns-inode %d --mnt-ns-id %d to unmount)\n", c.Namespace.Inode, c.Namespace.ID, c.Namespace.Inode, c.Namespace.ID)
	case c.Namespace.Inode != 0:
		fmt.Printf("mount namespace %d (pass --mnt-ns-inode %d to unmount)\n", c.Namespace.Inode, c.Namespace.Inode)
	}
	return nil
}

func runUnmount(ctx context.Context, args []string) error {
	fs := newFlagSet("unmount")
	endpoint := fs.String("plugin-endpoint", "", "the plugin's CSI socket, unix:///path (required)")
	volumeID := fs.String("volume-id", "", "volume to release (required)")
	cf := consumerFlags(fs)
	removeMountPoint := fs.Bool("remove-mount-point", false, "remove the mount point (--target) afterwards (rmdir or unlink, never recursive)")
	flagalias.Deprecated(fs, "remove-target", "remove-mount-point", warnDeprecated) // serve's name for the same
	timeout := fs.Duration("timeout", 2*time.Minute, "give up after this long")
	if err := parse(fs, args, "plugin-endpoint", "volume-id", "pid", "target"); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	np, closeConn, err := dialPlugin(*endpoint)
	if err != nil {
		return err
	}
	defer closeConn()
	e := &mounter.Executor{RemoveMountPoint: *removeMountPoint}
	return unmountAndRelease(ctx, np, e, *volumeID, cf.consumer())
}

func runServe(ctx context.Context, args []string) error {
	fs := newFlagSet("serve")
	ep := fs.String("endpoint", "", "where to serve the mounter, unix:///path (required)")
	nf := addNodeFlags(fs)
	// Off by default: the plugin removes kubelet's target_path itself after
	// an unpublish, and a re-attach that heals a container must not delete
	// and recreate the container's own mount-point directory.
	fs.BoolVar(&nf.removeMountPoint, "remove-mount-point", false,
		"Unmount removes the mount point afterwards (rmdir or unlink, never recursive)")
	fs.StringVar(&nf.kubeletDir, "kubelet-dir", config.DefaultKubeletDir,
		"kubelet's root directory: plans for the mounter's own namespace (kubelet's publishes) are performed only below it")
	fs.StringVar(&nf.daemonCgroup, "daemon-cgroup", mounter.CgroupSelf,
		`where each FUSE daemon gets a cgroup v2 of its own with its profile's resources: "self" (below the mounter's own cgroup, which it then leaves for <own>/mounter), a cgroup directory, or "" (none: daemons run in the mounter's cgroup, limits not enforced)`)
	fs.StringVar(&nf.hostCgroupFS, "host-cgroupfs", "",
		`the host's cgroup file system (its /sys/fs/cgroup, mounted whole and writable): each FUSE daemon then gets a cgroup of its own below its roots (<hierarchy>/mountplan-daemons/<instance>/...), outside the mounter's container, so that the mounter's restart or rollout leaves it serving; "" (the default): --daemon-cgroup`)
	hf := addNRIFlags(fs)
	rf := addRegistrationFlags(fs)
	if err := parse(fs, args, "endpoint"); err != nil {
		return err
	}
	opts, err := nf.options()
	if err != nil {
		return err
	}
	if _, _, _, err := rf.options(hf.pluginEndpoint); err != nil {
		return err
	}
	// The socket's caller is the plugin, whose word names no consumer the
	// mounter enters and no mount it removes (mounter.Options.Attributed).
	opts.Attributed = true
	logger := klog.Background().WithName("mounter")
	if _, err := preflight.Start(logger, preflight.Options{Mounts: true, Tools: preflight.ProfileTools(opts.Config.FuseProfiles)}); err != nil {
		return err
	}
	if err := mountns.Supported(); err != nil {
		return err // CAP_SYS_ADMIN, which preflight does not look at
	}
	raiseFileLimit()
	ctx = klog.NewContext(ctx, logger)
	node, err := mounter.NewNode(ctx, opts)
	if err != nil {
		return err
	}
	defer node.Close()
	if p, err := endpoint.Path(*ep); err == nil {
		if err := privateSocketDir(logger, p); err != nil {
			return err
		}
	}
	l, err := endpoint.Listen(*ep)
	if err != nil {
		return err
	}
	logger.Info("Serving", "endpoint", *ep, "stateDir", opts.StateDir, "recordsDir", opts.RecordsDir, "kubeletDir", opts.KubeletDir)
	waitNRI, err := hf.start(ctx, node, opts.StateDir, opts.KubeletDir)
	if err != nil {
		l.Close()
		return err
	}
	defer waitNRI()
	// kubelet's calls reach the plugin, whose work needs the mounter's
	// socket: it listens before the registration starts.
	stopRegistration, err := rf.start(ctx, hf.pluginEndpoint)
	if err != nil {
		l.Close()
		return err
	}
	defer stopRegistration()
	// Records of consumer namespaces that are gone (a container whose stop
	// the hook did not see, an admin's consumer that exited) go now and then.
	pctx, stopPrune := context.WithCancel(ctx)
	pruned := make(chan struct{})
	go func() {
		defer close(pruned)
		periodic.Every(pctx, pruneEvery, func(ctx context.Context) bool {
			node.Prune(ctx)
			return true
		})
	}()
	defer func() { stopPrune(); <-pruned }() // before node.Close, deferred earlier
	s := service.NewServer(logger, node)
	// With the plugin's socket at hand, only the plugin's processes are
	// served, not any process of its uid (internal/peer).
	if p, err := endpoint.Path(hf.pluginEndpoint); err == nil && hf.pluginEndpoint != "" {
		// Its own namespace too: kubelet's liveness probe runs
		// `mountplan-sidecar probe` in this container (runProbe).
		pp := peer.NewPlugin(p)
		pp.Own = true
		s.AllowPeer = pp.Allow
		logger.Info("Serving the plugin's processes only", "pluginSocket", p)
	}
	err = s.Serve(ctx, l)
	logger.Info("Stopped", "err", err)
	return err
}

// pruneEvery is how often serve drops the records of consumer namespaces
// that are gone: each costs a look through /proc.
const pruneEvery = time.Minute

// raiseFileLimit makes room for one open file per loop device the mounter
// holds (internal/fdlimit) and says how much room there is.
func raiseFileLimit() {
	lim, err := fdlimit.Raise(fdlimit.Want)
	if err != nil {
		klog.ErrorS(err, "Cannot raise the open file limit: it bounds the number of loop devices the mounter holds (one open file each)", "soft", lim.Cur, "hard", lim.Max)
		return
	}
	klog.V(2).InfoS("Open file limit", "soft", lim.Cur, "hard", lim.Max)
}

// warnDeprecated logs that a deprecated flag was given, and its new name.
func warnDeprecated(msg string) { klog.Warning(msg) }

// dialPlugin connects to the plugin's NodePrepare service.
func dialPlugin(ep string) (api.NodePrepareClient, func(), error) {
	conn, err := endpoint.Dial(ep)
	if err != nil {
		return nil, nil, err
	}
	return api.NewNodePrepareClient(conn), func() { conn.Close() }, nil
}

// parse parses args and checks that the required flags were given.
func parse(fs *flag.FlagSet, args []string, required ...string) error {
	if err := fs.Parse(args); errors.Is(err, flag.ErrHelp) {
		return err
	} else if err != nil {
		return fmt.Errorf("%w: %w", err, errUsage) // flag has printed the flags
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q: %w", fs.Args(), errUsage)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for _, name := range required {
		if !set[name] {
			return fmt.Errorf("--%s is required: %w", name, errUsage)
		}
	}
	return nil
}

// privateSocketDir makes the socket's directory mode 0700 when it is a
// directory of its own (empty, or holding only an earlier socket of this
// name): only root reaches it then (docs/threat-model.md), where a
// hostPath that kubelet made is 0755. A directory shared with other files
// (/run, given by hand) is left as it is: the socket itself is 0600 and
// its callers' uid is checked.
func privateSocketDir(logger klog.Logger, socket string) error {
	dir := filepath.Dir(socket)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	fi, err := os.Stat(dir)
	if err != nil || fi.Mode().Perm() == 0o700 {
		return err
	}
	names, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range names {
		if e.Name() != filepath.Base(socket) {
			logger.Info("The socket's directory holds other files: its mode is left as it is", "dir", dir, "mode", fi.Mode().Perm())
			return nil
		}
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return err
	}
	logger.Info("Made the socket's directory mode 0700", "dir", dir, "was", fi.Mode().Perm())
	return nil
}
