package iscsi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/source"
	"github.com/mountplan/mountplan/pkg/source/iscsi/iscsitest"
	"github.com/mountplan/mountplan/pkg/source/sourcetest"
)

func newSource(t *testing.T, portals ...string) *Source {
	t.Helper()
	s := New(config.ISCSIConfig{AllowedPortals: portals, NodeDBDir: t.TempDir()}, t.TempDir(), nil)
	s.SetHost(&sourcetest.Host{})
	return s
}

func TestNewVolume(t *testing.T) {
	s := newSource(t, "127.0.0.1:*", "192.0.2.0/24:3260")
	iqn := "iqn.2024-01.org.example:disk1"
	tests := []struct {
		name    string
		vctx    map[string]string
		portals string
		wantErr error
	}{
		{"ok", map[string]string{"portals": "127.0.0.1:3261", "iqn": iqn, "lun": "1"}, "127.0.0.1:3261", nil},
		{"default port, two portals", map[string]string{"portals": "192.0.2.5, 127.0.0.1:9", "iqn": iqn, "lun": "0"}, "192.0.2.5:3260,127.0.0.1:9", nil},
		{"portal not allowed", map[string]string{"portals": "198.51.100.1", "iqn": iqn, "lun": "1"}, "", errdefs.ErrInvalidArgument},
		{"one of two not allowed", map[string]string{"portals": "127.0.0.1,192.0.2.5:3261", "iqn": iqn, "lun": "1"}, "", errdefs.ErrInvalidArgument},
		{"no portal", map[string]string{"portals": " , ", "iqn": iqn, "lun": "1"}, "", errdefs.ErrInvalidArgument},
		{"bad iqn", map[string]string{"portals": "127.0.0.1", "iqn": "disk1; rm -rf /", "lun": "1"}, "", errdefs.ErrInvalidArgument},
		{"eui name", map[string]string{"portals": "127.0.0.1", "iqn": "eui.0123456789ABCDEF", "lun": "1"}, "127.0.0.1:3260", nil},
		{"bad lun", map[string]string{"portals": "127.0.0.1", "iqn": iqn, "lun": "-1"}, "", errdefs.ErrInvalidArgument},
		{"missing lun", map[string]string{"portals": "127.0.0.1", "iqn": iqn}, "", errdefs.ErrInvalidArgument},
		{"unknown attribute", map[string]string{"portals": "127.0.0.1", "iqn": iqn, "lun": "1", "chapPassword": "x"}, "", errdefs.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v, err := s.NewVolume("v1", tt.vctx)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("NewVolume = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if v.Parameters[CtxPortals] != tt.portals {
				t.Fatalf("portals %q, want %q", v.Parameters[CtxPortals], tt.portals)
			}
		})
	}
}

func TestCredentials(t *testing.T) {
	for name, secrets := range map[string]map[string]string{
		"user without password":  {SecretUsername: "u"},
		"password without user":  {SecretPassword: "p"},
		"mutual without one-way": {SecretUsernameIn: "u", SecretPasswordIn: "p"},
		"line break":             {SecretUsername: "u", SecretPassword: "p\nnode.startup = automatic"},
		"unknown key":            {"password": "p"},
	} {
		if _, err := credentialsFrom(secrets); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		} else if strings.Contains(err.Error(), "p\n") {
			t.Errorf("%s: error shows the secret: %v", name, err)
		}
	}
	c, err := credentialsFrom(map[string]string{SecretUsername: "u", SecretPassword: "canary-pw"})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(c.String(), "canary") || strings.Contains(admOutput(t, "login as u with canary-pw failed", c), "canary-pw") {
		t.Fatal("credentials leak through String or redact")
	}
}

