package e2e

import (
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source/loop"
	"github.com/mountplan/mountplan/test/testutil"
)

// A crash during NodeStageVolume's attach or format leaves the record as
// the stage intent wrote it: phase "staging" and no source state yet (the
// loop device is recorded only once the stage is done; autoclear dropped
// the device with the plugin). The reconciler must undo that intent at
// start-up, so that the volume can be staged again (provisioned) or is
// removed (inline: kubelet's retry makes it anew).
func TestPluginCrashStageIntentWithoutSource(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.NoLeaks(t)
	root := startEnv(t, envOptions{})
	c := mountCap("ext4", rwo)

	t.Run("provisioned", func(t *testing.T) {
		e := root.with(t)
		const id = "vol-intent-nosource"
		e.create(id, "ext4", 32*miB)
		img := e.image(id)
		if err := e.plugin.Stop(); err != nil {
			t.Fatal(err)
		}
		e.editRecord(id, func(m map[string]any) {
			m["stage"] = map[string]any{"phase": string(model.PhaseStaging), "stagingPath": e.staging(id)}
		})
		e.restart()

		if v := e.mustRecord(id); v.Stage != nil {
			t.Errorf("after restart the record still has a stage: %+v (the reconciler did not undo the intent)", v.Stage)
		}
		e.stage(id, c, nil)
		l := e.checkStagedLoop(id, img)
		e.notMounted(l)
		target := e.target(id, "mnt")
		e.publish(id, target, c, false, nil)
		plugWriteFile(t, filepath.Join(target, "f"), "ok\n")
		e.unpublish(id, target)
		e.unstage(id)
		waitNoLoop(t, img)
		e.delete(id)
	})

	t.Run("inline", func(t *testing.T) {
		e := root.with(t)
		const id = "csi-intent-nosource"
		img := loop.ImagePath(e.stateDir(), model.KindEphemeral, id)
		if err := e.plugin.Stop(); err != nil {
			t.Fatal(err)
		}
		// What publishEphemeral leaves when the plugin dies during mkfs.
		if err := os.MkdirAll(filepath.Dir(img), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(img, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(img, 64*miB); err != nil {
			t.Fatal(err)
		}
		rec, err := json.Marshal(map[string]any{
			"id": id, "kind": string(model.KindEphemeral), "type": loop.Type, "image": img,
			"capacityBytes": 64 * miB, "fsType": "ext4",
			"format": map[string]any{"fsType": "ext4", "done": false},
			"stage":  map[string]any{"phase": string(model.PhaseStaging), "stagingPath": e.stateDir()},
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(e.recordPath(id), rec, 0o600); err != nil {
			t.Fatal(err)
		}
		e.restart()

		e.noRecord(id)
		if _, err := os.Stat(img); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("half-made inline image still there after restart: %v", err)
		}
		// kubelet retries the publish.
		target := e.target(id, "mnt")
		vctx := map[string]string{ctxEphemeral: "true", "size": "64Mi"}
		e.publish(id, target, c, false, vctx)
		plugWriteFile(t, filepath.Join(target, "f"), "ok\n")
		e.unpublish(id, target)
		waitNoLoop(t, img)
		e.noRecord(id)
	})
}
