package mounter

import "os"

// SetHostNS has the test play the host with the namespace file p (a
// /proc/PID/ns/mnt) and returns a function that restores the real one.
func SetHostNS(p string) (restore func()) {
	old := hostNS
	hostNS = p
	return func() { hostNS = old }
}

// RecordMount records the mount at p as one n made itself (kind "fuse":
// a daemon's), as StartDaemon does once the daemon's mount serves: the
// tests that play a FUSE daemon themselves start it by hand.
func RecordMount(n *Local, kind, p string) error {
	f, err := n.state.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return n.records.addMount(kind, p, f)
}

// CheckBindSource opens p as a plan's bind source would be (openBindSource).
func CheckBindSource(n *Local, p string) error {
	f, err := n.openBindSource(p)
	if err == nil {
		f.Close()
	}
	return err
}

// SharedGroupOf is sharedGroupOf: the peer group of the shared mount f lies
// on, by statmount(2).
func SharedGroupOf(f *os.File) (int, error) { return sharedGroupOf(f) }

// FuseDeviceOpenableBy is fuseDeviceOpenableBy, for TestFuseDeviceOpenableBy.
var FuseDeviceOpenableBy = fuseDeviceOpenableBy
