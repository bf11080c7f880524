package mounter

// OwnsISCSI exposes ownsISCSI: whether a plan may name the disk major:minor.
func (n *Local) OwnsISCSI(major, minor uint32) bool { return n.ownsISCSI(major, minor) }

// WriteAuth exposes writeAuth.
var WriteAuth = writeAuth
