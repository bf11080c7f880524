package mounter

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/pkg/plan"
)

// The mounter trusts only what it set up itself: a plan may name a block
// device only if the mounter attached, connected or logged it in, and
// bind only a mount the mounter made (or a directory that carries none).
// These records say what that is. They live in a directory only the
// mounter writes and survive its restarts; each carries the boot it was
// made in, since a reboot undoes everything they describe.

// loopRecord is a loop device the mounter attached.
type loopRecord struct {
	Device    string           `json:"device"` // /dev/loopN
	Identity  loopdev.Identity `json:"identity"`
	Image     string           `json:"image"`
	ReadOnly  bool             `json:"readOnly,omitempty"`
	DirectIO  bool             `json:"directIO,omitempty"`
	BlockSize uint32           `json:"blockSize,omitempty"`
	Attached  time.Time        `json:"attached"`
	Boot      string           `json:"boot"`
}

// mountRecord is a mount the mounter made below the state dir (a chain's
// layer, the NRI guard) or that a daemon it started made (a FUSE mount).
type mountRecord struct {
	Path string `json:"path"`
	// MountID is the kernel's mount ID: 64-bit and never reused when
	// Unique (STATX_MNT_ID_UNIQUE, Linux 6.8+), else the reusable 32-bit
	// one, then checked with Dev too.
	MountID uint64 `json:"mountID"`
	Unique  bool   `json:"unique,omitempty"`
	Dev     uint64 `json:"dev"`
	// Ino is the mount's root inode. Mount IDs are those of one mount
	// namespace (a restarted mounter's container is a new one, and so is
	// a one-shot command's); the filesystem and its root are not: a
	// record is taken back (current) where they are found at its path.
	Ino  uint64 `json:"ino,omitempty"`
	Kind string `json:"kind"`
	Boot string `json:"boot"`
}

// The kinds of mounts recorded: the ones a plan may bind (a chain's
// layers, a FUSE daemon's mount, the NRI guard) and a volume's secrets,
// which only their daemon reads.
const (
	kindChain   = "chain"
	kindFuse    = "fuse"
	kindGuard   = "guard"
	kindSecrets = "fuse-secrets"
)

// bindable reports whether a plan may bind a mount of this kind.
func bindable(kind string) bool { return kind == kindChain || kind == kindFuse || kind == kindGuard }

// heldLoop is a recorded loop device and the descriptor that keeps it.
type heldLoop struct {
	rec loopRecord
	dev *loopdev.Device
}

type registry struct {
	boot    string
	observe bool // read only: see Options.Observe
	loopDB  *journal.Records[loopRecord]
	mntDB   *journal.Records[mountRecord]

	mu     sync.Mutex
	loops  map[uint64]*heldLoop // by dev_t
	mounts map[string]mountRecord
}

func openRegistry(dir string, observe bool) (*registry, error) {
	if !observe {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, err
		}
		// Only the mounter: the plugin (root without a capability) must not
		// read or forge what the mounter trusts.
		// (A node without CAP_CHOWN is the plugin's own: nothing to keep
		// from it.)
		if err := os.Chown(dir, fsutil.MounterUID, fsutil.MounterGID); err != nil && !errors.Is(err, fs.ErrPermission) {
			return nil, err
		}
		if err := os.Chmod(dir, 0o700); err != nil {
			return nil, err
		}
	}
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return nil, fmt.Errorf("mounter: boot id: %w", err)
	}
	r := &registry{boot: strings.TrimSpace(string(boot)), observe: observe, loops: map[uint64]*heldLoop{}, mounts: map[string]mountRecord{}}
	if observe {
		if _, err := os.Stat(dir); err != nil {
			return r, nil // nothing set up yet: nothing is trusted
		}
	}
	if r.loopDB, err = journal.OpenRecords[loopRecord](filepath.Join(dir, "loops"), false); err != nil {
		return nil, err
	}
	if r.mntDB, err = journal.OpenRecords[mountRecord](filepath.Join(dir, "mounts"), false); err != nil {
		return nil, err
	}
	return r, nil
}

