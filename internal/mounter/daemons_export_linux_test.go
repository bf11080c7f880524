package mounter

// SetMaxDaemonVolumes bounds the volumes a node runs daemons for and
// returns a function that restores the bound.
func SetMaxDaemonVolumes(max int) (restore func()) {
	old := maxDaemonVolumes
	maxDaemonVolumes = max
	return func() { maxDaemonVolumes = old }
}

// ReadMountTablesOnly makes the propagation check read the mount tables as
// on a kernel without statmount(2), and returns a function that restores
// it.
func ReadMountTablesOnly() (restore func()) {
	old := noStatmount.Swap(true)
	return func() { noStatmount.Store(old) }
}
