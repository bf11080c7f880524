package mounter

// SetMaxDaemonVolumes bounds the volumes a node runs daemons for and
// returns a function that restores the bound.
func SetMaxDaemonVolumes(max int) (restore func()) {
	old := maxDaemonVolumes
	maxDaemonVolumes = max
	return func() { maxDaemonVolumes = old }
}
