// Package fuseprofile is the admin's FUSE profiles: their definition in
// the config file, their validation, the check of a volume's parameters
// against them, and the rendering of a daemon's command line from them.
// The plugin renders a volume's command with it, and the mounter, which
// trusts no caller, renders the same command again from its own copy of
// the config (internal/fuseprofile/policy): one implementation for both.
package fuseprofile

import (
	"encoding/json"
	"fmt"
	"regexp"
	"time"

	"github.com/mountplan/mountplan/internal/daemon"
	"github.com/mountplan/mountplan/internal/daemon/cgroup"
)

// Profile is a FUSE daemon an admin allows; a volume picks one by name
// (volume_context profile=NAME) together with a source and the options the
// profile allows. Nothing a volume says can name a binary, add an argument
// or point at a host path outside the profile's source roots.
//
//	fuseProfiles:
//	- name: sshfs
//	  binary: /usr/bin/sshfs
//	  args: [-f, "{source}", "{mountpoint}", -F, /dev/null,
//	         -o, "IdentityFile={secret:sshKey}", "{options}"]
//	  source: {pattern: '[a-z_][a-z0-9_-]*@[A-Za-z0-9.-]+:[A-Za-z0-9._/~-]*'}
//	  options:
//	  - {name: port, pattern: '[0-9]{1,5}', args: [-p, "{value}"]}
//	  secrets:
//	  - {name: sshKey}
type Profile struct {
	// Name is what volumes pick: lower-case letters, digits and dashes.
	Name string `json:"name"`
	// Binary is the daemon's absolute path. It must run in the foreground
	// (the process started is the one supervised) and mount at its
	// mount point argument.
	Binary string `json:"binary"`
	// Args is the argument template, one element per argument; a
	// placeholder never splits an element. Placeholders:
	//   {source}       the volume's source (checked against Source)
	//   {mountpoint}   where the daemon mounts (required, once)
	//   {workdir}      a private, empty directory of the volume (caches)
	//   {secret:NAME}  the path of the file holding a required secret
	//   {options}      alone in its element: the arguments of the chosen
	//                  options, then ReadOnlyArgs when the volume is
	//                  read-only, then MountGroupArgs when it has a mount
	//                  group, then the arguments of the optional secrets
	//                  given (appended at the end when absent)
	Args []string `json:"args"`
	// Source says what a volume's source may be.
	Source SourceRule `json:"source"`
	// Options are the per-volume settings a volume may choose, each a
	// volume_context key of its own.
	Options []Option `json:"options,omitempty"`
	// ReadOnlyArgs are added at {options} when the volume is staged
	// read-only (the plan's bind is read-only in any case).
	ReadOnlyArgs []string `json:"readOnlyArgs,omitempty"`
	// MountGroupArgs are added at {options} when the volume is staged for
	// a pod's fsGroup (kubelet's volume_mount_group), {gid} replaced by
	// the group: the daemon gives the files to it (sshfs, squashfuse and
	// other libfuse daemons: ["-o", "gid={gid},umask=0002"]; rclone:
	// ["--gid", "{gid}", "--umask", "0002"]). Without them the group is
	// left to the daemon's own options.
	MountGroupArgs []string `json:"mountGroupArgs,omitempty"`
	// Secrets are the node-stage secrets the daemon takes. Each reaches it
	// as a file (mode 0600 in a tmpfs private to the volume) or as its
	// standard input; never on a command line or in an environment.
	Secrets []Secret `json:"secrets,omitempty"`
	// Env is the daemon's environment besides PATH. Values are literal
	// and must not hold secrets: another process can read an environment.
	Env map[string]string `json:"env,omitempty"`
	// RunAs runs the daemon as this user and group instead of root, with
	// no supplementary groups. It mounts with the Capabilities it is given
	// as ambient capabilities (a setuid fusermount3 gains nothing under
	// no_new_privs), and allow_other needs user_allow_other in
	// /etc/fuse.conf. In fd mode (FdMount) absent means FdModeUser, and
	// root is refused.
	RunAs *daemon.User `json:"runAs,omitempty"`
	// FdMount declares that the daemon takes a /dev/fd/N mount point
	// (libfuse >= 3.3: squashfuse, sshfs and other libfuse 3 daemons), and
	// turns on fd mode: the mounter opens /dev/fuse, makes the FUSE mount
	// on the volume's mnt/ itself (MountOptions) and starts the daemon
	// with the descriptor as its fd 3 and {mountpoint} rendered as
	// FdMountPoint. The daemon then only serves: it runs as RunAs (else
	// FdModeUser), never root, with no capability at all (Capabilities
	// must be absent or empty), so it works where /dev/fuse is mode 0600
	// and an exploit of it gains no privilege. False: the daemon mounts
	// by itself (as root or with Capabilities).
	FdMount bool `json:"fdMount,omitempty"`
	// MountOptions are the options of the FUSE mount the mounter makes in
	// fd mode, beyond those it always sets (nosuid, nodev, ro for a
	// read-only volume, rootmode, user_id and group_id of the daemon's
	// user, subtype the binary's name): allow_other (other users than the
	// daemon's reach the files: every consumer but that user needs it; no
	// /etc/fuse.conf is involved), default_permissions (the kernel checks
	// the files' modes), max_read=N, and the flags noexec, noatime,
	// nodiratime, relatime, strictatime, nosymfollow. Only with FdMount:
	// a daemon that mounts itself takes its options on its command line.
	MountOptions []string `json:"mountOptions,omitempty"`
	// Capabilities are all the daemon may ever have (SYS_ADMIN or
	// CAP_SYS_ADMIN): its capability bounding set, and for a daemon of a
	// RunAs user other than root its ambient set. Every daemon runs with
	// no_new_privs besides, so a setuid helper (fusermount3) gains
	// nothing. Absent: [SYS_ADMIN], what a daemon needs to mount its file
	// system; [] gives none.
	Capabilities []string `json:"capabilities,omitempty"`
	// ReadyTimeout bounds how long the FUSE mount may take to appear after
	// the daemon starts. Default 30s.
	ReadyTimeout Duration `json:"readyTimeout,omitempty"`
	// Resources limit each daemon of the profile (and its children) in
	// the cgroup of its own the mounter starts it in: memory.max (swap
	// off) and cpu.max. A daemon killed for exceeding its memory is
	// restarted like any that dies, with the reason OOMKilled; and
	// pids.max. Enforced where the mounter has cgroups for its daemons
	// (cgroup v2, or v1 with --host-cgroupfs); elsewhere the mounter warns
	// and reports them as not enforced.
	Resources Resources `json:"resources,omitzero"`
}

