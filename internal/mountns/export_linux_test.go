package mountns

import "testing"

// RefuseBeneath makes ReplaceAt's mount beneath fail as on a kernel
// without it, for the rest of the test.
func RefuseBeneath(t *testing.T) {
	old := beneathFlag
	beneathFlag = 1 << 30
	t.Cleanup(func() { beneathFlag = old })
}