func devKey(major, minor uint32) string { return fmt.Sprintf("%d-%d", major, minor) }

func pathKey(p string) string {
	sum := sha256.Sum256([]byte(p))
	return hex.EncodeToString(sum[:16])
}

// load takes back, after a restart, what the records name: a loop device
// still bound to its image is held again; one the kernel cleared when the
// last mounter died (nothing mounted it) is attached again to the same
// image at the same number when it is free, so that the plugin's records
// of it stay true; records of another boot, and of what is gone, are
// dropped.
func (r *registry) load(ctx context.Context, n *Local) error {
	log := klog.FromContext(ctx)
	if r.observe {
		return r.observeAll(n)
	}
	loops, lerr := r.loopDB.List()
	var errs []error
	for key, rec := range loops {
		if rec.Boot != r.boot {
			errs = append(errs, r.loopDB.Delete(key))
			continue
		}
		dev, err := n.restoreLoop(ctx, rec)
		if err != nil {
			log.Info("Dropping the record of a loop device that cannot be taken back", "device", rec.Identity, "image", rec.Image, "reason", err)
			errs = append(errs, r.loopDB.Delete(key))
			continue
		}
		r.loops[unix.Mkdev(rec.Identity.Major, rec.Identity.Minor)] = &heldLoop{rec: rec, dev: dev}
	}
	mounts, merr := r.mntDB.List()
	for key, rec := range mounts {
		now, ok := rec.current(n)
		if rec.Boot != r.boot || !ok {
			errs = append(errs, r.mntDB.Delete(key))
			continue
		}
		if now != rec {
			errs = append(errs, r.mntDB.Put(key, now))
		}
		r.mounts[key] = now
	}
	return errors.Join(lerr, merr, errors.Join(errs...))
}

// observeAll reads the records of this boot as they are, holding nothing.
func (r *registry) observeAll(n *Local) error {
	if r.loopDB == nil {
		return nil
	}
	loops, lerr := r.loopDB.List()
	for _, rec := range loops {
		if rec.Boot == r.boot {
			r.loops[unix.Mkdev(rec.Identity.Major, rec.Identity.Minor)] = &heldLoop{rec: rec}
		}
	}
	mounts, merr := r.mntDB.List()
	for key, rec := range mounts {
		if now, ok := rec.current(n); ok && rec.Boot == r.boot {
			r.mounts[key] = now
		}
	}
	return errors.Join(lerr, merr)
}

// addLoop records and holds a device the mounter attached.
func (r *registry) addLoop(rec loopRecord, dev *loopdev.Device) error {
	rec.Boot = r.boot
	if err := r.loopDB.Put(devKey(rec.Identity.Major, rec.Identity.Minor), rec); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	k := unix.Mkdev(rec.Identity.Major, rec.Identity.Minor)
	if old := r.loops[k]; old != nil && old.dev != dev {
		_ = old.dev.Close()
	}
	r.loops[k] = &heldLoop{rec: rec, dev: dev}
	return nil
}

// loop returns the held device of id; nil when the mounter has no such
// record (or one of another binding at that number).
func (r *registry) loop(id loopdev.Identity) *heldLoop {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := r.loops[unix.Mkdev(id.Major, id.Minor)]
	if h == nil || h.rec.Identity != id || h.dev == nil {
		return nil
	}
	return h
}

// loopByDev returns the held device with device number rdev, or nil.
func (r *registry) loopByDev(rdev uint64) *heldLoop {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.loops[rdev]
}

// dropLoop forgets id's record; the caller has detached or released it.
func (r *registry) dropLoop(id loopdev.Identity) error {
	r.mu.Lock()
	k := unix.Mkdev(id.Major, id.Minor)
	if h := r.loops[k]; h != nil && h.rec.Identity == id {
		delete(r.loops, k)
	}
	r.mu.Unlock()
	return r.loopDB.Delete(devKey(id.Major, id.Minor))
}

// heldLoops lists the held devices.
func (r *registry) heldLoops() []*heldLoop {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*heldLoop, 0, len(r.loops))
	for _, h := range r.loops {
		out = append(out, h)
	}
	return out
}

