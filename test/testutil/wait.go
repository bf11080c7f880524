package testutil

import "time"

// poll calls cond every interval until it returns true or timeout passes,
// and reports whether cond returned true. cond is always called at least
// once, and once more at the deadline.
func poll(timeout, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(interval)
	}
}
