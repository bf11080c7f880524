package nbd

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/nbd/nbdtest"
	"github.com/mountplan/mountplan/internal/source/sourcetest"
)

func newSource(t *testing.T, cfg config.NBDConfig) *Source {
	t.Helper()
	return New(cfg, nil, nil)
}

func TestNewVolume(t *testing.T) {
	roots := t.TempDir()
	s := newSource(t, config.NBDConfig{
		AllowedServers: []string{"127.0.0.0/8:*", "192.0.2.10:10809", "nbd.example.org:10900", "[fd00::/8]:10809"},
		SocketRoots:    []string{roots},
	})
	tests := []struct {
		name    string
		vctx    map[string]string
		want    string // canonical address
		wantErr error
	}{
		{"loopback any port", map[string]string{"address": "127.0.0.1:4000", "export": "a"}, "127.0.0.1:4000", nil},
		{"default port", map[string]string{"address": "192.0.2.10"}, "192.0.2.10:10809", nil},
		{"wrong port", map[string]string{"address": "192.0.2.10:10810"}, "", errdefs.ErrInvalidArgument},
		{"other host", map[string]string{"address": "192.0.2.11:10809"}, "", errdefs.ErrInvalidArgument},
		{"name allowed", map[string]string{"address": "NBD.example.org.:10900"}, "nbd.example.org:10900", nil},
		{"name not allowed", map[string]string{"address": "evil.example.org:10900"}, "", errdefs.ErrInvalidArgument},
		{"ipv6 prefix", map[string]string{"address": "[fd00::1]:10809"}, "[fd00::1]:10809", nil},
		{"ipv6 outside", map[string]string{"address": "[fe80::1]:10809"}, "", errdefs.ErrInvalidArgument},
		{"socket under root", map[string]string{"address": roots + "/a.sock"}, roots + "/a.sock", nil},
		{"socket outside", map[string]string{"address": "/run/other.sock"}, "", errdefs.ErrInvalidArgument},
		{"socket with dots", map[string]string{"address": roots + "/../x.sock"}, "", errdefs.ErrInvalidArgument},
		{"no address", map[string]string{"export": "a"}, "", errdefs.ErrInvalidArgument},
		{"unknown attribute", map[string]string{"address": "127.0.0.1:1", "image": "/x"}, "", errdefs.ErrInvalidArgument},
		{"tls without admin certificates", map[string]string{"address": "127.0.0.1:1", "tls": "true"}, "", errdefs.ErrInvalidArgument},
		{"bad tls value", map[string]string{"address": "127.0.0.1:1", "tls": "yes"}, "", errdefs.ErrInvalidArgument},
		{"kubelet attributes pass", map[string]string{"address": "127.0.0.1:1", "csi.storage.k8s.io/pod.name": "p"}, "127.0.0.1:1", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v, err := s.NewVolume("v1", tt.vctx)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("NewVolume(%v) = %v, want %v", tt.vctx, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if v.Parameters[CtxAddress] != tt.want || v.ID == "" || v.Kind != model.KindStatic {
				t.Fatalf("volume %+v, want address %s", v, tt.want)
			}
		})
	}
}

func TestNewVolumeTLSRequired(t *testing.T) {
	s := newSource(t, config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}, TLS: &config.NBDTLS{CAFile: "/ca.pem", Required: true}})
	v, err := s.NewVolume("v", map[string]string{"address": "127.0.0.1:5"})
	if err != nil || v.Parameters[CtxTLS] != "true" {
		t.Fatalf("required TLS not applied: %v %v", v, err)
	}
	if _, err := s.NewVolume("v", map[string]string{"address": "127.0.0.1:5", "tls": "false"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("tls=false accepted against a TLS-only policy: %v", err)
	}
}

// TestProbeAndList runs the handshake against a real nbdkit.
func TestProbeAndList(t *testing.T) {
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "disk1", 64<<20)
	nbdtest.AddExport(t, dir, "disk2", 8<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	ctx := context.Background()
	d := Dialer{Network: "tcp", Address: srv.Address}
	names, err := d.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(names, "disk1") || !slices.Contains(names, "disk2") {
		t.Fatalf("List = %v, want disk1 and disk2", names)
	}
	e, err := d.Probe(ctx, "disk1")
	if err != nil {
		t.Fatal(err)
	}
	if !e.Known || e.Size != 64<<20 || e.ReadOnly {
		t.Fatalf("Probe(disk1) = %+v", e)
	}
	if _, err := d.Probe(ctx, "missing"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Probe(missing) = %v, want NotFound", err)
	}
	sock := filepath.Join(t.TempDir(), "nbd.sock")
	usrv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{Unix: sock, ReadOnly: true})
	e, err = Dialer{Network: "unix", Address: usrv.Socket}.Probe(ctx, "disk2")
	if err != nil || !e.ReadOnly || e.Size != 8<<20 {
		t.Fatalf("Probe over unix socket = %+v, %v", e, err)
	}
}

