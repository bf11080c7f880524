package loop

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/source"
)

// imageHealth tells whether image is still the file st's device reads. An
// image removed (or replaced by another file) while the volume is staged
// leaves the device reading a file no path reaches: the volume works until
// unstage, and then what was written since is gone with the device. The
// device's identity holds the backing file's dev:ino as the kernel gave
// them at attach; a stat of the path (the plugin sees the state dir and
// the image roots) compares. A stat that fails otherwise says nothing the
// plugin can tell: normal. Both findings are DataLoss: the volume still
// answers.
func imageHealth(image string, st State) source.Health {
	if image == "" || st.Identity.BackingIno == 0 {
		return source.Health{}
	}
	var fi unix.Stat_t
	err := unix.Stat(image, &fi)
	switch {
	case errors.Is(err, unix.ENOENT):
		return source.Health{Abnormal: true, DataLoss: true, Reason: "ImageGone", Message: fmt.Sprintf(
			"the image %s was removed while %s reads it: what is written now is lost at unstage", image, st.Device)}
	case err != nil:
		return source.Health{}
	case uint64(fi.Dev) != st.Identity.BackingDev || fi.Ino != st.Identity.BackingIno: //nolint:unconvert // Dev is uint32 on some architectures
		return source.Health{Abnormal: true, DataLoss: true, Reason: "ImageReplaced", Message: fmt.Sprintf(
			"%s now names another file than the one %s reads (%d:%d, not %d:%d): what is written now is lost at unstage",
			image, st.Device, fi.Dev, fi.Ino, st.Identity.BackingDev, st.Identity.BackingIno)}
	}
	return source.Health{}
}
