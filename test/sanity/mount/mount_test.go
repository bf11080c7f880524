package mount

import (
	"testing"

	"github.com/mountplan/mountplan/test/sanity"
)

// TestSanityMountExt4 runs csi-sanity with the mount access type on ext4.
func TestSanityMountExt4(t *testing.T) { sanity.Run(t, "mount", "ext4") }
