//go:build vmguest

package guest

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/nbdnl"
	"github.com/mountplan/mountplan/internal/source/nbd"
	"github.com/mountplan/mountplan/internal/source/nbd/nbdtest"
)

// These tests connect NBD devices as the plugin and the mounter are to:
// the handshake by nbd.Dialer.Negotiate (TLS through its proxy), the
// hand-over by internal/nbdnl over generic netlink; no nbd-client runs.

// nlDevice is a device connected through nbdnl.
type nlDevice struct {
	index int
	dev   string
	tr    *nbd.Transmission
}

// connectNL negotiates export with d and connects a free device to it.
func connectNL(t *testing.T, d nbd.Dialer, export, backend string, deadConn time.Duration) *nlDevice {
	t.Helper()
	start := time.Now()
	tr, err := d.Negotiate(context.Background(), export)
	if err != nil {
		t.Fatalf("Negotiate: %v", err)
	}
	negotiated := time.Since(start)
	bs := uint64(512)
	if tr.Export.Size%4096 == 0 {
		bs = 4096
	}
	start = time.Now()
	index, err := nbdnl.Connect(nbdnl.Config{Index: -1, SizeBytes: uint64(tr.Export.Size), BlockSize: bs, ServerFlags: uint64(tr.Flags),
		Timeout: 30 * time.Second, DeadConnTimeout: deadConn, Backend: backend}, []*os.File{tr.Socket})
	if err != nil {
		tr.Close()
		t.Fatalf("nbdnl.Connect: %v", err)
	}
	connected := time.Since(start)
	tr.Socket.Close() // the kernel holds its own reference
	n := &nlDevice{index: index, dev: fmt.Sprintf("/dev/nbd%d", index), tr: tr}
	t.Cleanup(func() { _ = nbdnl.Disconnect(index); tr.Close() })
	t.Logf("negotiate %v, netlink connect %v: %s, %d bytes, flags %#x, block size %d, proxied %v",
		negotiated, connected, n.dev, tr.Export.Size, tr.Flags, bs, tr.Proxied())
	if got := sysfs(t, index, "backend"); got != backend {
		t.Fatalf("/sys/block/nbd%d/backend = %q, want %q", index, got, backend)
	}
	waitFor(t, "the device's size", func() bool { return sysfs(t, index, "size") == strconv.FormatInt(tr.Export.Size/512, 10) })
	return n
}

func sysfs(t *testing.T, index int, name string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/sys/block/nbd%d/%s", index, name))
	if err != nil {
		return "<" + err.Error() + ">"
	}
	return strings.TrimSpace(string(b))
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("waited 10s for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// mkfsMount formats the device and mounts it; the cleanup unmounts it.
func (n *nlDevice) mkfsMount(t *testing.T) string {
	t.Helper()
	start := time.Now()
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", n.dev).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4 %s: %v\n%s", n.dev, err, out)
	}
	t.Logf("mkfs.ext4 %s: %v", n.dev, time.Since(start))
	mnt := t.TempDir()
	n.mount(t, mnt)
	t.Cleanup(func() { _ = unix.Unmount(mnt, 0) })
	return mnt
}

func (n *nlDevice) mount(t *testing.T, mnt string) {
	t.Helper()
	if err := unix.Mount(n.dev, mnt, "ext4", unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		t.Fatalf("mount %s: %v", n.dev, err)
	}
}

func unmount(t *testing.T, mnt string) {
	t.Helper()
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatalf("unmount %s: %v", mnt, err)
	}
}

// writeSynced writes data and syncs the file and its filesystem.
func writeSynced(t *testing.T, path string, data []byte) {
	t.Helper()
	f, err := os.Create(path)
	if err == nil {
		_, err = f.Write(data)
	}
	if err == nil {
		err = f.Sync()
	}
	if err == nil {
		err = unix.Syncfs(int(f.Fd()))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatalf("writing %s: %v", path, err)
	}
}

// readFromDevice drops the page cache first, so the read goes to the server.
func readFromDevice(t *testing.T, path string, want []byte) {
	t.Helper()
	unix.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0o200); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	got, err := os.ReadFile(path)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back %s: %q, %v; want %q", path, got, err, want)
	}
	t.Logf("read %s back from the server in %v", filepath.Base(path), time.Since(start))
}

func wantStatus(t *testing.T, index int, want bool) {
	t.Helper()
	waitFor(t, fmt.Sprintf("nbdnl.Status(%d) = %v", index, want), func() bool {
		got, err := nbdnl.Status(index)
		if err != nil {
			t.Fatalf("nbdnl.Status(%d): %v", index, err)
		}
		return got == want
	})
}

