package nbdnl

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// Names and numbers of include/uapi/linux/nbd-netlink.h (x/sys/unix has
// none of them).
const (
	familyName = "nbd"

	cmdConnect     = 1
	cmdDisconnect  = 2
	cmdReconfigure = 3
	cmdStatus      = 5

	attrIndex           = 1
	attrSizeBytes       = 2
	attrBlockSizeBytes  = 3
	attrTimeout         = 4
	attrServerFlags     = 5
	attrSockets         = 7
	attrDeadConnTimeout = 8
	attrDeviceList      = 9
	attrBackend         = 10

	sockItem = 1 // NBD_SOCK_ITEM, in attrSockets
	sockFD   = 1 // NBD_SOCK_FD, in a sockItem

	deviceItem      = 1 // NBD_DEVICE_ITEM, in attrDeviceList
	deviceIndex     = 1
	deviceConnected = 2
)

// sysBlock is where the kernel shows the devices (a variable for tests).
var sysBlock = "/sys/block"

// Connect hands socks, each in the NBD transmission phase of one export,
// to the kernel as the connections of device cfg.Index and returns the
// device's number. The kernel takes its own reference to each socket, so
// the caller may close socks once Connect returns.
func Connect(cfg Config, socks []*os.File) (int, error) {
	if cfg.Index < -1 || len(socks) == 0 || cfg.SizeBytes == 0 {
		return -1, fmt.Errorf("nbdnl: connect needs an index >= -1 (%d), a socket (%d) and a size (%d): %w",
			cfg.Index, len(socks), cfg.SizeBytes, errdefs.ErrInvalidArgument)
	}
	fds, err := fdsOf(socks)
	if err != nil {
		return -1, err
	}
	msgs, err := execute("connect", cfg.Index, cmdConnect, connectAttrs(cfg, fds))
	runtime.KeepAlive(socks) // their descriptors must stay open until the kernel has them
	if err != nil {
		return -1, err
	}
	return replyIndex(msgs)
}

// connectAttrs are NBD_CMD_CONNECT's attributes; no index lets the kernel
// pick a device.
func connectAttrs(cfg Config, fds []uint32) *netlink.AttributeEncoder {
	ae := netlink.NewAttributeEncoder()
	if cfg.Index >= 0 {
		ae.Uint32(attrIndex, uint32(cfg.Index))
	}
	ae.Uint64(attrSizeBytes, cfg.SizeBytes)
	if cfg.BlockSize != 0 {
		ae.Uint64(attrBlockSizeBytes, cfg.BlockSize)
	}
	putSeconds(ae, attrTimeout, cfg.Timeout)
	putSeconds(ae, attrDeadConnTimeout, cfg.DeadConnTimeout)
	ae.Uint64(attrServerFlags, cfg.ServerFlags)
	if cfg.Backend != "" {
		ae.String(attrBackend, cfg.Backend)
	}
	putSockets(ae, fds)
	return ae
}

// Reconfigure gives device index new sockets in place of dead ones (the
// server's connection was lost; requests wait up to the dead-connection
// timeout for this) and, when deadConnTimeout > 0, sets that timeout.
//
// The kernel only swaps a socket for one it has already marked dead, and
// silently drops a socket it has no dead place for: call it once the old
// connection has failed (for a proxied TLS connection, once its proxy
// has stopped).
func Reconfigure(index int, socks []*os.File, deadConnTimeout time.Duration) error {
	// A device connected with a backend identifier refuses a reconfigure
	// that does not repeat it; the kernel shows it, so the caller need
	// not keep it.
	return reconfigure(index, Backend(index), socks, deadConnTimeout)
}

// ReconfigureBackend is Reconfigure of a device the caller connected with
// backend: the kernel itself compares it with the device's, under its
// own lock, and refuses a device connected with another one (or none)
// with EINVAL, an ErrInvalidArgument here. No other process's device can
// be given a socket of the caller's between its check and the act.
func ReconfigureBackend(index int, backend string, socks []*os.File, deadConnTimeout time.Duration) error {
	if backend == "" {
		return fmt.Errorf("nbdnl: reconfigure of nbd%d needs the backend identifier: %w", index, errdefs.ErrInvalidArgument)
	}
	return reconfigure(index, backend, socks, deadConnTimeout)
}

