package nri_test

import "testing"

// TestCRIO runs the hook's tests under CRI-O (v1.34, built by
// hack/tools/build.sh; conmon and runc Debian's) instead of containerd:
// the same volumes, pods and containers through CRI-O's NRI. The tests
// left out depend on containerd itself (TestNRIMounterKilled and
// TestNRIHookAbsent: what containerd does with a plugin that is gone).
func TestCRIO(t *testing.T) {
	for name, test := range map[string]func(*testing.T){
		"VolumeInContainers":         TestNRIVolumeInContainers,
		"Block":                      TestNRIBlock,
		"ChainAndFUSE":               TestNRIChainAndFUSE,
		"FSGroup":                    TestNRIFSGroup,
		"XFS":                        TestNRIXFS,
		"StatsWithContainersStopped": TestNRIStatsWithContainersStopped,
		"SubPath":                    TestNRISubPath,
		"PluginWithoutNRI":           TestNRIPluginWithoutNRI,
	} {
		t.Run(name, test)
	}
}
