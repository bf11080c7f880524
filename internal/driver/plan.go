package driver

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/pkg/plan"
)

// planFor asks v's source for a plan and checks it against the policy and
// the CO's mount flags against what each mount may take.
func (d *Driver) planFor(v *model.Volume, req source.PlanRequest) ([]plan.Mount, error) {
	src, err := d.sourceOf(v)
	if err != nil {
		return nil, err
	}
	if req.MountFlags, err = withContext(v, req.MountFlags); err != nil {
		return nil, err
	}
	mounts, err := src.Plan(viewOf(v), req)
	if err != nil {
		return nil, err
	}
	if err := checkMountFlags(mounts, req.MountFlags); err != nil {
		return nil, err
	}
	if err := d.policy.Validate(mounts); err != nil {
		return nil, err
	}
	return mounts, nil
}

// withContext returns flags with v's SELinux label: the stage's, which a
// publish or prepare may repeat but not change. Kubelet sends the pod's
// label at NodeStageVolume and again at every NodePublishVolume, and
// never two labels for one staged volume (it keeps pods of another label
// off it); a request that does breaks that contract. The kernel would
// refuse a second label on a device's superblock, and a bind (FUSE, a
// chain) shows the stage's label whatever it is asked: refused here,
// naming both, instead of one pod getting files labelled for another. A
// request without a label gets the stage's: one superblock, one label.
func withContext(v *model.Volume, flags []string) ([]string, error) {
	if v.Stage == nil {
		return flags, nil
	}
	asked, err := plan.ContextOf(flags)
	if err != nil {
		return nil, err
	}
	staged := v.Stage.SELinuxContext
	switch {
	case asked == staged:
		return flags, nil
	case asked == "":
		return append(slices.Clone(flags), plan.ContextOption(staged)), nil
	case staged == "":
		return nil, fmt.Errorf("volume %s was staged without an SELinux context and is asked for %q: kubelet sends the same context= at NodeStageVolume and NodePublishVolume; unstage the volume and stage it with the context: %w",
			v.ID, asked, errdefs.ErrFailedPrecondition)
	default:
		return nil, fmt.Errorf("volume %s is staged with SELinux context %q and is asked for %q: one volume's mounts carry one label; a pod of another label needs the volume unstaged first: %w",
			v.ID, staged, asked, errdefs.ErrFailedPrecondition)
	}
}

// The mount options a CO may ask for (a PV's mountOptions, a
// StorageClass's). They reach the kernel as they are, so only what cannot
// hurt the node is accepted: generic flags for every type, and per
// filesystem the data options that tune it. errors=panic (a filesystem
// error panics the node), noload/norecovery (mount a dirty journal
// without replaying it), dax, quotas, resuid and anything unknown are
// refused.
var (
	// genericFlags apply to every mount, a bind too. suid and dev are the
	// policy's to allow, never the CO's.
	genericFlags = []string{"ro", "rw", "noexec", "exec", "noatime", "atime", "relatime", "strictatime",
		"nodiratime", "diratime", "lazytime", "nolazytime", "sync", "async", "dirsync", "nosymfollow", "nosuid", "nodev"}

	number   = `[0-9]{1,9}`
	byteSize = `[0-9]{1,9}[kmgKMG]?`

	// dataOptions are whole-string patterns per filesystem type.
	dataOptions = map[string]*regexp.Regexp{
		"ext4": anchored("discard", "nodiscard", "errors=(remount-ro|continue)", "data=(ordered|writeback|journal)",
			"commit="+number, "barrier", "nobarrier", "barrier=[01]", "journal_checksum", "nojournal_checksum",
			"auto_da_alloc", "noauto_da_alloc", "delalloc", "nodelalloc", "dioread_nolock", "dioread_lock",
			"init_itable="+number, "noinit_itable", "max_batch_time="+number, "min_batch_time="+number,
			"stripe="+number, "user_xattr", "nouser_xattr", "acl", "noacl", "i_version", "inode_readahead_blks="+number),
		"xfs": anchored("discard", "nodiscard", "inode32", "inode64", "largeio", "nolargeio", "noalign",
			"allocsize="+byteSize, "logbufs="+number, "logbsize="+byteSize, "swalloc", "wsync", "filestreams", "attr2", "noattr2"),
		"btrfs": anchored("discard", "discard=(sync|async)", "nodiscard", "ssd", "nossd", "ssd_spread", "nossd_spread",
			"autodefrag", "noautodefrag", "commit="+number, "compress", "compress=(zlib|lzo|zstd|no)(:[0-9]{1,2})?",
			"compress-force", "compress-force=(zlib|lzo|zstd)(:[0-9]{1,2})?", "flushoncommit", "noflushoncommit",
			"space_cache=v2", "datasum", "nodatasum", "datacow", "nodatacow"),
	}
)