func reconfigure(index int, backend string, socks []*os.File, deadConnTimeout time.Duration) error {
	if index < 0 {
		return fmt.Errorf("nbdnl: reconfigure of nbd%d: %w", index, errdefs.ErrInvalidArgument)
	}
	fds, err := fdsOf(socks)
	if err != nil {
		return err
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	putSeconds(ae, attrDeadConnTimeout, deadConnTimeout)
	if backend != "" {
		ae.String(attrBackend, backend)
	}
	if len(fds) > 0 {
		putSockets(ae, fds)
	}
	_, err = execute("reconfigure", index, cmdReconfigure, ae)
	runtime.KeepAlive(socks)
	if err != nil {
		return missingOr(index, err)
	}
	return nil
}

// Disconnect disconnects device index. A device that is not connected is
// left as it is (no error). The device stays "connected" for Status while
// something still has it open (a mount): the kernel lets go of it then.
func Disconnect(index int) error {
	if index < 0 {
		return fmt.Errorf("nbdnl: disconnect of nbd%d: %w", index, errdefs.ErrInvalidArgument)
	}
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	if _, err := execute("disconnect", index, cmdDisconnect, ae); err != nil {
		return missingOr(index, err)
	}
	return nil
}

// Status reports whether device index has a connection (the kernel still
// holds a configuration for it); a device that does not exist is
// ErrNotFound.
func Status(index int) (bool, error) {
	if index < 0 {
		return false, fmt.Errorf("nbdnl: status of nbd%d: %w", index, errdefs.ErrInvalidArgument)
	}
	found, connected, err := status(index)
	if err != nil {
		return false, err
	}
	if !found {
		return false, fmt.Errorf("nbdnl: no device nbd%d: %w", index, errdefs.ErrNotFound)
	}
	return connected, nil
}

func status(index int) (found, connected bool, err error) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	msgs, err := execute("status", index, cmdStatus, ae)
	if err != nil {
		return false, false, err
	}
	for _, m := range msgs {
		f, c, err := parseStatus(m.Data, index)
		if err != nil {
			return false, false, err
		}
		if f {
			return true, c, nil
		}
	}
	return false, false, nil
}

// parseStatus finds index in a status reply's device list.
func parseStatus(data []byte, index int) (found, connected bool, err error) {
	ad, err := netlink.NewAttributeDecoder(data)
	if err != nil {
		return false, false, fmt.Errorf("nbdnl: status reply: %w: %w", err, errdefs.ErrUnavailable)
	}
	for ad.Next() {
		if ad.Type() != attrDeviceList {
			continue
		}
		ad.Nested(func(list *netlink.AttributeDecoder) error {
			for list.Next() {
				if list.Type() == deviceItem {
					list.Nested(func(item *netlink.AttributeDecoder) error {
						i, c := deviceOf(item)
						if i == index {
							found, connected = true, c
						}
						return nil
					})
				}
			}
			return nil
		})
	}
	if err := ad.Err(); err != nil {
		return false, false, fmt.Errorf("nbdnl: status reply: %w: %w", err, errdefs.ErrUnavailable)
	}
	return found, connected, nil
}

func deviceOf(item *netlink.AttributeDecoder) (index int, connected bool) {
	index = -1
	for item.Next() {
		switch item.Type() {
		case deviceIndex:
			index = int(item.Uint32())
		case deviceConnected:
			connected = item.Uint8() != 0
		}
	}
	return index, connected
}

// missingOr tells a device that does not exist from other refusals: the
// kernel says EINVAL for both.
func missingOr(index int, err error) error {
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		return err
	}
	if found, _, serr := status(index); serr == nil && !found {
		return fmt.Errorf("nbdnl: no device nbd%d: %w", index, errdefs.ErrNotFound)
	}
	return err
}

// execute sends one request (op, on device index) of the nbd family and
// returns the replies.
func execute(op string, index int, cmd uint8, ae *netlink.AttributeEncoder) ([]genetlink.Message, error) {
	data, err := ae.Encode()
	if err != nil {
		return nil, fmt.Errorf("nbdnl: encoding the request: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: opening a generic netlink socket: %w: %w", err, errdefs.ErrUnavailable)
	}
	defer c.Close()
	fam, err := family(c)
	if err != nil {
		return nil, err
	}
	// Acknowledge: disconnect and reconfigure send no reply of their own,
	// so without an ack a success would leave the read waiting.
	msg := genetlink.Message{Header: genetlink.Header{Command: cmd, Version: fam.Version}, Data: data}
	msgs, err := c.Execute(msg, fam.ID, netlink.Request|netlink.Acknowledge)
	if err != nil {
		return nil, kernelErr(op, index, err)
	}
	return msgs, nil
}

