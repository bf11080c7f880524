package iscsi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/iscsi/iscsitest"
	"github.com/mountplan/mountplan/internal/source/sourcetest"
)

func newSource(t *testing.T, portals ...string) *Source {
	t.Helper()
	s := New(config.ISCSIConfig{AllowedPortals: portals}, nil, nil)
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
	if strings.Contains(fmt.Sprintf("%v %+v %s", c, c, c), "canary") || strings.Contains(fmt.Sprintf("%v %+v %#v", c.chap(), c.chap(), c.chap()), "canary") {
		t.Fatal("credentials leak through String")
	}
	if c.chap() != (mounter.CHAP{User: "u", Password: "canary-pw"}) {
		t.Fatalf("CHAP for the mounter: wrong fields")
	}
}

// TestStageWithoutKernelSupport runs stage against a real tgtd on a kernel
// without iscsi_tcp: discovery works, then a FailedPrecondition names the
// module, and nothing is left (no session record, no call to the
// mounter: the source has none). A wrong
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
	if keys, _ := s.getHost().SharedKeys(sharedKind); len(keys) != 0 {
		t.Fatalf("session records left: %v", keys)
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
