package mounter

// The FUSE daemons' cgroups (internal/daemon/cgroup): each volume's daemon
// runs in <base>/daemons/<volume>, every generation of it in the same
// leaf, so that its OOM kills count on across restarts; the leaf goes
// when the volume is torn down, and a mounter that starts removes the
// empty leaves of volumes with no live daemon. Without a usable cgroup v2
// (a v1 host, a cgroup the mounter cannot write, or no --daemon-cgroup)
// daemons run in the mounter's cgroup as before, a warning says once that
// the profiles' limits are not enforced, and DaemonUsage reports them so.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/daemon/cgroup"
	"github.com/mountplan/mountplan/internal/fuseprofile"
)

// CgroupSelf (Options.DaemonCgroup) lays the daemons' cgroups out below
// the mounter's own cgroup (/proc/self/cgroup).
const CgroupSelf = "self"

// ReasonOOMKilled is DaemonStatus.Reason of a daemon the kernel killed at
// its memory limit.
const ReasonOOMKilled = "OOMKilled"

// cgroupRemoveTimeout bounds the wait for a leaf to empty after
// cgroup.kill.
const cgroupRemoveTimeout = 2 * time.Second

// daemonCgroups is the mounter's cgroup manager, or why it has none.
type daemonCgroups struct {
	m *cgroup.Manager // nil: daemons run in the mounter's cgroup
	// notEnforced says why profiles' limits are not enforced ("": they
	// are).
	notEnforced string
}

// initCgroups sets the daemons' cgroups up (Options.DaemonCgroup), warns
// once when limits will not be enforced, and removes the leaves of dead
// daemons an earlier mounter left.
func (n *Local) initCgroups(ctx context.Context) {
	log := klog.FromContext(ctx)
	c := &n.cgroups
	if fsRoot := n.opts.HostCgroupFS; fsRoot != "" {
		m, err := n.outsideCgroups(ctx, fsRoot)
		if err == nil {
			c.m, c.notEnforced = m, m.Reason()
		} else {
			log.Info("WARNING: the FUSE daemons' cgroups cannot be laid out outside the mounter's container: a stop of its container (a restart, a rollout) kills every daemon",
				"hostCgroupFS", fsRoot, "err", err.Error())
		}
	}
	switch base := n.opts.DaemonCgroup; {
	case c.m != nil:
	case base == "":
		c.notEnforced = "the mounter was started without a cgroup for its daemons (--daemon-cgroup)"
	default:
		log.Info("The FUSE daemons run below the mounter's cgroup: a stop of its container (a restart, a rollout) kills them (--host-cgroupfs keeps them)", "daemonCgroup", base)
		if base == CgroupSelf {
			base = ""
		}
		m, err := cgroup.Setup(base)
		if err != nil {
			c.notEnforced = fmt.Sprintf("no cgroup v2 for the daemons: %v", err)
			break
		}
		c.m = m
		c.notEnforced = m.Reason()
	}
	limited := n.profilesWithLimits()
	switch {
	case c.notEnforced != "" && len(limited) > 0:
		log.Info("WARNING: FUSE profiles' resource limits are NOT enforced", "reason", c.notEnforced, "profilesWithLimits", limited)
	case c.notEnforced != "":
		log.V(2).Info("FUSE daemons' resource limits could not be enforced (no profile has any)", "reason", c.notEnforced)
	default:
		log.Info("FUSE daemons run in cgroups of their own", "base", c.m.Base(), "mode", c.m.Mode(), "outsideMounter", c.m.Outside())
	}
	if c.m != nil {
		n.removeStaleCgroups(ctx)
		// A node without daemons leaves nothing in the host's cgroups;
		// the next daemon's Prepare makes the levels again.
		c.m.RemoveEmptyLevels()
	}
}

func (n *Local) profilesWithLimits() []string {
	var names []string
	for _, p := range n.opts.Config.FuseProfiles {
		if p.Resources != (fuseprofile.Resources{}) {
			names = append(names, p.Name)
		}
	}
	return names
}

