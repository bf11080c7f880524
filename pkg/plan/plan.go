// Package plan defines the mount descriptor: the one value type the plugin
// and the mounter share. A plan is an ordered list of descriptors; the plugin
// builds and validates it, the mounter checks it again and performs it.
//
// Paths in Source and in options resolve in the plugin's (host) mount
// namespace. Target is relative to the consumer's mount point.
package plan

import (
	"errors"
	"fmt"
	"io/fs"
	"path"
	"path/filepath"
	"slices"
	"strings"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// TypeBind attaches an existing host path (a directory, a FUSE daemon's
// mount, or a device node for raw block access) instead of a new filesystem.
const TypeBind = "bind"

// Mount is one descriptor: a mount of Type from Source at Target with Options.
// It has no behaviour beyond validation: producers emit it, the mounter
// performs it.
type Mount struct {
	Type    string
	Source  string
	Target  string
	Options []string
}

func (m Mount) String() string {
	return fmt.Sprintf("%s %s on %q (%s)", m.Type, m.Source, m.Target, strings.Join(m.Options, ","))
}

// HasOption reports whether opt (a flag such as "ro") is among m's options.
func (m Mount) HasOption(opt string) bool { return slices.Contains(m.Options, opt) }

// DefaultTypes are the mount types a plan may use unless the admin narrows them.
var DefaultTypes = []string{"ext4", "xfs", "btrfs", "erofs", "squashfs", "tmpfs", TypeBind}

// Policy is what a plan may ask for. The plugin applies it when it builds a
// plan and the mounter checks it again before it performs one, so a mounter
// never trusts a plan more than its own configuration allows.
type Policy struct {
	// Types allowed; empty means DefaultTypes.
	Types []string
	// Roots under which every host path of a plan (bind sources, path-valued
	// options such as overlay's lowerdir) must lie. Device sources, and
	// binds of device nodes, must lie under /dev. Empty means no host path
	// is allowed.
	Roots []string
	// ImageRoots are where the backing file of a loop device in a plan
	// must lie. Only the mounter can check it: it asks the kernel about
	// the device itself before it mounts it. Empty: no loop device.
	ImageRoots []string
	// AllowSuidDev lets plans omit nosuid and nodev.
	AllowSuidDev bool
}

// MaxMounts bounds a plan: every plan mountplan makes has one or two
// mounts, and a mounter must not spend minutes on a hostile one.
const MaxMounts = 16

// refusedOptions are never allowed: errors=panic makes one bad block of a
// volume panic the node; noload and norecovery mount a filesystem without
// replaying its journal or log, inconsistent by design; rec (a recursive
// bind) would carry along every mount below its source, which the mounter
// neither made nor checked (another volume's secrets, a host directory
// bound there), and no plan mountplan makes needs it.
var refusedOptions = map[string]bool{"errors=panic": true, "noload": true, "norecovery": true, "rec": true}

// deviceOptions name another block device for the kernel to open beside
// the checked source, whatever their value: ext4's external journal (by
// device number or path), xfs's log and realtime devices, btrfs's member
// devices. The mounter checks the source it opens, never these.
var deviceOptions = map[string]bool{"journal_dev": true, "journal_path": true, "logdev": true, "rtdev": true, "device": true}

// HasPathOptions reports whether m has an option whose value is a host
// path (overlay's lowerdir=...).
func HasPathOptions(m Mount) bool {
	for _, o := range m.Options {
		if key, _, _ := strings.Cut(o, "="); pathOptions[key] {
			return true
		}
	}
	return false
}

// pathOptions are the option keys whose values are host paths
// (colon-separated for lowerdir).
var pathOptions = map[string]bool{"lowerdir": true, "upperdir": true, "workdir": true, "datadir": true, "lowerdir+": true}

// flagOptions are the generic mount flags; anything else is handed to the
// filesystem as a data option.
var flagOptions = map[string]bool{
	"ro": true, "rw": true, "nosuid": true, "suid": true, "nodev": true, "dev": true,
	"noexec": true, "exec": true, "noatime": true, "atime": true, "relatime": true,
	"strictatime": true, "nodiratime": true, "diratime": true, "sync": true, "async": true,
	"dirsync": true, "lazytime": true, "nosymfollow": true, "rec": true,
}

// IsFlag reports whether opt is a generic mount flag rather than a
// filesystem data option.
func IsFlag(opt string) bool { return flagOptions[opt] }

// Validate checks a whole plan against p. Errors wrap errdefs.ErrInvalidArgument.
func (p Policy) Validate(mounts []Mount) error {
	if len(mounts) == 0 {
		return fmt.Errorf("plan has no mounts: %w", errdefs.ErrInvalidArgument)
	}
	if len(mounts) > MaxMounts {
		return fmt.Errorf("plan has %d mounts, more than %d: %w", len(mounts), MaxMounts, errdefs.ErrInvalidArgument)
	}
	seen := map[string]bool{}
	for i, m := range mounts {
		if err := p.validateMount(m); err != nil {
			return fmt.Errorf("mount %d: %w", i, err)
		}
		t := path.Clean("/" + m.Target)
		if seen[t] {
			return fmt.Errorf("mount %d: duplicate target %q: %w", i, m.Target, errdefs.ErrInvalidArgument)
		}
		seen[t] = true
	}
	return nil
}

func (p Policy) validateMount(m Mount) error {
	types := p.Types
	if len(types) == 0 {
		types = DefaultTypes
	}
	if !slices.Contains(types, m.Type) {
		return fmt.Errorf("type %q is not allowed (allowed: %s): %w", m.Type, strings.Join(types, ", "), errdefs.ErrInvalidArgument)
	}
	if err := ValidateTarget(m.Target); err != nil {
		return err
	}
	if err := p.validateSource(m); err != nil {
		return err
	}
	if m.Type == TypeBind {
		if err := CheckBindOptions(m.Options); err != nil {
			return err
		}
	}
	for _, o := range m.Options {
		if err := p.validateOption(o); err != nil {
			return err
		}
	}
	if p.AllowSuidDev {
		return nil
	}
	if m.IsDeviceBind() {
		// A device node bound with nodev could not be opened: raw block
		// access needs the node usable, so only nosuid is required.
		if !m.HasOption("nosuid") {
			return fmt.Errorf("bind of device %s lacks nosuid, which policy requires: %w", m.Source, errdefs.ErrInvalidArgument)
		}
		return nil
	}
	if !m.HasOption("nosuid") || !m.HasOption("nodev") {
		return fmt.Errorf("%s mount of %s lacks nosuid,nodev, which policy requires: %w", m.Type, m.Source, errdefs.ErrInvalidArgument)
	}
	return nil
}

// IsDeviceBind reports whether m binds a device node (raw block access).
func (m Mount) IsDeviceBind() bool {
	return m.Type == TypeBind && strings.HasPrefix(m.Source, "/dev/")
}

func (p Policy) validateSource(m Mount) error {
	switch {
	case m.Type == TypeBind:
		return p.checkHostPath("bind source", m.Source)
	case m.Type == "overlay" || m.Type == "tmpfs":
		// Their source is a free-form label, but it must not look like a path.
		if strings.ContainsAny(m.Source, "/,") {
			return fmt.Errorf("%s source %q must be a plain label: %w", m.Type, m.Source, errdefs.ErrInvalidArgument)
		}
		return nil
	default:
		if !IsCleanAbs(m.Source) || !strings.HasPrefix(m.Source, "/dev/") {
			return fmt.Errorf("%s source %q must be a device under /dev: %w", m.Type, m.Source, errdefs.ErrInvalidArgument)
		}
		return nil
	}
}

// CheckOption checks one mount option against p as Validate does: one the
// mounter adds to a mount of its own (a FUSE mount in fd mode) goes
// through the same refusals as a plan's. Errors wrap
// errdefs.ErrInvalidArgument.
func (p Policy) CheckOption(o string) error { return p.validateOption(o) }

func (p Policy) validateOption(o string) error {
	if _, ok, err := ParseContext(o); ok {
		// A label, whose quoted category list may hold commas; ParseContext
		// lets nothing else through.
		return err
	}
	if o == "" || strings.ContainsAny(o, ",\x00\n") {
		return fmt.Errorf("option %q is empty or holds a separator: %w", o, errdefs.ErrInvalidArgument)
	}
	key, val, hasVal := strings.Cut(o, "=")
	if key == "source" {
		return fmt.Errorf("option %q may not set the source: %w", o, errdefs.ErrInvalidArgument)
	}
	if err := CheckLabelOption(o); err != nil {
		return err
	}
	if refusedOptions[o] {
		return fmt.Errorf("option %q is never allowed: %w", o, errdefs.ErrInvalidArgument)
	}
	if deviceOptions[key] {
		return fmt.Errorf("option %q would have the kernel open a device beside the checked source: %w", o, errdefs.ErrInvalidArgument)
	}
	if !p.AllowSuidDev && (key == "suid" || key == "dev") {
		return fmt.Errorf("option %q is not allowed by policy: %w", o, errdefs.ErrInvalidArgument)
	}
	if pathOptions[key] {
		if !hasVal {
			return fmt.Errorf("option %q needs a path: %w", o, errdefs.ErrInvalidArgument)
		}
		for _, pth := range strings.Split(val, ":") {
			if err := p.checkHostPath("option "+key, pth); err != nil {
				return err
			}
		}
		return nil
	}
	// Any other value that names a path is a way around the roots.
	if hasVal && strings.Contains(val, "/") {
		return fmt.Errorf("option %q holds a path, which only %s may: %w", o, strings.Join(sortedKeys(pathOptions), ", "), errdefs.ErrInvalidArgument)
	}
	return nil
}

func (p Policy) checkHostPath(what, pth string) error {
	if !IsCleanAbs(pth) {
		return fmt.Errorf("%s %q must be a clean absolute path: %w", what, pth, errdefs.ErrInvalidArgument)
	}
	if what == "bind source" && strings.HasPrefix(pth, "/dev/") {
		return nil // a device node for raw block access; the mounter checks the device
	}
	for _, r := range p.Roots {
		if Within(r, pth) {
			return nil
		}
	}
	return fmt.Errorf("%s %q is outside the allowed roots: %w", what, pth, errdefs.ErrInvalidArgument)
}

// ValidateTarget accepts "" or a clean relative path without "..".
func ValidateTarget(t string) error {
	if t == "" {
		return nil
	}
	if strings.HasPrefix(t, "/") || strings.ContainsRune(t, 0) || path.Clean(t) != t || t == "." ||
		slices.Contains(strings.Split(t, "/"), "..") {
		return fmt.Errorf("target %q must be a clean relative path without '..': %w", t, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Within reports whether p is root or lies below it (both clean and absolute).
func Within(root, p string) bool {
	root = filepath.Clean(root)
	if p == root {
		return true
	}
	if root == "/" {
		return strings.HasPrefix(p, "/")
	}
	return strings.HasPrefix(p, root+"/")
}

// WithinAny reports whether p is one of roots or lies below one.
func WithinAny(roots []string, p string) bool {
	return slices.ContainsFunc(roots, func(r string) bool { return Within(r, p) })
}

// IsCleanAbs reports whether p is an absolute path in the form
// filepath.Clean gives it, with no NUL byte: the only form a path from a
// request or a config is accepted in.
func IsCleanAbs(p string) bool {
	return strings.HasPrefix(p, "/") && filepath.Clean(p) == p && !strings.ContainsRune(p, 0)
}

func sortedKeys(m map[string]bool) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// ResolveUnder resolves the symlinks of p, which must exist, and reports
// whether the result lies strictly below one of roots (each resolved as
// well; a root that does not exist is skipped). Resolving first matters: a
// symlink inside a root may point anywhere. An error wraps
// errdefs.ErrNotFound when p does not exist, ErrInvalidArgument otherwise.
func ResolveUnder(p string, roots []string) (resolved string, inside bool, err error) {
	real, err := filepath.EvalSymlinks(p)
	if errors.Is(err, fs.ErrNotExist) {
		return "", false, fmt.Errorf("%s: %w", p, errdefs.ErrNotFound)
	}
	if err != nil {
		return "", false, fmt.Errorf("%s: %v: %w", p, err, errdefs.ErrInvalidArgument)
	}
	for _, rr := range RealPaths(roots) {
		if Within(rr, real) && real != rr {
			return real, true, nil
		}
	}
	return real, false, nil
}

// RealPaths returns roots with their symlinks resolved; a root that does
// not exist is left out.
func RealPaths(roots []string) []string {
	out := make([]string, 0, len(roots))
	for _, r := range roots {
		if rr, err := filepath.EvalSymlinks(r); err == nil {
			out = append(out, rr)
		}
	}
	return out
}

// CheckBindOptions refuses data options on a bind: it clones a mount and
// has no filesystem to pass them to; only mount flags apply.
func CheckBindOptions(opts []string) error {
	for _, o := range opts {
		if !IsFlag(o) {
			return fmt.Errorf("option %q does not apply to a bind: %w", o, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// Options builds a mount's options: base (nosuid, nodev, ...), ro when
// readOnly, then each of extra (the CO's mount flags) not already there.
func Options(base []string, readOnly bool, extra ...string) []string {
	opts := slices.Clone(base)
	if readOnly {
		opts = append(opts, "ro")
	}
	for _, f := range extra {
		if !slices.Contains(opts, f) {
			opts = append(opts, f)
		}
	}
	return opts
}
