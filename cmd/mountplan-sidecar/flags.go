package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("mountplan-sidecar "+name, flag.ContinueOnError)
	klog.InitFlags(fs)
	fs.SetOutput(os.Stderr)
	return fs
}

// nodeFlags configure the mounter's node: where the plugin's state dir is,
// where the mounter keeps its own records, and the admin's policy.
type nodeFlags struct {
	stateDir, recordsDir, configPath string
	allowSuidDev                     bool
	allowPropagation                 bool
	removeMountPoint                 bool
	kubeletDir                       string // serve only: the mount command serves containers
	daemonCgroup                     string // serve only: the one-shot commands run no daemons
	hostCgroupFS                     string // serve only
	maxLoops, maxNBD                 int
	chainTmpfsSize                   int64
}

func addNodeFlags(fs *flag.FlagSet) *nodeFlags {
	f := &nodeFlags{}
	fs.StringVar(&f.stateDir, "state-dir", config.DefaultStateDir,
		"the plugin's state directory: the only place the mounter mounts for the plugin (overlay chains, FUSE daemons, the NRI guard) and where its images live")
	fs.StringVar(&f.recordsDir, "records-dir", "",
		"the mounter's own records of the devices and mounts it set up: a directory the plugin cannot reach, outside the state dir (default: <state-dir>-mounter, beside it)")
	fs.StringVar(&f.configPath, "config", "", "the plugin's admin config (YAML): plan policy, image roots, FUSE profiles, iSCSI settings")
	fs.BoolVar(&f.allowSuidDev, "allow-suid-dev", false, "accept plans whose mounts lack nosuid,nodev")
	fs.BoolVar(&f.allowPropagation, "allow-propagation", false,
		"attach under a shared mount even if its mount events reach the mounter's or the host's namespace")
	fs.IntVar(&f.maxLoops, "max-loop-devices", mounter.DefaultMaxLoops, "the most loop devices the mounter holds at once; an attach past it is refused")
	fs.IntVar(&f.maxNBD, "max-nbd-devices", 0, "the most NBD devices the mounter has connected at once; a connect past it is refused (0: the nbd module's nbds_max)")
	fs.Int64Var(&f.chainTmpfsSize, "chain-tmpfs-size", mounter.DefaultChainTmpfsSize,
		"the size in bytes of an overlay chain's tmpfs upper layer (a volume that needs more asks for a scratch device with upperSize)")
	return f
}

// options returns the node's options: the plugin's own policy when its
// config is given; --allow-suid-dev can only widen it.
func (f *nodeFlags) options() (mounter.Options, error) {
	if !filepath.IsAbs(f.stateDir) {
		return mounter.Options{}, fmt.Errorf("--state-dir %q must be an absolute path: %w", f.stateDir, errUsage)
	}
	cfg := &config.Config{}
	if f.configPath != "" {
		var err error
		if cfg, err = config.Load(f.configPath); err != nil {
			return mounter.Options{}, err
		}
	}
	if f.allowSuidDev {
		cfg.MountPolicy.AllowSuidDev = true
	}
	state := filepath.Clean(f.stateDir)
	records := filepath.Clean(f.recordsDir)
	if f.recordsDir == "" {
		records = mounter.DefaultRecordsDir(state)
	}
	// The plugin owns what it puts in the state dir and could rename the
	// records away or forge them there.
	if !filepath.IsAbs(records) || plan.Within(state, records) || plan.Within(records, state) {
		return mounter.Options{}, fmt.Errorf("--records-dir %q must be an absolute path outside --state-dir %s (and not holding it): %w", f.recordsDir, state, errUsage)
	}
	return mounter.Options{StateDir: state, KubeletDir: f.kubeletDir, RecordsDir: records, Config: cfg,
		RemoveMountPoint: f.removeMountPoint, AllowPropagation: f.allowPropagation, DaemonCgroup: f.daemonCgroup, HostCgroupFS: f.hostCgroupFS,
		MaxLoops: f.maxLoops, MaxNBD: f.maxNBD, ChainTmpfsSize: f.chainTmpfsSize}, nil
}

type consumerFlag struct {
	pid    int
	target string
	inode  uint64
	id     uint64
}

func consumerFlags(fs *flag.FlagSet) *consumerFlag {
	f := &consumerFlag{}
	fs.IntVar(&f.pid, "pid", 0, "a process in the consumer's mount namespace, as the host sees it (required, positive)")
	fs.StringVar(&f.target, "target", "", "mount point, absolute, as the consumer sees it (required)")
	fs.Uint64Var(&f.inode, "mnt-ns-inode", 0, "inode of the consumer's mount namespace; when set, a PID now in another namespace is refused")
	fs.Uint64Var(&f.id, "mnt-ns-id", 0, "the kernel's never-reused ID of the consumer's mount namespace (as mount printed it); "+
		"when set, a PID now in another namespace is refused, and a PID that exited is looked past to any process left in the namespace")
	return f
}

func (f *consumerFlag) consumer() plan.Consumer {
	return plan.Consumer{PID: f.pid, MountPoint: f.target, Namespace: plan.Namespace{Inode: f.inode, ID: f.id}}
}