// loopCount is how many loop devices are held, with no copy of them.
func (r *registry) loopCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.loops)
}

func (r *registry) closeLoops() {
	for _, h := range r.heldLoops() {
		if h.dev != nil {
			_ = h.dev.Close()
		}
	}
}

// addMount records the mount whose root f is (at p, as the mounter's
// namespace sees it).
func (r *registry) addMount(kind, p string, f *os.File) error {
	rec, err := mountOf(f)
	if err != nil {
		return err
	}
	rec.Path, rec.Kind, rec.Boot = p, kind, r.boot
	key := pathKey(p)
	if err := r.mntDB.Put(key, rec); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.mounts[key] = rec
	return nil
}

// dropMount forgets the mount recorded at p.
func (r *registry) dropMount(p string) error {
	key := pathKey(p)
	r.mu.Lock()
	delete(r.mounts, key)
	r.mu.Unlock()
	return r.mntDB.Delete(key)
}

// RecordGuard records the NRI guard's mount root at p (a bind source
// its hook's publishes name); see guard.Recorder.
func (n *Local) RecordGuard(p string, root *os.File) error {
	if !plan.Within(n.opts.StateDir, p) {
		return fmt.Errorf("the guard at %s is not below the state dir: %w", p, errdefs.ErrInvalidArgument)
	}
	return n.records.addMount(kindGuard, p, root)
}

// ForgetGuard forgets the NRI guard recorded at p.
func (n *Local) ForgetGuard(p string) error { return n.records.dropMount(p) }

// madeMount reports whether f lies on a mount the registry holds: its
// root, or a file or directory in it (a volume's own data, as a subPath).
func (r *registry) madeMount(f *os.File) (mountRecord, bool) {
	st, unique, err := statMount(f)
	if err != nil {
		return mountRecord{}, false
	}
	got := mountRecord{MountID: st.Mnt_id, Unique: unique, Dev: unix.Mkdev(st.Dev_major, st.Dev_minor)}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rec := range r.mounts {
		if rec.sameMount(got) {
			return rec, true
		}
	}
	return mountRecord{}, false
}

// mountOf identifies the mount whose root f is; an error when f is not a
// mount's root.
func mountOf(f *os.File) (mountRecord, error) {
	st, unique, err := statMount(f)
	if err != nil {
		return mountRecord{}, err
	}
	if st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 && st.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return mountRecord{}, fmt.Errorf("%s is not the root of a mount: %w", f.Name(), errdefs.ErrFailedPrecondition)
	}
	return mountRecord{MountID: st.Mnt_id, Unique: unique, Dev: unix.Mkdev(st.Dev_major, st.Dev_minor), Ino: st.Ino}, nil
}

// statMount stats f for its mount: the unique mount ID where the kernel
// has it.
func statMount(f *os.File) (unix.Statx_t, bool, error) {
	var st unix.Statx_t
	err := unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_MNT_ID_UNIQUE|unix.STATX_INO, &st)
	if err == nil && st.Mask&unix.STATX_MNT_ID_UNIQUE != 0 {
		return st, true, nil
	}
	err = unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_MNT_ID|unix.STATX_INO, &st)
	if err != nil {
		return st, false, &os.PathError{Op: "statx", Path: f.Name(), Err: err}
	}
	return st, false, nil
}

func (m mountRecord) sameMount(got mountRecord) bool {
	return m.Unique == got.Unique && m.MountID == got.MountID && m.Dev == got.Dev
}

// current returns the record as this mount namespace sees it: the mount
// at its path (opened below the state dir without a symlink) when that is
// the root of the same filesystem, with this namespace's mount ID.
func (m mountRecord) current(n *Local) (mountRecord, bool) {
	f, err := n.state.Open(m.Path)
	if err != nil {
		return m, false
	}
	defer f.Close()
	got, err := mountOf(f)
	if err != nil || got.Dev != m.Dev || got.Ino != m.Ino {
		return m, false
	}
	m.MountID, m.Unique = got.MountID, got.Unique
	return m, true
}