// removeStaleCgroups removes each leaf that is empty and whose volume has
// no live daemon. A leaf with processes in it is left: they are not known
// to be dead, and the mounter kills nothing it does not know.
func (n *Local) removeStaleCgroups(ctx context.Context) {
	log := klog.FromContext(ctx)
	names, err := n.cgroups.m.Names()
	if err != nil {
		log.Error(err, "Cannot list the daemons' cgroups")
		return
	}
	for _, name := range names {
		rec, _ := n.daemons.get(name)
		if slices.ContainsFunc(rec.Daemons, func(r daemonRecord) bool { return r.Alive() }) {
			continue
		}
		if n.cgroups.m.Populated(name) {
			log.Info("A daemon cgroup with processes but no live daemon recorded is left alone", "cgroup", n.cgroups.m.Path(name))
			continue
		}
		if err := n.cgroups.m.Remove(ctx, name, cgroupRemoveTimeout); err != nil {
			log.Error(err, "Cannot remove a dead daemon's cgroup")
			continue
		}
		log.V(2).Info("Removed a dead daemon's cgroup", "volume", name)
	}
}

// daemonLeaf prepares the cgroup of volume id's daemon of profile and
// returns it; a zero Leaf (with Enforced false when prof asks for limits)
// without cgroups.
func (n *Local) daemonLeaf(id string, prof *fuseprofile.Profile) (cgroup.Leaf, error) {
	limits, err := prof.Resources.Limits()
	if err != nil {
		return cgroup.Leaf{}, err
	}
	if n.cgroups.m == nil {
		return cgroup.Leaf{Enforced: limits.IsZero()}, nil
	}
	leaf, err := n.cgroups.m.Prepare(id, limits)
	if err != nil {
		return leaf, fmt.Errorf("cgroup of volume %s's daemon: %w", id, err)
	}
	return leaf, nil
}

// stopCgroup kills what is left in volume id's leaf (a process that left
// the daemon's session) and, at teardown, removes the leaf.
func (n *Local) stopCgroup(ctx context.Context, id string, teardown bool) error {
	if n.cgroups.m == nil {
		return nil
	}
	if !teardown {
		return n.cgroups.m.KillProcs(ctx, id, cgroupRemoveTimeout)
	}
	return n.cgroups.m.Remove(ctx, id, cgroupRemoveTimeout)
}

// exitReason says why r, a daemon that is gone, died when its cgroup
// tells: OOMKilled when the leaf's OOM kills went up since it started.
func (n *Local) exitReason(r daemonRecord) (reason, detail string) {
	if n.cgroups.m == nil || r.Cgroup == "" {
		return "", ""
	}
	u, err := n.cgroups.m.Usage(filepath.Base(r.Cgroup))
	if err != nil || u.OOMKills <= r.OOMKills {
		return "", ""
	}
	return ReasonOOMKilled, fmt.Sprintf("fuse daemon %s was killed by the kernel's OOM killer at its memory limit (memory.max %d bytes, %d OOM kills in its cgroup since it started)",
		r.Proc, u.MemoryMax, u.OOMKills-r.OOMKills)
}

// DaemonUsage reports, for each volume with a recorded daemon, its
// profile, cgroup and what the cgroup used: read at the call (a metrics
// scrape), never polled.
func (n *Local) DaemonUsage(context.Context) ([]DaemonUsage, error) {
	if err := n.daemonsUsable(); err != nil {
		return nil, err
	}
	d := &n.daemons
	d.mu.Lock()
	var latest []daemonRecord
	var ids []string
	for id, v := range d.vols {
		if len(v.Daemons) > 0 {
			ids, latest = append(ids, id), append(latest, v.Daemons[len(v.Daemons)-1])
		}
	}
	d.mu.Unlock()
	out := make([]DaemonUsage, 0, len(ids))
	var errs []error
	for i, r := range latest {
		u := DaemonUsage{VolumeID: ids[i], Profile: r.Profile, Cgroup: r.Cgroup, LimitsEnforced: r.LimitsEnforced}
		if r.Cgroup != "" && n.cgroups.m != nil {
			cu, err := n.cgroups.m.Usage(ids[i])
			if err != nil && !errors.Is(err, fs.ErrNotExist) {
				errs = append(errs, err)
			}
			u.MemoryBytes, u.HasMemory, u.MemoryMaxBytes = cu.MemoryBytes, cu.HasMemory, cu.MemoryMax
			u.CPUUsec, u.OOMKills = cu.CPUUsec, cu.OOMKills
		}
		out = append(out, u)
	}
	slices.SortFunc(out, func(a, b DaemonUsage) int { return strings.Compare(a.VolumeID, b.VolumeID) })
	return out, errors.Join(errs...)
}

