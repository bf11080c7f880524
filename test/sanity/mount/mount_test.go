package mount

import (
	"testing"

	"github.com/mountplan/mountplan/test/sanity"
)

// TestSanityMount runs csi-sanity with the mount access type.
func TestSanityMount(t *testing.T) { sanity.Run(t, "mount") }