// hasExt4 reports whether the export's file holds an ext4 superblock: the
// format went through the socket to the server.
func hasExt4(t *testing.T, path string) bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	magic := make([]byte, 2)
	_, err = f.ReadAt(magic, 1024+0x38)
	return err == nil && magic[0] == 0x53 && magic[1] == 0xef
}

func kernelRelease() string {
	b, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	return strings.TrimSpace(string(b))
}

// roundTrip formats, writes, remounts and reads back, then disconnects.
func roundTrip(t *testing.T, n *nlDevice, exportFile string) {
	t.Helper()
	mnt := n.mkfsMount(t)
	want := []byte("written through a netlink-connected device at " + time.Now().String() + "\n")
	writeSynced(t, filepath.Join(mnt, "hello.txt"), want)
	unmount(t, mnt)
	n.mount(t, mnt)
	readFromDevice(t, filepath.Join(mnt, "hello.txt"), want)
	wantStatus(t, n.index, true)
	unmount(t, mnt)
	if !hasExt4(t, exportFile) {
		t.Fatal("the export's file holds no ext4 superblock")
	}
	// An opener keeps the kernel's configuration past the disconnect.
	opener, err := os.Open(n.dev)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := nbdnl.Disconnect(n.index); err != nil {
		t.Fatalf("nbdnl.Disconnect: %v", err)
	}
	if held, err := nbdnl.Status(n.index); err != nil || !held {
		t.Fatalf("Status after a disconnect while the device is open: %v, %v; want still connected", held, err)
	}
	opener.Close()
	wantStatus(t, n.index, false)
	t.Logf("disconnect until Status says so: %v; pid %s", time.Since(start), sysfs(t, n.index, "pid"))
	if err := nbdnl.Disconnect(n.index); err != nil {
		t.Fatalf("second Disconnect of a disconnected device: %v", err)
	}
}

func TestNBDNetlinkPlain(t *testing.T) {
	requireGuest(t)
	t.Logf("kernel %s", kernelRelease())
	dir := t.TempDir()
	file := nbdtest.AddExport(t, dir, "nl", 64<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	d := nbd.Dialer{Network: "tcp", Address: srv.Address, Timeout: 10 * time.Second}
	n := connectNL(t, d, "nl", "nbd://"+srv.Address+"/nl", 0)

	// Refusals on the real kernel: a connected index, a missing device.
	tr, err := d.Negotiate(context.Background(), "nl")
	if err != nil {
		t.Fatal(err)
	}
	_, err = nbdnl.Connect(nbdnl.Config{Index: n.index, SizeBytes: uint64(tr.Export.Size), ServerFlags: uint64(tr.Flags)}, []*os.File{tr.Socket})
	tr.Close()
	wantCodeErr(t, "Connect of a connected index", err, errdefs.ErrAlreadyExists)
	_, err = nbdnl.Status(4000)
	wantCodeErr(t, "Status of a missing device", err, errdefs.ErrNotFound)
	wantCodeErr(t, "Disconnect of a missing device", nbdnl.Disconnect(4000), errdefs.ErrNotFound)
	wantCodeErr(t, "Reconfigure of a missing device", nbdnl.Reconfigure(4000, nil, time.Second), errdefs.ErrNotFound)

	roundTrip(t, n, file)
}

func wantCodeErr(t *testing.T, what string, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("%s: %v, want %v", what, err, want)
	}
	t.Logf("%s: %v", what, err)
}

func TestNBDNetlinkTLS(t *testing.T) {
	requireGuest(t)
	dir := t.TempDir()
	file := nbdtest.AddExport(t, dir, "secure", 64<<20)
	srv, cfg := startTLSNbdkit(t, dir)
	d := nbd.Dialer{Network: "tcp", Address: srv.Address, TLS: cfg, Timeout: 10 * time.Second}
	n := connectNL(t, d, "secure", "nbds://"+srv.Address+"/secure", 0)
	if !n.tr.Proxied() {
		t.Fatal("a TLS transmission without a proxy")
	}
	roundTrip(t, n, file)
	select {
	case <-n.tr.Done():
		t.Logf("proxy stopped after the disconnect: %v", n.tr.Wait())
	case <-time.After(10 * time.Second):
		t.Fatal("the proxy still runs 10s after the kernel disconnected")
	}
}

