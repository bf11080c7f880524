package nbdnl

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// TestConnectAttrs decodes what Connect sends: the layout of
// nbd-netlink.h, sockets nested twice, timeouts rounded up to seconds.
func TestConnectAttrs(t *testing.T) {
	cfg := Config{Index: 3, SizeBytes: 64 << 20, BlockSize: 4096, ServerFlags: FlagHasFlags | FlagSendFlush,
		Timeout: 1500 * time.Millisecond, DeadConnTimeout: 30 * time.Second, Backend: "nbd://127.0.0.1:10809/vol"}
	b, err := connectAttrs(cfg, []uint32{7, 9}).Encode()
	if err != nil {
		t.Fatal(err)
	}
	got := map[uint16]any{}
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		t.Fatal(err)
	}
	for ad.Next() {
		switch ad.Type() {
		case attrIndex:
			got[attrIndex] = ad.Uint32()
		case attrBackend:
			got[attrBackend] = ad.String()
		case attrSockets:
			var fds []uint32
			ad.Nested(func(list *netlink.AttributeDecoder) error {
				for list.Next() {
					if list.Type() != sockItem {
						return fmt.Errorf("socket list holds type %d", list.Type())
					}
					list.Nested(func(item *netlink.AttributeDecoder) error {
						for item.Next() {
							if item.Type() == sockFD {
								fds = append(fds, item.Uint32())
							}
						}
						return nil
					})
				}
				return nil
			})
			got[attrSockets] = fmt.Sprint(fds)
		default:
			got[ad.Type()] = ad.Uint64()
		}
	}
	if err := ad.Err(); err != nil {
		t.Fatal(err)
	}
	want := map[uint16]any{attrIndex: uint32(3), attrSizeBytes: uint64(64 << 20), attrBlockSizeBytes: uint64(4096),
		attrTimeout: uint64(2), attrDeadConnTimeout: uint64(30), attrServerFlags: uint64(5),
		attrBackend: "nbd://127.0.0.1:10809/vol", attrSockets: "[7 9]"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("attributes\n got %v\nwant %v", got, want)
	}

	// Index -1 and zero timeouts: the kernel chooses, nothing is sent.
	b, _ = connectAttrs(Config{Index: -1, SizeBytes: 1 << 20}, []uint32{7}).Encode()
	ad, _ = netlink.NewAttributeDecoder(b)
	for ad.Next() {
		switch ad.Type() {
		case attrIndex, attrTimeout, attrDeadConnTimeout, attrBlockSizeBytes, attrBackend:
			t.Fatalf("attribute %d sent for a config that leaves it to the kernel", ad.Type())
		}
	}
}

// TestParseStatus reads a status reply as the kernel builds it.
func TestParseStatus(t *testing.T) {
	ae := netlink.NewAttributeEncoder()
	ae.Nested(attrDeviceList, func(list *netlink.AttributeEncoder) error {
		for i, c := range []uint8{0, 1} {
			list.Nested(deviceItem, func(item *netlink.AttributeEncoder) error {
				item.Uint32(deviceIndex, uint32(i))
				item.Uint8(deviceConnected, c)
				return nil
			})
		}
		return nil
	})
	b, err := ae.Encode()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		index            int
		found, connected bool
	}{{0, true, false}, {1, true, true}, {2, false, false}} {
		f, c, err := parseStatus(b, tc.index)
		if err != nil || f != tc.found || c != tc.connected {
			t.Errorf("parseStatus(nbd%d) = %v, %v, %v; want %v, %v", tc.index, f, c, err, tc.found, tc.connected)
		}
	}
	if _, _, err := parseStatus([]byte{1, 2, 3}, 0); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("parseStatus of garbage = %v", err)
	}
}

