//go:build vmtest

// Package vm boots Debian's kernel (which has the nbd and iscsi_tcp
// modules the CI kernel lacks) under qemu with an initramfs built here, and
// runs the static test binary of ./guest inside it: the whole NBD and iSCSI
// flows of the plugin's own code against servers on the guest's loopback.
// The host test fails when the guest's tests fail.
//
// It builds only with the vmtest tag (make test-vm), so that `go test ./...`
// and make test neither run nor skip it; the guest's tests build only with
// the vmguest tag, which this test sets. The kernel package is cached under
// /var/cache/mountplan-vm (MOUNTPLAN_VM_CACHE).
package vm

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/testenv"
)

// timings collects the durations of the run's steps for the summary.
type timings struct {
	names []string
	durs  []time.Duration
}

func (tm *timings) add(name string, d time.Duration) {
	tm.names, tm.durs = append(tm.names, name), append(tm.durs, d)
}

func (tm *timings) start(name string) func() {
	t0 := time.Now()
	return func() { tm.add(name, time.Since(t0)) }
}

// guestTools are the host programs the guest needs, with their libraries.
var guestTools = []string{"nbdkit", "mke2fs", "resize2fs", "blkid", "tgtd", "tgtadm", "iscsid", "iscsiadm", "squashfuse", "mksquashfs"}

// guestModules are loaded, with their dependencies, before the tests run.
var guestModules = []string{"nbd", "iscsi_tcp", "sd_mod", "ext4", "loop", "fuse"}

const initScript = `#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mkdir -p /run/lock/iscsi /var/run/tgtd /etc/iscsi/nodes /etc/iscsi/send_targets
ip link set lo up
t0=$(cat /proc/uptime)
for m in $(cat /modules/order); do insmod $m || echo "MOUNTPLAN-GUEST insmod $m failed"; done
echo "MOUNTPLAN-GUEST modules loaded at $(cat /proc/uptime | cut -d' ' -f1)s uptime (init at ${t0%% *}s)"
cd /tmp
MOUNTPLAN_VM_GUEST=1 TMPDIR=/tmp /guest.test -test.v -test.timeout=240s -test.count=1
echo "MOUNTPLAN-GUEST-EXIT=$?"
poweroff -f
`

