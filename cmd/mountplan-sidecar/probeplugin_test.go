package main

import (
	"bytes"
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// fakeIdentity answers as a plugin named name, ready or not.
type fakeIdentity struct {
	csi.UnimplementedIdentityServer
	name  string
	ready bool
}

func (f fakeIdentity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: f.name, VendorVersion: "v9"}, nil
}

func (f fakeIdentity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(f.ready)}, nil
}

func servePlugin(t *testing.T, id fakeIdentity) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "csi.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, id)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return "unix://" + sock
}

// TestProbePlugin: the helm test's check passes only for a ready plugin of
// the expected name, and says why otherwise.
func TestProbePlugin(t *testing.T) {
	ready := servePlugin(t, fakeIdentity{name: "mountplan.csi.io", ready: true})
	var out bytes.Buffer
	if err := runProbe(context.Background(), []string{"--plugin-endpoint", ready, "--driver-name", "mountplan.csi.io"}, &out); err != nil {
		t.Fatalf("a ready plugin: %v", err)
	}
	if !strings.Contains(out.String(), "mountplan.csi.io v9") {
		t.Errorf("output %q names no driver and version", out.String())
	}
	for _, tc := range []struct {
		name string
		args []string
		want error
		says string
	}{
		{"wrong name", []string{"--plugin-endpoint", ready, "--driver-name", "other.csi.io"}, errdefs.ErrFailedPrecondition, "driverName"},
		{"not ready", []string{"--plugin-endpoint", servePlugin(t, fakeIdentity{name: "mountplan.csi.io"})}, errdefs.ErrUnavailable, "mounter"},
		{"nobody", []string{"--plugin-endpoint", "unix://" + filepath.Join(t.TempDir(), "none.sock")}, errdefs.ErrUnavailable, "running on this node"},
		{"both sockets", []string{"--plugin-endpoint", ready, "--mounter-endpoint", ready}, errUsage, "one of"},
		{"both sockets, the old name", []string{"--plugin-endpoint", ready, "--endpoint", ready}, errUsage, "one of"},
		{"neither", nil, errUsage, "one of"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := runProbe(context.Background(), tc.args, &bytes.Buffer{})
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.says) {
				t.Fatalf("err %v: want %v saying %q", err, tc.want, tc.says)
			}
		})
	}
}

// TestRenamedFlagsStillParse: the old names of renamed flags are taken
// (the command goes on to its real failure here: nobody serves), not a
// usage error.
func TestRenamedFlagsStillParse(t *testing.T) {
	none := "unix://" + filepath.Join(t.TempDir(), "none.sock")
	// Above the kernel's largest pid_max: unmount finds no such process
	// and touches no mount.
	const noPID = "4194305"
	for _, tc := range []struct {
		cmd  string
		args []string
	}{
		{"probe", []string{"--endpoint", none, "--timeout", "100ms"}},
		{"probe", []string{"--mounter-endpoint", none, "--timeout", "100ms"}},
		{"unmount", []string{"--plugin-endpoint", none, "--volume-id", "v", "--pid", noPID, "--target", "/mountplan-test-none", "--remove-target", "--timeout", "100ms"}},
		{"unmount", []string{"--plugin-endpoint", none, "--volume-id", "v", "--pid", noPID, "--target", "/mountplan-test-none", "--remove-mount-point", "--timeout", "100ms"}},
	} {
		err := run(context.Background(), tc.cmd, tc.args)
		if err == nil || errors.Is(err, errUsage) {
			t.Errorf("%s %q: %v, want the failure to reach nobody, not a usage error", tc.cmd, tc.args, err)
		}
	}
}
