package mounter

// Bounds returns o with the mounter's bounds set for a test: loop and
// NBD devices held at once, and a chain's tmpfs upper in bytes.
func Bounds(o Options, loops, nbds int, tmpfs int64) Options {
	o.MaxLoops, o.MaxNBD, o.ChainTmpfsSize = loops, nbds, tmpfs
	return o
}
