// Package nbdnl drives the kernel's NBD devices through the "nbd" generic
// netlink family (include/uapi/linux/nbd-netlink.h): it hands sockets that
// are already in the NBD transmission phase to the kernel (NBD_CMD_CONNECT),
// replaces dead ones (NBD_CMD_RECONFIGURE), disconnects devices and asks
// whether one is connected.
//
// It never speaks the NBD protocol itself: whoever calls Connect has done
// the handshake (internal/source/nbd Negotiate) on the socket it passes. That is
// what lets the unprivileged plugin do all the network work and the
// privileged mounter do only this, the one act that needs CAP_SYS_ADMIN.
//
// Every call opens its own netlink socket: there is no state to share, and
// a call is rare (one per stage or unstage).
package nbdnl

import "time"

// Transmission flags (include/uapi/linux/nbd.h, and the NBD protocol's
// doc/proto.md), for Config.ServerFlags.
const (
	FlagHasFlags     = 1 << 0
	FlagReadOnly     = 1 << 1
	FlagSendFlush    = 1 << 2
	FlagSendFUA      = 1 << 3
	FlagSendTrim     = 1 << 5
	FlagCanMultiConn = 1 << 8
)

// Config describes one connection of a device.
type Config struct {
	// Index is the device's number (nbdN), or -1 for any unconnected
	// device (the kernel creates one when none is free).
	Index int
	// SizeBytes is the export's size; BlockSize the device's logical
	// block size (a power of two, 512 to the page size; 0 leaves the
	// kernel's default of 1024, which suits only sizes it divides).
	SizeBytes, BlockSize uint64
	// ServerFlags are the transmission flags the handshake returned
	// (FlagHasFlags, FlagSendFlush, ...); set FlagReadOnly to connect the
	// device read-only.
	ServerFlags uint64
	// Timeout is the per-request timeout (0: the kernel's 30 s).
	// DeadConnTimeout is how long requests wait for a Reconfigure once
	// every socket is dead (0: they fail at once). Both are whole seconds
	// for the kernel; a fraction is rounded up.
	Timeout, DeadConnTimeout time.Duration
	// Backend names what the device is connected to; the kernel shows it
	// in /sys/block/nbdN/backend and demands it again on Reconfigure.
	Backend string
}
