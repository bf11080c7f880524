package xfs

import (
	"testing"

	"github.com/mountplan/mountplan/test/sanity"
)

// TestSanityMountXFS runs csi-sanity with the mount access type on xfs.
func TestSanityMountXFS(t *testing.T) { sanity.Run(t, "mount", "xfs") }