func TestKernelErr(t *testing.T) {
	for _, tc := range []struct {
		errno error
		index int
		want  error
	}{
		{unix.EPERM, 0, errdefs.ErrPermissionDenied},
		{unix.EBUSY, 2, errdefs.ErrAlreadyExists},
		{unix.ENOSPC, -1, errdefs.ErrResourceExhausted},
		{unix.EBUSY, -1, errdefs.ErrResourceExhausted},
		{unix.EINVAL, 0, errdefs.ErrInvalidArgument},
		{unix.EBADF, 0, errdefs.ErrInvalidArgument},
		{unix.EIO, 0, errdefs.ErrUnavailable},
	} {
		err := kernelErr("connect", tc.index, &netlink.OpError{Op: "receive", Err: tc.errno})
		if !errors.Is(err, tc.want) || !errors.Is(err, tc.errno) {
			t.Errorf("kernelErr(%v, %d) = %v, want %v", tc.errno, tc.index, err, tc.want)
		}
	}
}

func TestInvalidArguments(t *testing.T) {
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for name, err := range map[string]error{
		"connect without sockets": func() error { _, err := Connect(Config{Index: -1, SizeBytes: 1 << 20}, nil); return err }(),
		"connect without a size":  func() error { _, err := Connect(Config{Index: -1}, []*os.File{f}); return err }(),
		"connect to index -2":     func() error { _, err := Connect(Config{Index: -2, SizeBytes: 1}, []*os.File{f}); return err }(),
		"connect with a nil file": func() error { _, err := Connect(Config{Index: -1, SizeBytes: 1}, []*os.File{nil}); return err }(),
		"reconfigure index -1":    Reconfigure(-1, []*os.File{f}, 0),
		"disconnect index -1":     Disconnect(-1),
		"status index -1":         func() error { _, err := Status(-1); return err }(),
	} {
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
}

// TestNoModule: on a kernel without nbd (and without module support, so
// that asking cannot load it here) every call names the module.
func TestNoModule(t *testing.T) {
	if _, err := os.Stat("/sys/module/nbd"); err == nil {
		t.Skip("this kernel has nbd: the VM test (test/vm) covers the real calls")
	}
	if _, err := os.Stat("/proc/modules"); err == nil {
		t.Skip("this kernel loads modules: asking for the nbd family could load nbd on this machine")
	}
	_, err := Status(0)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "modprobe nbd") {
		t.Fatalf("Status without nbd = %v, want FailedPrecondition naming modprobe nbd", err)
	}
	if err := Disconnect(0); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Disconnect without nbd = %v", err)
	}
	if _, err := WatchLinkDead(); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("WatchLinkDead without nbd = %v", err)
	}
}

func TestBackendOf(t *testing.T) {
	old := sysBlock
	t.Cleanup(func() { sysBlock = old })
	sysBlock = t.TempDir()
	for name, content := range map[string]string{"nbd4/backend": "vol-a\n", "nbd4/dev": "43:128\n", "nbd12/backend": "vol-b\n",
		"nbd7/dev": "43:224\n", "nbdx/backend": "vol-c\n", "loop0/backend": "vol-d\n"} {
		p := filepath.Join(sysBlock, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if b := Backend(4); b != "vol-a" {
		t.Fatalf("Backend(4) = %q", b)
	}
	if b := Backend(5); b != "" {
		t.Fatalf("Backend of a missing device = %q", b)
	}
	for backend, want := range map[string]int{"vol-a": 4, "vol-b": 12, "vol-c": -1, "vol-d": -1, "": -1, "vol": -1} {
		if got := FindBackend(backend); got != want {
			t.Errorf("FindBackend(%q) = %d, want %d", backend, got, want)
		}
	}
	if major, minor, err := DeviceNumber(4); err != nil || major != 43 || minor != 128 {
		t.Fatalf("DeviceNumber(4) = %d:%d, %v", major, minor, err)
	}
	if _, _, err := DeviceNumber(5); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("DeviceNumber of a missing device = %v, want NotFound", err)
	}
	if err := ReconfigureBackend(4, "", nil, 0); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("ReconfigureBackend without a backend = %v, want InvalidArgument", err)
	}
}
