package e2e

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/test/testutil"
)

// TestPluginCreateFormats: a volume asked for with mount access gets its
// filesystem at CreateVolume (recorded as done), so its first stage neither
// probes nor formats; stage after stage it keeps that filesystem (same
// UUID) and its files. A volume asked for as a raw block device gets a
// blank image.
func TestPluginCreateFormats(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	testutil.RequireCommands(t, "blkid", "mkfs.ext4", "mkfs.xfs")
	e := startEnv(t, envOptions{})
	probe := func(img, tag string) string {
		out, _ := exec.Command("blkid", "-p", "-s", tag, "-o", "value", img).Output()
		return strings.TrimSpace(string(out))
	}
	for _, tc := range []struct {
		fsType string
		size   int64
	}{{"ext4", 32 * miB}, {"xfs", 300 * miB}} {
		t.Run(tc.fsType, func(t *testing.T) {
			e := e.with(t)
			id := "create-format-" + tc.fsType
			e.create(id, tc.fsType, tc.size)
			img := e.image(id)
			if f := e.mustRecord(id).Format; f == nil || !f.Done || f.FsType != tc.fsType {
				t.Fatalf("record format after CreateVolume: %+v, want %s done", f, tc.fsType)
			}
			uuid := probe(img, "UUID")
			if got := probe(img, "TYPE"); got != tc.fsType || uuid == "" {
				t.Fatalf("image after CreateVolume holds %q (UUID %q), want %s", got, uuid, tc.fsType)
			}
			c := mountCap(tc.fsType, rwo)
			for round := range 2 {
				e.stage(id, c, nil)
				target := e.target(id, "mnt")
				e.publish(id, target, c, false, nil)
				if round == 0 {
					plugWriteFile(t, filepath.Join(target, "f"), "kept\n")
				} else if got := plugReadFile(t, filepath.Join(target, "f")); got != "kept\n" {
					t.Errorf("stage %d: the file holds %q", round+1, got)
				}
				e.unpublish(id, target)
				e.unstage(id)
				waitNoLoop(t, img)
				if got := probe(img, "UUID"); got != uuid {
					t.Fatalf("stage %d: the filesystem was made again: UUID %s, was %s", round+1, got, uuid)
				}
			}
			e.delete(id)
		})
	}

	id := "create-format-block"
	e.createFor(id, 32*miB, blockCap(rwo))
	if f := e.mustRecord(id).Format; f != nil {
		t.Errorf("a block volume's record has a format: %+v", f)
	}
	if got := probe(e.image(id), "TYPE"); got != "" {
		t.Errorf("a block volume's image holds %q, want nothing", got)
	}
	e.delete(id)
}
