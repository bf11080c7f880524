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
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
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
var guestTools = []string{"nbdkit", "mke2fs", "e2fsck", "resize2fs", "blkid", "tgtd", "tgtadm", "iscsid", "iscsiadm", "squashfuse", "mksquashfs"}

// guestModules are loaded, with their dependencies, before the tests run
// (virtio_blk for the reboot test's disks, fuse for the daemons' cgroups,
// squashfs and overlay for the SELinux boot's chain).
var guestModules = []string{"nbd", "iscsi_tcp", "sd_mod", "ext4", "loop", "fuse", "virtio_pci", "virtio_blk", "squashfs", "overlay"}

// initScript is the guest's /init. The first boot runs the guest's tests,
// then the reboot test's first phase, which ends in the host's reset; the
// boot after the reset (mountplan.phase=after on the kernel's command
// line) runs its second phase. Both phases mount the two disks the host
// attached (persistDisks), found by their serial numbers.
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
disk() { for d in /sys/block/vd*; do [ "$(cat $d/serial 2>/dev/null)" = "$1" ] && echo /dev/${d##*/}; done; }
# The node's disk keeps only what was synced (commit=600, no periodic
# writeback), and holds /etc/iscsi as a node's root disk does.
persist() {
	mkdir -p /persist /srv
	mount -t ext4 -o commit=600 "$(disk mpnode)" /persist || return 1
	mount -t ext4 "$(disk mpserver)" /srv || return 1
	[ -d /persist/iscsi ] || cp -a /etc/iscsi /persist/iscsi || return 1
	mount --bind /persist/iscsi /etc/iscsi || return 1
	echo 0 > /proc/sys/vm/dirty_writeback_centisecs
}
case " $(cat /proc/cmdline) " in
*" mountplan.phase=selinux "*)
	MOUNTPLAN_VM_GUEST=1 TMPDIR=/tmp /guest.test -test.v -test.timeout=240s -test.count=1 -test.run '^TestSELinux'
	echo "MOUNTPLAN-GUEST-EXIT=$?"
	;;
*" mountplan.phase=after "*)
	persist || echo "MOUNTPLAN-GUEST mounting the disks failed"
	MOUNTPLAN_VM_GUEST=1 MOUNTPLAN_VM_REBOOT=after TMPDIR=/tmp /guest.test -test.v -test.timeout=240s -test.count=1 -test.run '^TestRebootAfter$'
	echo "MOUNTPLAN-GUEST-EXIT=$?"
	;;
*)
	MOUNTPLAN_VM_GUEST=1 TMPDIR=/tmp /guest.test -test.v -test.timeout=240s -test.count=1 -test.skip '^TestReboot|^TestSELinux'
	echo "MOUNTPLAN-GUEST-EXIT=$?"
	persist || echo "MOUNTPLAN-GUEST mounting the disks failed"
	MOUNTPLAN_VM_GUEST=1 MOUNTPLAN_VM_REBOOT=before TMPDIR=/tmp /guest.test -test.v -test.timeout=240s -test.count=1 -test.run '^TestRebootBefore$'
	echo "MOUNTPLAN-GUEST-REBOOT-EXIT=$?"
	;;