// TestWriteAuth: the CHAP fields replace the record's own, the file stays
// 0600 and no temp file is left.
func TestWriteAuth(t *testing.T) {
	dir := t.TempDir()
	rec := filepath.Join(dir, "default")
	orig := "node.name = iqn.x:y\nnode.session.auth.authmethod = None\nnode.session.auth.chap_algs = MD5\nnode.session.auth.password = old\nnode.conn[0].port = 3260\n"
	if err := os.WriteFile(rec, []byte(orig), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := writeAuth(rec, credentials{user: "alice", password: "s3cret", userIn: "tgt", passwordIn: "back"}); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(rec)
	got := string(b)
	for _, want := range []string{"node.name = iqn.x:y\n", "chap_algs = MD5\n", "node.conn[0].port = 3260\n",
		"node.session.auth.authmethod = CHAP\n", "node.session.auth.username = alice\n", "node.session.auth.password = s3cret\n",
		"node.session.auth.username_in = tgt\n", "node.session.auth.password_in = back\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("record lacks %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "= old") || strings.Count(got, "authmethod") != 1 {
		t.Errorf("old auth fields kept:\n%s", got)
	}
	if fi, _ := os.Stat(rec); fi.Mode().Perm() != 0o600 {
		t.Errorf("record mode %v, want 0600", fi.Mode().Perm())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("temp files left: %v", ents)
	}
	if err := writeAuth(rec, credentials{}); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(rec); strings.Contains(string(b), "s3cret") || !strings.Contains(string(b), "authmethod = None") {
		t.Errorf("clearing auth left:\n%s", b)
	}
}

// TestStageWithoutKernelSupport runs stage against a real tgtd on a kernel
// without iscsi_tcp: discovery works, then a FailedPrecondition names the
// module, and nothing is left (no session marker, no node record). A wrong
// IQN is NotFound and a dead portal Unavailable, before any of that.
func TestStageWithoutKernelSupport(t *testing.T) {
	tg := iscsitest.StartTgtd(t, t.TempDir(), iscsitest.Options{LUNSizes: []int64{16 << 20}})
	s := newSource(t, "127.0.0.1:*")
	s.SysDir = t.TempDir()
	ctx := context.Background()
	req := source.StageRequest{FsType: "ext4", Secrets: map[string]string{SecretUsername: "u", SecretPassword: "canary-pw"},
		Record: &sourcetest.Recorder{}}
	stage := func(iqn, portal string) error {
		v, err := s.NewVolume("v1", map[string]string{"portals": portal, "iqn": iqn, "lun": "1"})
		if err != nil {
			t.Fatal(err)
		}
		v.Staging = true
		_, err = s.Stage(ctx, v, req)
		if err != nil && strings.Contains(err.Error(), "canary-pw") {
			t.Errorf("error shows the CHAP password: %v", err)
		}
		return err
	}
	if err := stage(tg.IQN, tg.Portal); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "module iscsi_tcp") {
		t.Fatalf("Stage without kernel support = %v, want FailedPrecondition naming iscsi_tcp", err)
	}
	if err := stage("iqn.2024-01.io.mountplan.test:other", tg.Portal); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Stage of a missing target = %v, want NotFound", err)
	}
	tg.Stop()
	if err := stage(tg.IQN, tg.Portal); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("Stage with the portal gone = %v, want Unavailable", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.StateDir, "iscsi", "sessions")); len(ents) != 0 {
		t.Fatalf("session registry not empty: %v", ents)
	}
	if ents, _ := os.ReadDir(s.Config.NodeDBDir); len(ents) != 0 {
		t.Fatalf("node records written: %v", ents)
	}
}

// TestRealKernelModule checks the real /sys of this machine: without the
// iscsi_tcp module (the CI kernel) the error names it; with it, the kernel
// is ready.
func TestRealKernelModule(t *testing.T) {
	s := newSource(t)
	err := s.kernelReady()
	if _, statErr := os.Stat("/sys/module/iscsi_tcp"); statErr == nil {
		if err != nil {
			t.Fatalf("this kernel has iscsi_tcp; kernelReady = %v", err)
		}
		return
	}
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "modprobe iscsi_tcp") {
		t.Fatalf("kernelReady = %v", err)
	}
}
