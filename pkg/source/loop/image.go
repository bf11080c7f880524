package loop

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/loopdev"
	"github.com/mountplan/mountplan/pkg/plan"
)

// CreateImage makes a sparse image of size bytes at path. It is written
// under a temp name and renamed, so a crash never leaves a short image
// under the final name. An existing image is left as it is.
func CreateImage(path string, size int64) (err error) {
	if _, err := os.Stat(path); err == nil {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(f.Name())
		}
	}()
	if err = f.Truncate(size); err != nil {
		return fmt.Errorf("size image %s: %w", path, err)
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// GrowImage extends the image to size; it never shrinks one.
func GrowImage(path string, size int64) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if fi.Size() >= size {
		return nil
	}
	return os.Truncate(path, size)
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
	real, err := filepath.EvalSymlinks(image)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("image %s: %w", image, errdefs.ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("image %s: %w", image, errdefs.ErrInvalidArgument)
	}
	for _, r := range roots {
		rr, err := filepath.EvalSymlinks(r)
		if err != nil {
			continue
		}
		if plan.Within(rr, real) && real != rr {
			fi, err := os.Stat(real)
			if err != nil || !fi.Mode().IsRegular() {
				return "", fmt.Errorf("image %s is not a regular file: %w", image, errdefs.ErrInvalidArgument)
			}
			return real, nil
		}
	}
	return "", fmt.Errorf("image %s is outside the allowed image roots: %w", image, errdefs.ErrInvalidArgument)
}

// ImagePath is where a provisioned or ephemeral volume's image lives.
func ImagePath(stateDir string, kind journal.Kind, id string) string {
	return filepath.Join(stateDir, "images", string(kind), id+".img")
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