// cgroupInstance names this node's mounter below each hierarchy's
// mountplan-daemons/ (Options.HostCgroupFS): derived from the identity
// (device and inode) of its records dir, which every later mounter of the
// node finds again, so that it finds the leaves of the daemons it adopts,
// and which differs between mounters that share a host's cgroup file
// system (a test cluster's nodes). Nothing is written for it: the records
// dir holds records only.
func (n *Local) cgroupInstance() (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(n.opts.RecordsDir, &st); err != nil {
		return "", &os.PathError{Op: "stat", Path: n.opts.RecordsDir, Err: err}
	}
	sum := sha256.Sum256([]byte(fmt.Sprintf("mountplan records dir %d:%d", st.Dev, st.Ino)))
	return hex.EncodeToString(sum[:8]), nil
}

// outsideCgroups sets the daemons' cgroups up below fsRoot's hierarchies.
// The instance is the one recorded in the cgroup of a live daemon (the
// earlier mounter's, which this one adopts): were the records dir's
// identity to change without a reboot (a restored or moved directory), a
// recomputed name would orphan the adopted daemons' leaves. A live
// daemon's leaf that is not the manager's path of its volume is warned of.
func (n *Local) outsideCgroups(ctx context.Context, fsRoot string) (*cgroup.Manager, error) {
	log := klog.FromContext(ctx)
	name, err := n.cgroupInstance()
	if err != nil {
		return nil, err
	}
	fsRoot = filepath.Clean(fsRoot)
	live := n.liveCgroups()
	if inst := recordedInstance(fsRoot, live); inst != "" && inst != name {
		log.Info("WARNING: the daemons' cgroup instance recorded by the earlier mounter is not the one derived from the records dir (its device or inode changed); keeping the recorded one for the daemons it adopts",
			"recorded", inst, "derived", name)
		name = inst
	}
	m, err := cgroup.SetupOutside(fsRoot, name)
	if err != nil {
		return nil, err
	}
	for id, p := range live {
		if p != m.Path(id) {
			log.Info("WARNING: a live FUSE daemon's recorded cgroup is not under the current base: its leaf is not managed (not limited anew, not removed at teardown)",
				"volume", id, "cgroup", p, "base", m.Base())
		}
	}
	return m, nil
}

// liveCgroups are the recorded cgroups of the volumes' newest live
// daemons (from the mounter's own records: nothing of a request).
func (n *Local) liveCgroups() map[string]string {
	d := &n.daemons
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]string{}
	for id, v := range d.vols {
		for i := len(v.Daemons) - 1; i >= 0; i-- {
			if r := v.Daemons[i]; r.Cgroup != "" && r.Alive() {
				out[id] = filepath.Clean(r.Cgroup)
				break
			}
		}
	}
	return out
}

// recordedInstance is the instance of the recorded leaves below fsRoot
// (<hierarchy>/mountplan-daemons/<instance>/[daemons/]<volume>), the
// first in volume order; "" when none is.
func recordedInstance(fsRoot string, leaves map[string]string) string {
	ids := slices.Sorted(maps.Keys(leaves))
	for _, id := range ids {
		p := leaves[id]
		if filepath.Base(p) != id || !strings.HasPrefix(p, fsRoot+"/") {
			continue
		}
		dir := filepath.Dir(p)
		if filepath.Base(dir) == "daemons" && filepath.Base(filepath.Dir(filepath.Dir(dir))) == cgroup.OutsideDir {
			dir = filepath.Dir(dir)
		}
		if filepath.Base(filepath.Dir(dir)) == cgroup.OutsideDir {
			return filepath.Base(dir)
		}
	}
	return ""
}
