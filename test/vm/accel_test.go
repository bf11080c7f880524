//go:build vmtest

package vm

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// The accelerator qemu runs the guest on: KVM where /dev/kvm lets this
// process create a VM and the kernel's KVM is hardware-assisted (kvm_intel
// or kvm_amd), TCG (qemu's software emulation) elsewhere, as on a CI
// machine without nested virtualization. A /dev/kvm served by another
// implementation is not used: on kvm_pvm (a guest's KVM without VMX, by
// shadow paging) Debian's 6.1 kernel stopped early in its boot with a KVM
// "emulation failure" (lock cmpxchg16b) under -cpu host, and without cx16
// had not reached /init after 40 s (TCG: about 3 s). MOUNTPLAN_VM_ACCEL=tcg or =kvm forces
// one (kvm: wherever KVM_CREATE_VM succeeds).
type accel struct {
	name string   // "kvm" or "tcg"
	args []string // qemu's -accel and -cpu
	why  string   // what the probe found
}

var (
	accelOnce   sync.Once
	accelChosen accel
)

// chooseAccel probes /dev/kvm once.
func chooseAccel() accel {
	accelOnce.Do(func() {
		// -cpu max gives RDRAND, so the guest's RNG is ready at once.
		tcg := accel{name: "tcg", args: []string{"-accel", "tcg,thread=multi", "-cpu", "max"}}
		force := os.Getenv("MOUNTPLAN_VM_ACCEL")
		if force == "tcg" {
			tcg.why = "MOUNTPLAN_VM_ACCEL=tcg"
			accelChosen = tcg
			return
		}
		if err := probeKVM(); err != nil {
			tcg.why = err.Error()
			accelChosen = tcg
			return
		}
		hw := hardwareKVM()
		if hw == "" && force != "kvm" {
			tcg.why = "/dev/kvm creates VMs, but its KVM is not hardware-assisted (" + kvmModules() + "; no kvm_intel or kvm_amd): TCG"
			accelChosen = tcg
			return
		}
		why := "/dev/kvm: KVM_CREATE_VM succeeded, " + hw
		if hw == "" {
			why = "MOUNTPLAN_VM_ACCEL=kvm; /dev/kvm: KVM_CREATE_VM succeeded on " + kvmModules()
		}
		// -cpu host passes the host's CPU (RDRAND with it where it has one).
		accelChosen = accel{name: "kvm", args: []string{"-accel", "kvm", "-cpu", "host"}, why: why}
	})
	return accelChosen
}

// The ioctls of linux/kvm.h the probe makes (KVMIO 0xAE).
const (
	kvmGetAPIVersion = 0xAE00
	kvmCreateVM      = 0xAE01
	kvmAPIVersion    = 12 // stable since Linux 2.6.22
)

// probeKVM opens /dev/kvm and creates (and closes) a VM, as qemu's -accel
// kvm would: a device node that exists is not enough (a container may
// have it without the permission, a nested guest without the hardware).
func probeKVM() error {
	fd, err := unix.Open("/dev/kvm", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open /dev/kvm: %w", err)
	}
	defer unix.Close(fd)
	v, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), kvmGetAPIVersion, 0)
	if errno != 0 {
		return fmt.Errorf("KVM_GET_API_VERSION on /dev/kvm: %w", errno)
	}
	if v != kvmAPIVersion {
		return fmt.Errorf("/dev/kvm: API version %d, want %d", v, kvmAPIVersion)
	}
	vm, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), kvmCreateVM, 0)
	if errno != 0 {
		return fmt.Errorf("KVM_CREATE_VM on /dev/kvm: %w", errno)
	}
	unix.Close(int(vm))
	return nil
}

// hardwareKVM names the hardware-assisted KVM module loaded, or "".
func hardwareKVM() string {
	for _, m := range []string{"kvm_intel", "kvm_amd"} {
		if _, err := os.Stat("/sys/module/" + m); err == nil {
			return m
		}
	}
	return ""
}

// kvmModules lists the loaded modules named kvm_*.
func kvmModules() string {
	ms, _ := filepath.Glob("/sys/module/kvm_*")
	var names []string
	for _, m := range ms {
		names = append(names, filepath.Base(m))
	}
	if len(names) == 0 {
		return "no kvm_* module"
	}
	return strings.Join(names, ", ")
}

func (a accel) String() string {
	return fmt.Sprintf("%s (qemu %v; %s)", a.name, a.args, a.why)
}