func TestProbeUnreachable(t *testing.T) {
	port := nbdtest.FreePort(t)
	d := Dialer{Network: "tcp", Address: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), Timeout: 2 * time.Second}
	if _, err := d.Probe(context.Background(), "x"); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("Probe of a closed port = %v, want Unavailable", err)
	}
	// A server that is not NBD: a listener that says something else.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err == nil {
			_, _ = c.Write([]byte("SSH-2.0-OpenSSH_9.2\r\n........"))
			time.Sleep(100 * time.Millisecond)
			c.Close()
		}
	}()
	d.Address = l.Addr().String()
	if _, err := d.Probe(context.Background(), "x"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Probe of a non-NBD server = %v, want FailedPrecondition", err)
	}
}

// TestProbeTLS: a server that requires TLS says so to a plain client, and
// answers a client that upgrades with the admin's CA.
func TestProbeTLS(t *testing.T) {
	tlsDir := t.TempDir()
	caFile := writeTLSFiles(t, tlsDir)
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "secure", 16<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{TLSDir: tlsDir})
	s := newSource(t, config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}, TLS: &config.NBDTLS{CAFile: caFile}})
	ctx := context.Background()
	plain, err := s.NewVolume("v", map[string]string{"address": srv.Address, "export": "secure"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.probe(ctx, targetOf(plain), 5*time.Second); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "TLS") {
		t.Fatalf("plain probe of a TLS-only server = %v, want FailedPrecondition naming TLS", err)
	}
	secure, err := s.NewVolume("v", map[string]string{"address": srv.Address, "export": "secure", "tls": "true"})
	if err != nil {
		t.Fatal(err)
	}
	e, err := s.probe(ctx, targetOf(secure), 5*time.Second)
	if err != nil || e.Size != 16<<20 {
		t.Fatalf("TLS probe = %+v, %v", e, err)
	}
}

// TestStageWithoutKernelSupport: on a kernel without nbd, stage fails with
// FailedPrecondition naming the module, after the probe, leaving no device
// claimed and no record of a connection; a missing export is NotFound first.
func TestStageWithoutKernelSupport(t *testing.T) {
	dir := t.TempDir()
	nbdtest.AddExport(t, dir, "disk1", 32<<20)
	srv := nbdtest.StartNbdkit(t, dir, nbdtest.Options{})
	s := newSource(t, config.NBDConfig{AllowedServers: []string{"127.0.0.1:*"}})
	s.SysDir = t.TempDir() // a kernel without the module, whatever this one has
	ctx := context.Background()
	rec := &sourcetest.Recorder{}
	req := source.StageRequest{FsType: "ext4", Record: rec}

	v, err := s.NewVolume("v1", map[string]string{"address": srv.Address, "export": "disk1"})
	if err != nil {
		t.Fatal(err)
	}
	v.Staging = true
	_, err = s.Stage(ctx, v, req)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "module nbd") {
		t.Fatalf("Stage without kernel support = %v, want FailedPrecondition naming the nbd module", err)
	}
	if rec.Saves() != 0 || len(s.links) != 0 || s.watch != nil {
		t.Fatalf("stage left state behind: %d saves, links %v, watcher %v", rec.Saves(), s.links, s.watch)
	}
	if err := s.Unstage(ctx, v); err != nil {
		t.Fatalf("Unstage after a failed stage: %v", err)
	}

	missing, err := s.NewVolume("v2", map[string]string{"address": srv.Address, "export": "nope"})
	if err != nil {
		t.Fatal(err)
	}
	missing.Staging = true
	if _, err := s.Stage(ctx, missing, req); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Stage of a missing export = %v, want NotFound", err)
	}
	srv.Stop()
	if _, err := s.Stage(ctx, v, req); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("Stage with the server gone = %v, want Unavailable", err)
	}
}

// TestRealKernelModule checks the real /sys of this machine: without the
// nbd module (the CI kernel) the error names it; with it, the kernel is ready.
func TestRealKernelModule(t *testing.T) {
	s := newSource(t, config.NBDConfig{})
	err := s.kernelReady()
	if _, statErr := os.Stat("/sys/module/nbd"); statErr == nil {
		if err != nil {
			t.Fatalf("this kernel has nbd; kernelReady = %v", err)
		}
		return
	}
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "modprobe nbd") {
		t.Fatalf("kernelReady = %v", err)
	}
}

// writeTLSFiles writes a CA and a server certificate for 127.0.0.1 in
// GnuTLS's layout (nbdkit --tls-certificates) and returns the CA file.
func writeTLSFiles(t *testing.T, dir string) string {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "mountplan test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	srvTmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	caCert, _ := x509.ParseCertificate(caDER)
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, caCert, &srvKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(srvKey)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, typ string, der []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	write("server-cert.pem", "CERTIFICATE", srvDER)
	write("server-key.pem", "PRIVATE KEY", keyDER)
	return write("ca-cert.pem", "CERTIFICATE", caDER)
}
