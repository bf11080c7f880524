// Command csictl makes single CSI calls against a plugin socket, for the
// demo and for poking at a running plugin by hand:
//
//	csictl -endpoint unix:///tmp/csi.sock create NAME [SIZE_BYTES]
//	csictl -endpoint ... stage VOLUME_ID STAGING_PATH [block]
//	csictl -endpoint ... unstage VOLUME_ID STAGING_PATH
//	csictl -endpoint ... delete VOLUME_ID
//	csictl -endpoint ... probe
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mountplan/mountplan/internal/endpoint"
)

func main() {
	ep := flag.String("endpoint", "unix:///csi/csi.sock", "plugin endpoint (the plugin's default)")
	timeout := flag.Duration("timeout", 2*time.Minute, "per-call timeout")
	flag.Parse()
	if err := run(*ep, *timeout, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "csictl:", err)
		os.Exit(1)
	}
}

func run(ep string, timeout time.Duration, args []string) error {
	if len(args) == 0 {
		return fmt.Errorf("usage: csictl [-endpoint EP] create|stage|unstage|delete|probe ARGS")
	}
	conn, err := endpoint.Dial(ep)
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	ctrl, node := csi.NewControllerClient(conn), csi.NewNodeClient(conn)
	need := func(n int) error {
		if len(args) < n {
			return fmt.Errorf("%s needs %d argument(s)", args[0], n-1)
		}
		return nil
	}
	switch args[0] {
	case "create":
		if err := need(2); err != nil {
			return err
		}
		size := int64(64 << 20)
		if len(args) > 2 {
			if size, err = strconv.ParseInt(args[2], 10, 64); err != nil {
				return err
			}
		}
		resp, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: args[1],
			CapacityRange: &csi.CapacityRange{RequiredBytes: size}, Parameters: map[string]string{"type": "loop"},
			VolumeCapabilities: []*csi.VolumeCapability{capability(false)}})
		if err != nil {
			return err
		}
		fmt.Println(resp.GetVolume().GetVolumeId())
	case "stage":
		if err := need(3); err != nil {
			return err
		}
		_, err = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: args[1], StagingTargetPath: args[2],
			VolumeCapability: capability(len(args) > 3 && args[3] == "block")})
	case "unstage":
		if err := need(3); err != nil {
			return err
		}
		_, err = node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: args[1], StagingTargetPath: args[2]})
	case "delete":
		if err := need(2); err != nil {
			return err
		}
		_, err = ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: args[1]})
	case "probe":
		resp, perr := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
		if perr != nil {
			return perr
		}
		if !resp.GetReady().GetValue() {
			return fmt.Errorf("not ready")
		}
		fmt.Println("ready")
	default:
		return fmt.Errorf("unknown command %q", args[0])
	}
	return err
}

func capability(block bool) *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}
	if block {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}
	}
	return c
}