// TestNBDNetlinkReconfigure: the TLS proxy dies (the plugin restarts) under
// a mounted filesystem; the kernel reports the dead link, a new handshake's
// socket replaces it, and the filesystem reads and writes on.
func TestNBDNetlinkReconfigure(t *testing.T) {
	requireGuest(t)
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "re", 64<<20)
	srv, cfg := startTLSNbdkit(t, dir)
	d := nbd.Dialer{Network: "tcp", Address: srv.Address, TLS: cfg, Timeout: 10 * time.Second}
	n := connectNL(t, d, "re", "nbds://"+srv.Address+"/re", 60*time.Second)
	mnt := n.mkfsMount(t)
	want := []byte("written before the proxy died\n")
	writeSynced(t, filepath.Join(mnt, "kept.txt"), want)

	// While the link is alive the kernel has no place for another socket:
	// Reconfigure succeeds and the kernel drops the socket, which the
	// proxy sees as the kernel's end closing.
	spare, err := d.Negotiate(context.Background(), "re")
	if err != nil {
		t.Fatal(err)
	}
	if err := nbdnl.Reconfigure(n.index, []*os.File{spare.Socket}, 0); err != nil {
		t.Fatalf("Reconfigure with a live link: %v", err)
	}
	spare.Socket.Close()
	select {
	case <-spare.Done():
		t.Logf("Reconfigure with a live link: nil, and the kernel dropped the socket (%v)", spare.Wait())
	case <-time.After(10 * time.Second):
		t.Fatal("the kernel kept a socket given while no connection was dead")
	}
	if !errors.Is(spare.Wait(), nbd.ErrKernelSideClosed) {
		t.Fatalf("the spare's proxy ended with %v, want the kernel's side closing", spare.Wait())
	}
	spare.Close()

	w, err := nbdnl.WatchLinkDead()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	start := time.Now()
	if err := n.tr.Close(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dead, err := w.Next(ctx)
	if err != nil || dead != n.index {
		t.Fatalf("link-dead notice: nbd%d, %v; want nbd%d", dead, err, n.index)
	}
	t.Logf("proxy closed to NBD_CMD_LINK_DEAD: %v", time.Since(start))
	connected, err := nbdnl.Status(n.index)
	t.Logf("Status with the link dead: %v, %v", connected, err)

	start = time.Now()
	tr, err := d.Negotiate(context.Background(), "re")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	if err := nbdnl.Reconfigure(n.index, []*os.File{tr.Socket}, 60*time.Second); err != nil {
		t.Fatalf("nbdnl.Reconfigure: %v", err)
	}
	tr.Socket.Close()
	t.Logf("negotiate and reconfigure: %v", time.Since(start))
	readFromDevice(t, filepath.Join(mnt, "kept.txt"), want)
	more := []byte("written after the reconfigure\n")
	writeSynced(t, filepath.Join(mnt, "more.txt"), more)
	readFromDevice(t, filepath.Join(mnt, "more.txt"), more)
	wantStatus(t, n.index, true)
	unmount(t, mnt)
	if err := nbdnl.Disconnect(n.index); err != nil {
		t.Fatal(err)
	}
	wantStatus(t, n.index, false)
	select {
	case <-tr.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the new proxy still runs 10s after the disconnect")
	}
}

// startTLSNbdkit starts a TLS-only nbdkit with a certificate for
// 127.0.0.1 made here, and returns a client config that trusts it.
func startTLSNbdkit(t *testing.T, dir string) (*nbdtest.Server, *tls.Config) {
	t.Helper()
	tlsDir := t.TempDir()
	pool := writeTestCerts(t, tlsDir)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{TLSDir: tlsDir})
	return srv, &tls.Config{RootCAs: pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}
}

// writeTestCerts writes a CA and a server certificate in GnuTLS's layout
// (nbdkit --tls-certificates) and returns a pool holding the CA.
func writeTestCerts(t *testing.T, dir string) *x509.CertPool {
	t.Helper()
	now := time.Now()
	caKey, caDER := newCert(t, &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "mountplan guest CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}, nil, nil)
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	srvKey, srvDER := newCert(t, &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}, ca, caKey)
	keyDER, err := x509.MarshalPKCS8PrivateKey(srvKey)
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range map[string]*pem.Block{"ca-cert.pem": {Type: "CERTIFICATE", Bytes: caDER},
		"server-cert.pem": {Type: "CERTIFICATE", Bytes: srvDER}, "server-key.pem": {Type: "PRIVATE KEY", Bytes: keyDER}} {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(b), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return pool
}

// newCert makes a key and a certificate of tmpl signed by parent (itself
// when nil).
func newCert(t *testing.T, tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*ecdsa.PrivateKey, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	return key, der
}
