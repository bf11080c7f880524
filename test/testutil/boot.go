package testutil

import (
	"bytes"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/journal"
)

// EndMounterBoot makes the mounter's records under dir (what it set up)
// records of another boot, as a reboot does; it fails when none names the
// running boot.
func EndMounterBoot(t *testing.T, dir string) {
	t.Helper()
	cur, err := journal.CurrentBoot()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(p, ".json") {
			return err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if nb := bytes.ReplaceAll(b, []byte(`"boot":"`+cur+`"`), []byte(`"boot":"ended-`+cur+`"`)); !bytes.Equal(nb, b) {
			n++
			return os.WriteFile(p, nb, 0o600)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatalf("no record of the mounter's under %s names the boot", dir)
	}
}
