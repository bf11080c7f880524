package driver

import (
	"regexp"
	"slices"
	"strings"

	"github.com/mountplan/mountplan/pkg/plan"
)

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
		if slices.Contains(genericFlags, f) {
			continue
		}
		for _, m := range mounts {
			if !slices.Contains(m.Options, f) {
				continue
			}
			if re := dataOptions[m.Type]; re == nil || !re.MatchString(f) {
				return invalid("mount option %q is not allowed for a %s mount (allowed: %s, and the %s data options listed in the README)",
					f, m.Type, strings.Join(genericFlags, ", "), m.Type)
			}
		}
	}
	return nil
}
