package loop

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fsutil"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/loopdev"
	"github.com/mountplan/mountplan/pkg/plan"
)

// CreateImage makes a sparse image of size bytes at path. It is created
// under a temp name, synced, renamed and the directory synced, so a crash
// never leaves a short image under the final name and a created image
// survives a machine crash before the caller records it. An existing image
// is left as it is.
func CreateImage(path string, size int64) error {
	if _, err := os.Stat(path); err == nil {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	return fsutil.CreateAtomic(path, 0o600, true, func(f *os.File) error {
		if err := f.Truncate(size); err != nil {
			return fmt.Errorf("size image %s: %w", path, err)
		}
		return nil
	})
}

// GrowImage extends the image to size; it never shrinks one. The new size
// is synced before it returns, so the caller may record it durably.
func GrowImage(path string, size int64) (err error) {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() >= size {
		return nil
	}
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("grow image %s: %w", path, err)
	}
	return f.Sync()
}

// RemoveImage deletes an image; a missing one is not an error.
func RemoveImage(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// ResolveStaticImage checks a static volume's image attribute: a clean
// absolute path to a regular file that lies, after resolving symlinks,
// under one of the admin's roots.
func ResolveStaticImage(image string, roots []string) (string, error) {
	if len(roots) == 0 {
		return "", fmt.Errorf("static images are disabled: the admin config allows no imageRoots: %w", errdefs.ErrInvalidArgument)
	}
	if !filepath.IsAbs(image) || filepath.Clean(image) != image {
		return "", fmt.Errorf("image %q must be a clean absolute path: %w", image, errdefs.ErrInvalidArgument)
	}
	real, inside, err := plan.ResolveUnder(image, roots)
	if err != nil {
		return "", fmt.Errorf("image %w", err)
	}
	if !inside {
		return "", fmt.Errorf("image %s is outside the allowed image roots: %w", image, errdefs.ErrInvalidArgument)
	}
	if fi, err := os.Stat(real); err != nil || !fi.Mode().IsRegular() {
		return "", fmt.Errorf("image %s is not a regular file: %w", image, errdefs.ErrInvalidArgument)
	}
	return real, nil
}

// ImagePath is where a provisioned or ephemeral volume's image lives.
func ImagePath(stateDir string, kind journal.Kind, id string) string {
	return filepath.Join(stateDir, "images", string(kind), id+".img")
}

// TempImages lists, by volume ID, the temp files of image creations that a
// crash interrupted (provisioned, ephemeral and scratch images; see
// CreateImage). Only a caller that holds the volume's lock may remove them.
func TempImages(stateDir string) (map[string][]string, error) {
	out := map[string][]string{}
	for _, dir := range []string{string(journal.KindProvisioned), string(journal.KindEphemeral), "scratch"} {
		temps, err := fsutil.AtomicTemps(filepath.Join(stateDir, "images", dir))
		if err != nil {
			return nil, err
		}
		for name, paths := range temps {
			if id, ok := strings.CutSuffix(name, ".img"); ok {
				out[id] = append(out[id], paths...)
			}
		}
	}
	return out, nil
}

// AttachedDevices lists the loop devices still backed by image, whoever
// attached them (a leaked mount elsewhere, an admin's losetup). An image
// that does not exist has none.
func AttachedDevices(image string) ([]string, error) {
	devs, err := loopdev.FindByBacking(image)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	paths := make([]string, 0, len(devs))
	for _, d := range devs {
		paths = append(paths, d.Path)
		_ = d.Close()
	}
	return paths, nil
}