// Resources are Kubernetes quantities; empty: no limit.
type Resources struct {
	// Memory in bytes ("256Mi"), at least 4Mi.
	Memory string `json:"memory,omitempty"`
	// CPU in CPUs ("500m", "2"), at least 10m.
	CPU string `json:"cpu,omitempty"`
	// Pids bounds the daemon's tasks (pids.max), at least 8; absent:
	// cgroup.DefaultPids.
	Pids int64 `json:"pids,omitempty"`
}

// Limits are r parsed.
func (r Resources) Limits() (cgroup.Limits, error) {
	return cgroup.ParseLimits(r.Memory, r.CPU, r.Pids)
}

// SourceRule constrains a volume's source: either a pattern (a remote
// such as user@host:/path) or a host path under one of Roots. Every source
// is also limited to the characters letters, digits and . _ @ : / + ~ % -,
// may not start with '-', and may not hold a ".." element.
type SourceRule struct {
	// Pattern is an RE2 expression the whole source must match.
	Pattern string `json:"pattern,omitempty"`
	// Roots make the source a host path (absolute, clean) that must lie,
	// after resolving symlinks, under one of these directories.
	Roots []string `json:"roots,omitempty"`
}

// Option is one per-volume setting.
type Option struct {
	// Name is the volume_context key (letters and digits, starting with a
	// letter; not type, profile, source or fsType).
	Name string `json:"name"`
	// Values lists the accepted values, or
	Values []string `json:"values,omitempty"`
	// Pattern is an RE2 expression the whole value must match.
	Pattern string `json:"pattern,omitempty"`
	// Default is used when the volume does not set the option; empty: the
	// option's arguments are left out.
	Default string `json:"default,omitempty"`
	// Args are added at {options}; {value} is replaced by the value.
	Args []string `json:"args"`
}

// Secret is a node-stage secret key the daemon takes.
type Secret struct {
	// Name is the key in the node-stage secret and the file's name.
	Name string `json:"name"`
	// Optional secrets may be missing; their Args are then left out.
	Optional bool `json:"optional,omitempty"`
	// Stdin makes the file the daemon's standard input (at most one).
	Stdin bool `json:"stdin,omitempty"`
	// Args are added at {options} when the secret is given; {path} is
	// replaced by the file's path. Required secrets may instead be
	// referenced in the profile's Args as {secret:NAME}.
	Args []string `json:"args,omitempty"`
}

// Duration is a time.Duration written as "10s" in the config file.
type Duration struct{ time.Duration }

// UnmarshalJSON parses "1m30s" and the like.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("duration must be a string such as \"30s\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	d.Duration = v
	return nil
}

// MarshalJSON writes the duration as a string.
func (d Duration) MarshalJSON() ([]byte, error) { return json.Marshal(d.String()) }

// Fuse volume_context keys that are not options.
var ReservedKeys = []string{"type", "profile", "source", "fsType"}

var (
	fuseProfileName = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)
	fuseOptionName  = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9]{0,62}$`)
	fuseSecretName  = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$`)
	fuseEnvName     = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	fusePlaceholder = regexp.MustCompile(`\{[^{}]*\}`)
)

// Placeholders finds the placeholders ({name} or {name:arg}) in s.
func Placeholders(s string) []string { return fusePlaceholder.FindAllString(s, -1) }

// Find returns the profile of profiles called name, or nil.
func Find(profiles []Profile, name string) *Profile {
	for i := range profiles {
		if profiles[i].Name == name {
			return &profiles[i]
		}
	}
	return nil
}

// CompilePattern anchors an RE2 expression so that it must match a whole
// string.
func CompilePattern(p string) (*regexp.Regexp, error) {
	return regexp.Compile(`^(?:` + p + `)$`)
}