esac
# No sync: a session whose target died (a failed test) would hold it for
# iSCSI's two-minute replacement timeout, and the disks are thrown away.
poweroff -f -n
`

func TestVM(t *testing.T) {
	testenv.RequireRoot(t) // apt-get download into its cache
	testenv.RequireCommands(t, "qemu-system-x86_64", "apt-get", "apt-cache", "dpkg-deb", "depmod", "modprobe", "ldd", "busybox", "xz", "checkpolicy")
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
	a.dir("/selinux")
	a.file("/selinux/policy", compilePolicy(t, work), 0o644)
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

	ac := chooseAccel()
	t.Logf("qemu accelerator: %v", ac)
	fmt.Printf("=== VM on %s\n", ac)
	if os.Getenv("MOUNTPLAN_VM_ONLY") == "selinux" {
		// For work on the SELinux boot alone: the other boots are
		// skipped, which the log says; make test-vm never sets it.
		t.Log("MOUNTPLAN_VM_ONLY=selinux: only the SELinux boot runs")
		third := boot(t, k.Vmlinux, initrd, filepath.Join(work, "serial-3.log"), nil, selinuxBootArgs, "")
		labelled := parseGuest(third.out)
		logLines(t, "boot 3 (SELinux)", labelled.lines)
		checkSELinuxBoot(t, labelled)
		return
	}

	stop = tm.start("make the reboot test's disks")
	disks := persistDisks(t, work)
	stop()

	stop = tm.start("qemu run 1 (guest tests, reboot test to reset)")
	first := boot(t, k.Vmlinux, initrd, filepath.Join(work, "serial-1.log"), disks, "", resetMarker)
	stop()
	res := parseGuest(first.out)
	logLines(t, "boot 1", res.lines)
	var after guestResult
	if first.reset {
		tm.add("  of which the reset (marker to qemu's exit)", first.resetTook)
		stop = tm.start("qemu run 2 (boot after the reset, recovery)")
		second := boot(t, k.Vmlinux, initrd, filepath.Join(work, "serial-2.log"), disks, "mountplan.phase=after", "")
		stop()
		after = parseGuest(second.out)
		logLines(t, "boot 2", after.lines)
	}
	stop = tm.start("qemu run 3 (SELinux on, permissive: context= labels)")
	third := boot(t, k.Vmlinux, initrd, filepath.Join(work, "serial-3.log"), nil, selinuxBootArgs, "")
	stop()
	labelled := parseGuest(third.out)
	logLines(t, "boot 3 (SELinux)", labelled.lines)
	tm.add("total", time.Since(total))
	t.Log(summary(k, tm, res, first.reset, after))
	checkSELinuxBoot(t, labelled)

	switch {
	case res.exit == "":
		t.Fatalf("the guest did not report its tests' exit status; serial output in the log above")
	case res.exit != "0" || len(res.results) == 0:
		t.Errorf("guest tests failed (exit %s)", res.exit)
	}
	for _, r := range append(res.results, after.results...) {
		if r.verdict != "PASS" {
			t.Errorf("guest %s: %s", r.name, r.verdict)
		}
	}
	switch {
	case !first.reset:
		t.Errorf("the reboot test's first boot never asked for the reset (exit %q); serial output in the log above", res.rebootExit)
	case after.exit == "":
		t.Errorf("the boot after the reset did not report its test's exit status; serial output in the log above")
	case after.exit != "0" || len(after.results) != 1:
		t.Errorf("the reboot test's second boot failed (exit %s)", after.exit)
	}
}

func logLines(t *testing.T, boot string, lines []string) {
	t.Helper()
	t.Logf("serial output of %s:", boot)
	for _, line := range lines {
		t.Log(line)
	}
}

// summary lays out the run's timings and the guest's verdicts.
func summary(k kernel, tm *timings, res guestResult, reset bool, after guestResult) string {
	var sum strings.Builder
	fmt.Fprintf(&sum, "VM test timings (kernel %s, qemu on %s):\n", k.Package, chooseAccel().name)
	for i, n := range tm.names {
		fmt.Fprintf(&sum, "  %-45s %8.2fs\n", n, tm.durs[i].Seconds())
	}
	if res.modulesAt != "" {
		fmt.Fprintf(&sum, "  %-45s %8s\n", "guest: modules loaded at uptime", res.modulesAt)
	}
	for _, r := range res.results {
		fmt.Fprintf(&sum, "  guest %-39s %8s  %s\n", r.name, r.dur, r.verdict)
	}
	if reset {
		fmt.Fprintf(&sum, "  guest %-39s %8s  %s\n", "TestRebootBefore", "", "reached the reset")
	}
	if after.modulesAt != "" {
		fmt.Fprintf(&sum, "  %-45s %8s\n", "guest after the reset: modules loaded at", after.modulesAt)
	}
	for _, tg := range append(res.timings, after.timings...) {
		fmt.Fprintf(&sum, "  guest: %-38s %8s\n", tg[0], tg[1])
	}
	for _, r := range after.results {
		fmt.Fprintf(&sum, "  guest %-39s %8s  %s\n", r.name, r.dur, r.verdict)
	}
	return sum.String()
}

type guestResult struct {
	lines      []string
	exit       string
	rebootExit string
	modulesAt  string
	results    []struct{ name, verdict, dur string }
	timings    [][2]string
}

var (
	resultLine  = regexp.MustCompile(`^\s*--- (PASS|FAIL|SKIP): (\S+) \(([0-9.]+s)\)`)
	modulesLine = regexp.MustCompile(`modules loaded at ([0-9.]+s)`)
	timingLine  = regexp.MustCompile(`^MOUNTPLAN-GUEST-TIMING (.+) ([0-9.]+s)$`)
)

// parseGuest reads the guest's serial output: go test -v lines, the exit
// statuses /init prints, the module load time and the guest's timings.
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
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "MOUNTPLAN-GUEST-REBOOT-EXIT="); ok {
			r.rebootExit = v
		}
		if m := modulesLine.FindStringSubmatch(line); m != nil {
			r.modulesAt = m[1]
		}
		if m := timingLine.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
			r.timings = append(r.timings, [2]string{m[1], m[2]})
		}
		if m := resultLine.FindStringSubmatch(line); m != nil {
			r.results = append(r.results, struct{ name, verdict, dur string }{m[2], m[1], m[3]})
		}
	}
	return r
}
