//go:build vmtest

package vm

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

// resetMarker is the line on which the guest's reboot test asks for the
// reset (test/vm/guest/reboot_test.go prints it).
const resetMarker = "MOUNTPLAN-GUEST-RESET-NOW"

// disk is a raw disk image the guest finds by its serial number.
type disk struct {
	path, serial string
}

// persistDisks makes the reboot test's two ext4 disks (sparse images):
// the node's (the plugin's state dir, kubelet's directories, the
// mounter's records, /etc/iscsi) and the servers' (NBD exports, iSCSI
// LUNs). They outlive the reset because qemu writes them to these files.
func persistDisks(t *testing.T, dir string) []disk {
	t.Helper()
	disks := []disk{{filepath.Join(dir, "node.img"), "mpnode"}, {filepath.Join(dir, "server.img"), "mpserver"}}
	for _, d := range disks {
		f, err := os.Create(d.path)
		if err == nil {
			err = f.Truncate(256 << 20)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			t.Fatal(err)
		}
		run(t, "", "mkfs.ext4", "-q", "-F", "-b", "4096", "-L", d.serial, d.path)
	}
	return disks
}

// kvmInternalError is what qemu prints when KVM cannot run the guest on.
const kvmInternalError = "KVM internal error"

// booted is the outcome of one qemu run.
type booted struct {
	out       string // the serial output, lines ending in \n
	reset     bool   // the guest printed the marker and the host reset it
	resetTook time.Duration
}

// boot runs qemu as VM-NOTES.md measured it (on KVM where /dev/kvm
// works, chooseAccel), with the disks attached, and
// returns the serial output. When resetOn is set and the guest prints it,
// the host resets the machine through qemu's monitor (system_reset: no
// sync, no orderly stop, as a power loss); -no-reboot makes qemu exit
// then, and the next boot is a new qemu over the same disk files.
func boot(t *testing.T, vmlinux, initrd, serial string, disks []disk, appendArgs, resetOn string) booted {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	smp := "2"
	if runtime.NumCPU() < 2 {
		smp = "1"
	}
	monitor := filepath.Join(filepath.Dir(serial), "monitor-"+filepath.Base(serial)+".sock")
	args := slices.Concat(chooseAccel().args, []string{"-smp", smp, "-m", "1024",
		"-nographic", "-no-reboot", "-nic", "none", "-kernel", vmlinux, "-initrd", initrd,
		"-monitor", "unix:" + monitor + ",server=on,wait=off",
		"-append", strings.TrimSpace("console=ttyS0 panic=-1 rdinit=/init loglevel=4 " + appendArgs)})
	for _, d := range disks {
		args = append(args, "-drive", fmt.Sprintf("file=%s,format=raw,if=none,id=%s", d.path, d.serial),
			"-device", fmt.Sprintf("virtio-blk-pci,drive=%s,serial=%s", d.serial, d.serial))
	}
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", args...)
	f, err := os.Create(serial)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		t.Fatalf("qemu: %v", err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()
	// On a KVM internal error qemu stops the guest and waits: end it at
	// once instead of at the timeout.
	kvmFailed := make(chan struct{})
	go func() {
		if waitForMarker(serial, kvmInternalError, exited) {
			close(kvmFailed)
			_ = cmd.Process.Kill()
		}
	}()

	var res booted
	if resetOn != "" && waitForMarker(serial, resetOn, exited) {
		start := time.Now()
		if err := hmp(monitor, "system_reset", exited); err != nil {
			t.Errorf("system_reset: %v", err)
		}
		select {
		case <-exited:
			res.reset, res.resetTook = true, time.Since(start)
		case <-time.After(time.Minute):
			_ = cmd.Process.Kill()
			<-exited
			t.Errorf("qemu did not exit within a minute of system_reset (-no-reboot)")
		}
	}
	<-exited
	b, _ := os.ReadFile(serial)
	res.out = strings.ReplaceAll(string(b), "\r\n", "\n")
	select {
	case <-kvmFailed:
		t.Logf("serial output:\n%s", res.out)
		t.Fatalf("qemu on %s: %q: this machine's KVM cannot run the guest; MOUNTPLAN_VM_ACCEL=tcg runs it on TCG", chooseAccel(), kvmInternalError)
	default:
	}
	if waitErr != nil {
		t.Logf("serial output:\n%s", res.out)
		t.Fatalf("qemu: %v", waitErr)
	}
	return res
}

// waitForMarker reports whether the serial output shows marker before
// qemu exits.
func waitForMarker(serial, marker string, exited <-chan struct{}) bool {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if b, err := os.ReadFile(serial); err == nil && bytes.Contains(b, []byte(marker)) {
			return true
		}
		select {
		case <-exited:
			b, _ := os.ReadFile(serial)
			return bytes.Contains(b, []byte(marker))
		case <-tick.C:
		}
	}
}

// hmp sends one command to qemu's human monitor and keeps the connection
// until qemu exits (system_reset with -no-reboot) or a few seconds pass.
func hmp(socket, command string, exited <-chan struct{}) error {
	c, err := net.DialTimeout("unix", socket, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := c.Write([]byte(command + "\n")); err != nil {
		return err
	}
	select {
	case <-exited:
	case <-time.After(5 * time.Second):
	}
	return nil
}
