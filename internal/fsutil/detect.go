package fsutil

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"strings"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// blkid -p exit codes (blkid(8)).
const (
	blkidNothing   = 2 // no signature found
	blkidAmbiguous = 8 // several signatures: refuse to guess
)

// detect probes device with blkid -p: a low-level probe of the superblocks
// themselves, no blkid cache, so an image file works like a device.
//
// What it returns after a format that did not finish:
//   - mke2fs wipes old signatures first and writes the primary superblock
//     last, so an interrupted ext4 format has no superblock: "".
//   - mkfs.xfs writes a superblock with sb_inprogress set early and clears
//     it last. blkid reports such a superblock as xfs, but the kernel will
//     never mount it; detect reports "" so that it is formatted again.
//   - A primary superblock that is zeroed or garbage: "".
//   - A valid superblock over a damaged rest (an image truncated after
//     mkfs, a corrupted field): the type. That is damage, not an unfinished
//     format, and is not ours to overwrite; the mount will fail instead.
//
// A device that holds only a partition table returns the table type
// ("dos", "gpt") so a caller never formats over it; several signatures at
// once are ErrFailedPrecondition.
func (t tools) detect(ctx context.Context, device string) (string, error) {
	if err := checkPath("detect", device); err != nil {
		return "", err
	}
	out, err := t.run(ctx, device, blkid, "-p", "-o", "export", device)
	switch code := exitCode(err); {
	case code == blkidNothing:
		return "", nil
	case code == blkidAmbiguous:
		return "", fmt.Errorf("several signatures on it, wipe them first: %w: %w", errdefs.ErrFailedPrecondition, err)
	case err != nil:
		return "", err
	}
	tags := parseExport(out)
	fsType := tags["TYPE"]
	if fsType == "" {
		return tags["PTTYPE"], nil
	}
	if fsType == XFS && xfsInProgress(device) {
		klog.FromContext(ctx).V(2).Info("xfs superblock of an unfinished mkfs, reporting no filesystem", "device", device)
		return "", nil
	}
	return fsType, nil
}

// parseExport reads blkid's "-o export" KEY=value lines.
func parseExport(out string) map[string]string {
	tags := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok {
			tags[k] = v
		}
	}
	return tags
}

// XFS on-disk superblock: magic at 0, sb_inprogress at byte 126.
const (
	xfsMagic         = "XFSB"
	xfsInProgressOff = 126
)

// xfsInProgress reports whether the primary xfs superblock says mkfs is
// still running. Any read problem answers false: the caller then keeps
// blkid's answer, the conservative one.
func xfsInProgress(device string) bool {
	f, err := os.Open(device)
	if err != nil {
		return false
	}
	defer f.Close()
	sb := make([]byte, xfsInProgressOff+1)
	if _, err := io.ReadFull(f, sb); err != nil {
		return false
	}
	return string(sb[:4]) == xfsMagic && sb[xfsInProgressOff] != 0
}