func TestVM(t *testing.T) {
	testenv.RequireRoot(t) // apt-get download into its cache
	testenv.RequireCommands(t, "qemu-system-x86_64", "apt-get", "apt-cache", "dpkg-deb", "depmod", "modprobe", "ldd", "busybox", "xz")
	tm := &timings{}
	total := time.Now()
	k := fetchKernel(t, tm)
	work := t.TempDir()

	stop := tm.start("build static guest test binary")
	guestBin := filepath.Join(work, "guest.test")
	cmd := exec.Command("go", "test", "-c", "-tags", "vmguest", "-o", guestBin, "./guest")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go test -c ./guest: %v\n%s", err, out)
	}
	// The mounter's FUSE daemon tests, which the guest runs where the
	// memory and cpu controllers are (TestMounterDaemonCgroup).
	mounterBin := filepath.Join(work, "mounter.test")
	cmd = exec.Command("go", "test", "-c", "-o", mounterBin, "../../internal/mounter")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go test -c ./internal/mounter: %v\n%s", err, out)
	}
	stop()

	stop = tm.start("build initramfs")
	a := newArchive()
	for _, d := range []string{"/proc", "/sys", "/dev", "/tmp", "/run", "/bin", "/sbin", "/usr/bin", "/usr/sbin", "/var"} {
		a.dir(d)
	}
	a.symlink("/var/run", "/run")
	busybox, _ := exec.LookPath("busybox")
	a.copyFile(t, busybox, "/bin/busybox")
	a.file("/init", []byte(initScript), 0o755)
	for _, tool := range guestTools {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatalf("%s is not installed: run hack/install-deps.sh", tool)
		}
		a.binary(t, p)
	}
	mke2fs, _ := exec.LookPath("mke2fs")
	mke2fs, _ = filepath.EvalSymlinks(mke2fs)
	a.symlink(filepath.Join(filepath.Dir(mke2fs), "mkfs.ext4"), "mke2fs")
	plugins, _ := filepath.Glob("/usr/lib/*/nbdkit/plugins/nbdkit-file-plugin.so")
	if len(plugins) == 0 {
		t.Fatal("nbdkit's file plugin is not installed (Debian package nbdkit)")
	}
	a.copyFile(t, plugins[0], plugins[0])
	a.libraries(t, plugins[0])
	if _, err := os.Stat("/etc/mke2fs.conf"); err == nil {
		a.copyFile(t, "/etc/mke2fs.conf", "/etc/mke2fs.conf")
	}
	a.file("/etc/passwd", []byte("root:x:0:0:root:/root:/bin/sh\n"), 0o644)
	a.file("/etc/group", []byte("root:x:0:\n"), 0o644)
	a.file("/etc/iscsi/initiatorname.iscsi", []byte("InitiatorName=iqn.2024-01.io.mountplan:guest\n"), 0o600)
	a.file("/etc/iscsi/iscsid.conf", []byte("iscsid.startup = /usr/sbin/iscsid\nnode.startup = manual\nnode.session.scan = auto\n"+
		"node.conn[0].timeo.login_timeout = 15\nnode.session.initial_login_retry_max = 1\n"), 0o600)
	order := a.modules(t, k, guestModules...)
	a.file("/modules/order", []byte(strings.Join(order, "\n")+"\n"), 0o644)
	a.copyFile(t, guestBin, "/guest.test")
	a.copyFile(t, mounterBin, "/mounter.test")
	// mksquashfs's threads dlopen libgcc_s at pthread_exit; ldd does not
	// list it.
	if libgcc, err := filepath.Glob("/lib/*/libgcc_s.so.1"); err == nil && len(libgcc) > 0 {
		a.copyFile(t, libgcc[0], libgcc[0])
	}
	initrd := filepath.Join(work, "initrd.cpio")
	size, err := a.write(initrd)
	if err != nil {
		t.Fatal(err)
	}
	stop()
	t.Logf("initramfs: %d MiB, %d entries, %d modules", size>>20, len(a.entries), len(order))

	serial := filepath.Join(work, "serial.log")
	stop = tm.start("qemu run (boot, guest tests, poweroff)")
	out := boot(t, k.Vmlinux, initrd, serial)
	stop()
	tm.add("total", time.Since(total))

	res := parseGuest(out)
	for _, line := range res.lines {
		t.Log(line)
	}
	var sum strings.Builder
	fmt.Fprintf(&sum, "VM test timings (kernel %s):\n", k.Package)
	for i, n := range tm.names {
		fmt.Fprintf(&sum, "  %-45s %8.1fs\n", n, tm.durs[i].Seconds())
	}
	if res.modulesAt != "" {
		fmt.Fprintf(&sum, "  %-45s %8s\n", "guest: modules loaded at uptime", res.modulesAt)
	}
	for _, r := range res.results {
		fmt.Fprintf(&sum, "  guest %-39s %8s  %s\n", r.name, r.dur, r.verdict)
	}
	t.Log(sum.String())
	switch {
	case res.exit == "":
		t.Fatalf("the guest did not report its tests' exit status; serial output in the log above")
	case res.exit != "0" || len(res.results) == 0:
		t.Fatalf("guest tests failed (exit %s)", res.exit)
	}
	for _, r := range res.results {
		if r.verdict != "PASS" {
			t.Errorf("guest %s: %s", r.name, r.verdict)
		}
	}
}

// boot runs qemu as VM-NOTES.md measured it and returns the serial output.
func boot(t *testing.T, vmlinux, initrd, serial string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	smp := "2"
	if runtime.NumCPU() < 2 {
		smp = "1"
	}
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", smp, "-m", "1024",
		"-nographic", "-no-reboot", "-nic", "none", "-kernel", vmlinux, "-initrd", initrd,
		"-append", "console=ttyS0 panic=-1 rdinit=/init loglevel=4")
	f, err := os.Create(serial)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd.Stdout, cmd.Stderr = f, f
	err = cmd.Run()
	b, _ := os.ReadFile(serial)
	out := strings.ReplaceAll(string(b), "\r\n", "\n")
	if err != nil {
		t.Logf("serial output:\n%s", out)
		t.Fatalf("qemu: %v", err)
	}
	return out
}

type guestResult struct {
	lines     []string
	exit      string
	modulesAt string
	results   []struct{ name, verdict, dur string }
}

var (
	resultLine  = regexp.MustCompile(`^\s*--- (PASS|FAIL|SKIP): (\S+) \(([0-9.]+s)\)`)
	modulesLine = regexp.MustCompile(`modules loaded at ([0-9.]+s)`)
)

// parseGuest reads the guest's serial output: go test -v lines, the exit
// status /init prints, and the module load time.
func parseGuest(out string) guestResult {
	var r guestResult
	sc := bufio.NewScanner(bytes.NewReader([]byte(out)))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		r.lines = append(r.lines, line)
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "MOUNTPLAN-GUEST-EXIT="); ok {
			r.exit = v
		}
		if m := modulesLine.FindStringSubmatch(line); m != nil {
			r.modulesAt = m[1]
		}
		if m := resultLine.FindStringSubmatch(line); m != nil {
			r.results = append(r.results, struct{ name, verdict, dur string }{m[2], m[1], m[3]})
		}
	}
	return r
}