// family looks the nbd family up; the kernel has it while nbd is loaded.
func family(c *genetlink.Conn) (genetlink.Family, error) {
	fam, err := c.GetFamily(familyName)
	if errors.Is(err, os.ErrNotExist) {
		return fam, fmt.Errorf("nbdnl: this kernel has no NBD support (no %q generic netlink family): load the kernel module nbd (modprobe nbd) on the node: %w",
			familyName, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return fam, fmt.Errorf("nbdnl: looking up the %q netlink family: %w: %w", familyName, err, errdefs.ErrUnavailable)
	}
	return fam, nil
}

// kernelErr maps the kernel's errno to the sentinel the caller acts on.
func kernelErr(op string, index int, err error) error {
	dev := fmt.Sprintf("nbd%d", index)
	if index < 0 {
		dev = "a free NBD device"
	}
	var kind error
	hint := ""
	switch {
	case errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES):
		kind, hint = errdefs.ErrPermissionDenied, " (needs CAP_SYS_ADMIN)"
	case errors.Is(err, unix.EBUSY) && index >= 0:
		kind, hint = errdefs.ErrAlreadyExists, " (the device is already connected)"
	case errors.Is(err, unix.EBUSY), errors.Is(err, unix.ENOSPC), errors.Is(err, unix.ENOMEM), errors.Is(err, unix.EEXIST):
		kind, hint = errdefs.ErrResourceExhausted, " (no NBD device left to connect)"
	case errors.Is(err, unix.EBADF), errors.Is(err, unix.ENOTSOCK), errors.Is(err, unix.EINVAL):
		kind, hint = errdefs.ErrInvalidArgument, " (the kernel log says why)"
	default:
		kind = errdefs.ErrUnavailable
	}
	return fmt.Errorf("nbdnl: %s of %s: %w%s: %w", op, dev, err, hint, kind)
}

// fdsOf returns the descriptors of socks without os.File.Fd, which would
// switch a socket the caller still uses to blocking mode.
func fdsOf(socks []*os.File) ([]uint32, error) {
	fds := make([]uint32, 0, len(socks))
	for i, f := range socks {
		if f == nil {
			return nil, fmt.Errorf("nbdnl: socket %d is nil: %w", i, errdefs.ErrInvalidArgument)
		}
		rc, err := f.SyscallConn()
		if err != nil {
			return nil, fmt.Errorf("nbdnl: socket %d: %w: %w", i, err, errdefs.ErrInvalidArgument)
		}
		if err := rc.Control(func(fd uintptr) { fds = append(fds, uint32(fd)) }); err != nil {
			return nil, fmt.Errorf("nbdnl: socket %d: %w: %w", i, err, errdefs.ErrInvalidArgument)
		}
	}
	return fds, nil
}

func putSockets(ae *netlink.AttributeEncoder, fds []uint32) {
	ae.Nested(attrSockets, func(list *netlink.AttributeEncoder) error {
		for _, fd := range fds {
			list.Nested(sockItem, func(item *netlink.AttributeEncoder) error {
				item.Uint32(sockFD, fd)
				return nil
			})
		}
		return nil
	})
}

// putSeconds puts d in whole seconds, rounded up so that a short timeout
// does not become none; zero leaves the kernel's value.
func putSeconds(ae *netlink.AttributeEncoder, typ uint16, d time.Duration) {
	if d > 0 {
		ae.Uint64(typ, uint64((d+time.Second-1)/time.Second))
	}
}

func replyIndex(msgs []genetlink.Message) (int, error) {
	for _, m := range msgs {
		ad, err := netlink.NewAttributeDecoder(m.Data)
		if err != nil {
			continue
		}
		for ad.Next() {
			if ad.Type() == attrIndex {
				return int(ad.Uint32()), nil
			}
		}
	}
	return -1, fmt.Errorf("nbdnl: the kernel's connect reply names no device: %w", errdefs.ErrUnavailable)
}

// Backend reads the backend identifier the kernel shows for device
// index (/sys/block/nbdN/backend); "" when there is none: the device is
// not connected, was connected without one, or the kernel predates them
// (before 5.13). Reading sysfs needs no privilege.
func Backend(index int) string {
	if index < 0 {
		return ""
	}
	b, err := os.ReadFile(fmt.Sprintf("%s/nbd%d/backend", sysBlock, index))
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(b), "\n")
}

// FindBackend returns the index of the device the kernel shows connected
// with backend, or -1 when none is.
func FindBackend(backend string) int {
	if backend == "" {
		return -1
	}
	names, _ := filepath.Glob(filepath.Join(sysBlock, "nbd*"))
	for _, n := range names {
		i, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(n), "nbd"))
		if err != nil || i < 0 {
			continue
		}
		if Backend(i) == backend {
			return i
		}
	}
	return -1
}

// DeviceNumber reads device index's major and minor numbers
// (/sys/block/nbdN/dev): the minor is index shifted by the module's
// partition bits, which only the kernel knows.
func DeviceNumber(index int) (major, minor uint32, err error) {
	p := fmt.Sprintf("%s/nbd%d/dev", sysBlock, index)
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return 0, 0, fmt.Errorf("nbdnl: no device nbd%d: %w", index, errdefs.ErrNotFound)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("nbdnl: %w", err)
	}
	if _, err := fmt.Sscanf(strings.TrimSpace(string(b)), "%d:%d", &major, &minor); err != nil {
		return 0, 0, fmt.Errorf("nbdnl: %s holds %q: %w", p, b, errdefs.ErrUnavailable)
	}
	return major, minor, nil
}
