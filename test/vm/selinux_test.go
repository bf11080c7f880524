//go:build vmtest

package vm

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// selinuxBootArgs boot Debian's kernel (SELinux built in, off by default)
// with SELinux as its major LSM, permissive: the guest then loads the
// policy compilePolicy made and shows what context= labels (issue 36).
// Permissive is what the proof needs (labels are given and read the same
// way enforcing or not) and what a policy this small can run under.
const selinuxBootArgs = "mountplan.phase=selinux security=selinux selinux=1 enforcing=0"

// policyConf is the smallest MLS policy that makes kubelet's label of a
// pod valid: the user, role and type of
// system_u:object_r:container_file_t:s0:c1,c2, one sensitivity with 1024
// categories, the kernel's initial SIDs (in the kernel's order, which
// numbers them), and labelling rules for what the guest's /init mounts.
// Classes the policy does not declare are allowed (checkpolicy -U allow),
// so the kernel runs with it although it names a handful only. Written
// here, not taken from Debian's refpolicy (selinux-policy-default): that
// one is built by semodule at install time, megabytes of modules that a
// busybox guest has no tools to link; this compiles on the host in
// milliseconds with checkpolicy alone.
func policyConf() string {
	sids := strings.Fields(`kernel security unlabeled fs file file_labels init any_socket port netif netmsg node
		igmp_packet icmp_socket tcp_socket sysctl_modprobe sysctl sysctl_fs sysctl_kernel sysctl_net sysctl_net_unix
		sysctl_vm sysctl_dev kmod policy scmp_packet devnull`)
	fileClasses := strings.Fields("file lnk_file chr_file blk_file sock_file fifo_file")
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	for _, c := range append([]string{"security", "process", "filesystem", "dir"}, fileClasses...) {
		line("class %s", c)
	}
	for _, s := range sids {
		line("sid %s", s)
	}
	line("common file { ioctl read write create getattr setattr lock relabelfrom relabelto append unlink link rename execute quotaon mounton }")
	line("class security { load_policy setenforce }")
	line("class process { fork transition dyntransition }") // the kernel requires both transitions
	line("class filesystem { mount remount unmount getattr relabelfrom relabelto associate }")
	line("class dir inherits file { add_name remove_name reparent search rmdir }")
	for _, c := range fileClasses {
		line("class %s inherits file", c)
	}
	line("sensitivity s0;")
	line("dominance { s0 }")
	for i := range 1024 {
		line("category c%d;", i)
	}
	line("level s0:c0.c1023;")
	// checkpolicy's grammar wants one MLS constraint.
	line("mlsconstrain file { read } ( l1 eq l2 or l1 domby h2 );")
	for _, ty := range strings.Fields("kernel_t unlabeled_t fs_t file_t tmpfs_t proc_t sysfs_t container_file_t") {
		line("type %s;", ty)
	}
	line("role system_r;")
	line("role system_r types { kernel_t };")
	line("allow kernel_t self:process { fork };")
	line("user system_u roles { system_r } level s0 range s0 - s0:c0.c1023;")
	for _, s := range sids {
		ctx := "system_u:object_r:unlabeled_t:s0"
		switch s {
		case "kernel":
			ctx = "system_u:system_r:kernel_t:s0 - s0:c0.c1023"
		case "fs":
			ctx = "system_u:object_r:fs_t:s0"
		case "file":
			ctx = "system_u:object_r:file_t:s0"
		}
		line("sid %s %s", s, ctx)
	}
	line("fs_use_xattr ext4 system_u:object_r:fs_t:s0;")
	line("fs_use_trans tmpfs system_u:object_r:tmpfs_t:s0;")
	line("fs_use_trans devtmpfs system_u:object_r:tmpfs_t:s0;")
	line("genfscon proc / system_u:object_r:proc_t:s0")
	line("genfscon sysfs / system_u:object_r:sysfs_t:s0")
	line("genfscon selinuxfs / system_u:object_r:sysfs_t:s0")
	return b.String()
}

// compilePolicy compiles policyConf into a binary policy of version 33
// (Linux 6.1's newest) and returns it.
func compilePolicy(t *testing.T, dir string) []byte {
	t.Helper()
	conf, out := filepath.Join(dir, "policy.conf"), filepath.Join(dir, "policy.33")
	if err := os.WriteFile(conf, []byte(policyConf()), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, err := exec.Command("checkpolicy", "-M", "-U", "allow", "-c", "33", "-o", out, conf).CombinedOutput(); err != nil {
		t.Fatalf("checkpolicy: %v\n%s", err, b)
	}
	pol, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return pol
}

// checkSELinuxBoot fails t unless the SELinux boot's tests all ran and
// passed.
func checkSELinuxBoot(t *testing.T, r guestResult) {
	t.Helper()
	if r.exit == "" {
		t.Fatalf("the SELinux boot did not report its tests' exit status; serial output in the log above")
	}
	want := []string{"TestSELinuxLoopVolume", "TestSELinuxChain", "TestSELinuxFuseFdMode"}
	for _, name := range want {
		found := false
		for _, res := range r.results {
			if res.name == name {
				found = true
				if res.verdict != "PASS" {
					t.Errorf("SELinux boot: guest %s: %s", name, res.verdict)
				}
			}
		}
		if !found {
			t.Errorf("SELinux boot: guest %s did not run", name)
		}
	}
	if r.exit != "0" {
		t.Errorf("SELinux boot: guest tests failed (exit %s)", r.exit)
	}
	for _, l := range r.lines {
		if strings.Contains(l, "MOUNTPLAN-SELINUX") || strings.Contains(l, "SELinux:") {
			t.Logf("SELinux boot: %s", strings.TrimSpace(l))
		}
	}
}
