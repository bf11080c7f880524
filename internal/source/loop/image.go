package loop

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/loopdev"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/periodic"
	"github.com/mountplan/mountplan/pkg/plan"
)

// CreateImage makes a sparse image of size bytes at path, with an fsType
// filesystem made on it when fsType is not empty (mkfs works on a regular
// file). It is created under a temp name, synced, renamed and the
// directory synced, so a crash never leaves a short or half-formatted
// image under the final name, a created image survives a machine crash
// before the caller records it, and its first stage needs neither a probe
// nor mkfs. made is false when the image existed already and was left as
// it is (then nothing is known of its contents).
func (s *Source) CreateImage(ctx context.Context, path string, size int64, fsType string) (made bool, err error) {
	if fsType == "" {
		return createImage(path, size, nil)
	}
	return createImage(path, size, func(tmp string) error {
		return s.Metrics.Step("format", func() error { return fsutil.FormatNewFile(ctx, tmp, fsType) })
	})
}

func createImage(path string, size int64, format func(tmp string) error) (made bool, err error) {
	if _, err := os.Stat(path); err == nil {
		return false, nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return false, err
	}
	return true, fsutil.CreateAtomic(path, 0o600, true, func(f *os.File) error {
		if err := f.Truncate(size); err != nil {
			return fmt.Errorf("size image %s: %w", path, err)
		}
		if format != nil {
			return format(f.Name())
		}
		return nil
	})
}

// GrowImage extends the image to size; it never shrinks one. The new size
// is synced before it returns, so the caller may record it durably.
func (s *Source) GrowImage(path string, size int64) (err error) {
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
func (s *Source) RemoveImage(path string) error { return removeImage(path) }

func removeImage(path string) error {
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

// ImagePath is where the image of a provisioned or inline volume lives.
func (s *Source) ImagePath(kind model.Kind, id string) string { return ImagePath(s.StateDir, kind, id) }

// ImagePath is where a provisioned or ephemeral volume's image lives under
// stateDir.
func ImagePath(stateDir string, kind model.Kind, id string) string {
	return filepath.Join(stateDir, "images", string(kind), id+".img")
}

// TempImages lists, by volume ID, the temp files of image creations that a
// crash interrupted (provisioned, ephemeral and scratch images; see
// CreateImage). Only a caller that holds the volume's lock may remove them.
func (s *Source) TempImages() (map[string][]string, error) {
	out := map[string][]string{}
	for _, dir := range []string{string(model.KindProvisioned), string(model.KindEphemeral), "scratch"} {
		temps, err := fsutil.AtomicTemps(filepath.Join(s.StateDir, "images", dir))
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

// releaseWait bounds how long RemoveDetachedImage waits for loop devices
// that are being released: the kernel unbinds an autoclear device at its
// last close, which may be another process's (a probe, a scan) shortly
// after the unstage that detached it returned.
const releaseWait = time.Second

// RemoveDetachedImage removes image unless a loop device still reads it,
// whoever attached it (a leaked mount elsewhere, an admin's losetup):
// deleting it would leave that device serving a file nobody can see or
// clean up. The check asks the kernel about the image itself
// (loopdev.WhileUnopened), so it costs the same with 10 or 10,000 loop
// devices on the node; the image is removed while the kernel still
// guarantees that nobody else has it open. A device being released is
// waited for, up to releaseWait; one that stays is named in the error
// (FailedPrecondition). An image that does not exist is no error.
func (s *Source) RemoveDetachedImage(ctx context.Context, image string) error {
	return removeDetachedImage(ctx, image, releaseWait)
}

func removeDetachedImage(ctx context.Context, image string, grace time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, grace)
	defer cancel()
	done := false // an answer other than "open elsewhere"
	err := periodic.Backoff(time.Millisecond, 50*time.Millisecond).DelayFunc().Until(ctx, true, true, func(context.Context) (bool, error) {
		err := loopdev.WhileUnopened(image, func() error { return removeImage(image) })
		switch {
		case errors.Is(err, loopdev.ErrOpenElsewhere):
			return false, nil // a device being released, maybe: again
		case errors.Is(err, errdefs.ErrNotFound):
			err = nil
		case errors.Is(err, errdefs.ErrUnimplemented):
			err = removeUnlessAttached(image) // no lease here: walk the devices
		}
		done = true
		return true, err
	})
	if !done {
		// Only now, on the way to an error, name the devices: held by
		// something that is no loop device, the image may go.
		return removeUnlessAttached(image)
	}
	return err
}

// removeUnlessAttached removes image unless loopdev.FindByBacking finds a
// loop device bound to it. It opens every bound loop device of the node.
func removeUnlessAttached(image string) error {
	devs, err := AttachedDevices(image)
	if err != nil {
		return err
	}
	if len(devs) > 0 {
		return fmt.Errorf("image %s is still attached to %s: %w", image, strings.Join(devs, ", "), errdefs.ErrFailedPrecondition)
	}
	return removeImage(image)
}

// AttachedDevices lists the loop devices still backed by image, whoever
// attached them (a leaked mount elsewhere, an admin's losetup). An image
// that does not exist has none. It opens every bound loop device of the
// node: for error messages and for filesystems without leases.
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