func anchored(alts ...string) *regexp.Regexp {
	return regexp.MustCompile(`^(` + strings.Join(alts, "|") + `)$`)
}

// checkMountFlags refuses a CO mount flag that a mount of the plan carries
// but may not take: it must be generic or a data option of that mount's
// filesystem (a bind or an overlay takes generic flags only).
func checkMountFlags(mounts []plan.Mount, flags []string) error {
	for _, f := range flags {
		if slices.Contains(genericFlags, f) || plan.IsContext(f) {
			// A context= flag was checked with the capability; it
			// reaches only mounts that make a superblock (withContext).
			continue
		}
		for _, m := range mounts {
			if !slices.Contains(m.Options, f) {
				continue
			}
			if re := dataOptions[m.Type]; re == nil || !re.MatchString(f) {
				return invalid("mount option %q is not allowed for a %s mount (allowed: %s, and the %s data options listed in docs/usage.md)",
					f, m.Type, strings.Join(genericFlags, ", "), m.Type)
			}
		}
	}
	return nil
}

// applyMountGroup gives v's filesystem to the capability's mount group
// through a private mount of its plan that the mounter makes and drops:
// the same whether kubelet's target holds the volume (published the
// classic way) or a guard (NRI mode).
//
// VOLUME_MOUNT_GROUP: kubelet hands a pod's fsGroup to the driver
// (volume_capability.mount.volume_mount_group) instead of changing the
// ownership of the published directory itself. That matters in NRI mode,
// where kubelet would only reach the guard: the driver has the mounter give
// the volume's filesystem to the group, as kubelet would, at publish time.
func (d *Driver) applyMountGroup(ctx context.Context, v *model.Volume, c capability, readOnly bool) error {
	if _, owns := d.sources[v.Type].(source.FileOwner); !c.mountGroupSet || c.block || readOnly || owns {
		return nil
	}
	mounts, err := d.planFor(v, source.PlanRequest{MountFlags: c.mountFlags})
	if err != nil {
		return err
	}
	if err := d.node.ApplyGroup(ctx, mounts, c.mountGroup); err != nil {
		return fmt.Errorf("giving volume %s to group %d (fsGroup): %w", v.ID, c.mountGroup, err)
	}
	klog.FromContext(ctx).V(2).Info("Applied the mount group", "volume", v.ID, "gid", c.mountGroup)
	return nil
}

// mayStillMount reports whether a failed Mount call may still have its
// effect: the call's time ran out while the mounter may still be at work.
// A mounter that refused, or went away (Unavailable: its process ended,
// or it never got the call), has done what the mount table shows.
func mayStillMount(err error) bool {
	switch errdefs.Code(err) {
	case codes.DeadlineExceeded, codes.Canceled:
		return true
	}
	return false
}

// unmountTarget has the mounter remove a publish's mounts. A mount that is
// busy for a moment (a NodeGetVolumeStats statfs holds it while it looks,
// without the volume's lock) is tried again a few times, for about 300ms
// in all, before the error stands.
func (d *Driver) unmountTarget(ctx context.Context, mounts []plan.Mount, target string) error {
	var err error
	for wait := 10 * time.Millisecond; ; wait *= 2 {
		err = d.opts.Mounter.Unmount(ctx, mounts, plan.Consumer{MountPoint: target})
		if errdefs.Code(err) != codes.FailedPrecondition || wait > 160*time.Millisecond {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(wait):
		}
	}
}
