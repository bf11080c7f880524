//go:build linux

package mounter_test

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mountns/mountnstest"
)

// TestOwnDirsAtStart (review of b705b24, F17): the mounter's directories of
// the state dir exist, its own, as soon as it starts: the plugin, which
// may create entries in the state dir, never gets to make fuse/ or nri/
// first and plant a volume's work/ below it.
func TestOwnDirsAtStart(t *testing.T) {
	mountnstest.RequireRoot(t)
	dir := mountnstest.Scratch(t)
	state := filepath.Join(dir, "state")
	node(t, mounter.Options{StateDir: state, KubeletDir: filepath.Join(dir, "kubelet")})
	for _, name := range []string{"fuse", "nri"} {
		st, err := os.Lstat(filepath.Join(state, name))
		if err != nil {
			t.Errorf("%s/ after the mounter's start: %v", name, err)
			continue
		}
		sys := st.Sys().(*syscall.Stat_t)
		if !st.IsDir() || sys.Uid != fsutil.MounterUID || st.Mode().Perm() != 0o755 {
			t.Errorf("%s/ is %v owned by %d, want a directory 0755 of uid %d", name, st.Mode(), sys.Uid, fsutil.MounterUID)
		}
	}
}
