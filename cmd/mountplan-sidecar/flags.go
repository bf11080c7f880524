package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
)

// defaultRoot is the allowed root when no --allowed-root is given: the
// plugin's default state directory.
const defaultRoot = config.DefaultStateDir

func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("mountplan-sidecar "+name, flag.ContinueOnError)
	klog.InitFlags(fs)
	fs.SetOutput(os.Stderr)
	return fs
}

// rootsFlag is a repeatable --allowed-root; given once, it replaces the
// default.
type rootsFlag struct{ roots []string }

func (r *rootsFlag) String() string { return strings.Join(r.values(), ",") }

func (r *rootsFlag) Set(v string) error {
	if !filepath.IsAbs(v) {
		return fmt.Errorf("allowed root %q must be an absolute path", v)
	}
	r.roots = append(r.roots, filepath.Clean(v))
	return nil
}

func (r *rootsFlag) values() []string {
	if len(r.roots) == 0 {
		return []string{defaultRoot}
	}
	return r.roots
}

type execFlags struct {
	roots            rootsFlag
	allowSuidDev     bool
	allowPropagation bool
	removeMountPoint bool
	kubeletDir       string // serve only: the mount command serves containers
}

func executorFlags(fs *flag.FlagSet) *execFlags {
	f := &execFlags{}
	fs.Var(&f.roots, "allowed-root", "host directory under which a plan's bind sources and path options must lie; repeatable (default "+defaultRoot+")")
	fs.BoolVar(&f.allowSuidDev, "allow-suid-dev", false, "accept plans whose mounts lack nosuid,nodev")
	fs.BoolVar(&f.allowPropagation, "allow-propagation", false,
		"attach under a shared mount even if its mount events reach the mounter's or the host's namespace")
	return f
}

// executor checks plans against the plugin's own policy when its config is
// given (types, suid/dev), under this mounter's roots; --allow-suid-dev can
// only widen it.
func (f *execFlags) executor(cfg *config.Config) *mounter.Executor {
	if cfg == nil {
		cfg = &config.Config{}
	}
	policy := cfg.PlanPolicy(f.roots.values()...)
	policy.AllowSuidDev = policy.AllowSuidDev || f.allowSuidDev
	return &mounter.Executor{
		Policy:           policy,
		KubeletDir:       f.kubeletDir,
		RemoveMountPoint: f.removeMountPoint,
		AllowPropagation: f.allowPropagation,
	}
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
