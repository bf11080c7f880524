package mounter

// SetHostNS has the test play the host with the namespace file p (a
// /proc/PID/ns/mnt) and returns a function that restores the real one.
func SetHostNS(p string) (restore func()) {
	old := hostNS
	hostNS = p
	return func() { hostNS = old }
}
