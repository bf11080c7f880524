package block

import (
	"testing"

	"github.com/mountplan/mountplan/test/sanity"
)

// TestSanityBlock runs csi-sanity with the block access type.
func TestSanityBlock(t *testing.T) { sanity.Run(t, "block", "") }
