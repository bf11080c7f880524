//go:build clustertest

package cluster

// The privilege split, seen in the running cluster: the plugin's container
// holds no capability and no host namespace, and what it would need them
// for is refused; the mounter's holds them.

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// pluginUnprivileged execs into the plugin's container (found by its name
// in the node pod) and shows: its process (the container's PID 1) has no
// CAP_SYS_ADMIN, nor any capability at all; it does not share the node's
// PID namespace; nsenter into PID 1's mount namespace, a tmpfs mount and a
// new user namespace are refused; it has no device node of the host and
// sees neither the mounter's records nor the host's processes, nor
// kubelet's registration directory, nor its pods/ and CSI directories. The
// mounter's container, for contrast, holds CAP_SYS_ADMIN in the node's PID
// namespace. Its socket's directory is mode 0700 on the node.
func pluginUnprivileged(t *testing.T, e *env) {
	in := func(cmd ...string) (string, error) {
		return e.containerExec(t, nodeComponent, pluginContainer, cmd...)
	}
	mustIn := func(cmd ...string) string {
		t.Helper()
		out, err := in(cmd...)
		if err != nil {
			t.Fatalf("plugin container: %q: %v", cmd, err)
		}
		return strings.TrimSpace(out)
	}
	refused := func(what string, cmd ...string) {
		t.Helper()
		out, err := in(cmd...)
		if err == nil {
			t.Errorf("plugin container: %s succeeded: %q: %s", what, cmd, out)
			return
		}
		t.Logf("plugin container: %s refused: %q: %v", what, cmd, lastLines(strings.TrimSpace(out+" "+err.Error()), 3))
	}

	// The plugin's own process: PID 1 of the container, named as the chart runs it.
	if comm := mustIn("cat", "/proc/1/comm"); comm != pluginComm {
		t.Errorf("PID 1 of the plugin's container is %q, want %s", comm, pluginComm)
	}
	status := map[string]string{}
	for _, p := range []string{"/proc/1/status", "/proc/self/status"} {
		s := mustIn("cat", p)
		status[p] = s
		var fields []string
		for _, l := range strings.Split(s, "\n") {
			for _, k := range []string{"CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:", "NoNewPrivs:", "Seccomp:", "NSpid:"} {
				if strings.HasPrefix(l, k) {
					fields = append(fields, strings.Join(strings.Fields(l), " "))
				}
			}
		}
		t.Logf("plugin container %s: %s", p, strings.Join(fields, "; "))
		caps, err := capEff(s)
		if err != nil {
			t.Fatal(err)
		}
		if caps&(1<<capSysAdmin) != 0 {
			t.Errorf("%s in the plugin's container: CapEff %016x holds CAP_SYS_ADMIN (bit %d)", p, caps, capSysAdmin)
		}
		if caps != 0 {
			t.Errorf("%s in the plugin's container: CapEff %016x, want no capability", p, caps)
		}
		for _, want := range []string{"CapBnd:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"} {
			if !strings.Contains(s, want) {
				t.Errorf("%s in the plugin's container lacks %q", p, want)
			}
		}
	}
	// The same process seen from the host, found by its container's name.
	pid := e.containerPID(t, nodeComponent, pluginContainer, pluginComm)
	if e.has(t, pid, capSysAdmin) {
		t.Errorf("the plugin (host PID %d) holds CAP_SYS_ADMIN", pid)
	}

	// PID namespaces: the plugin's container has its own; the mounter's is the node's.
	nodeNS, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", e.c.nodePID()))
	if err != nil {
		t.Fatal(err)
	}
	pluginNS := mustIn("readlink", "/proc/1/ns/pid")
	mounterNS, err := e.containerExec(t, mounterComponent, mounterContainer, "readlink", "/proc/1/ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	mounterNS = strings.TrimSpace(mounterNS)
	t.Logf("PID namespaces: node %s, plugin's container %s, mounter's container %s", nodeNS, pluginNS, mounterNS)
	if pluginNS == nodeNS {
		t.Errorf("the plugin's container shares the node's PID namespace %s", nodeNS)
	}
	if mounterNS != nodeNS {
		t.Errorf("the mounter's container is in PID namespace %s, not the node's %s (hostPID)", mounterNS, nodeNS)
	}
	if n := mustIn("sh", "-c", "ls -d /proc/[0-9]* | wc -l"); n == "0" {
		t.Errorf("no process visible in the plugin's container")
	} else {
		t.Logf("plugin container: %s processes visible in /proc", n)
	}

	// What a privilege would allow is refused.
	if _, err := in("test", "-d", "/tmp"); err != nil {
		t.Fatalf("no /tmp in the plugin's container to mount on: %v", err)
	}
	refused("nsenter into PID 1's mount namespace", "nsenter", "-t", "1", "-m", "--", "true")
	refused("a tmpfs mount", "mount", "-t", "tmpfs", "x", "/tmp")
	refused("a new user and mount namespace", "unshare", "-U", "-r", "-m", "true")
	refused("a write to its root filesystem", "touch", "/plugin-was-here")

	// No device node of the host; /sys is the container's own, read-only.
	if out, err := in("sh", "-c", "ls /dev/loop-control /dev/loop0 /dev/fuse /dev/nbd0 2>/dev/null"); err == nil || strings.TrimSpace(out) != "" {
		t.Errorf("the plugin's container has host device nodes: %q %v", out, err)
	}
	t.Logf("plugin container /dev: %s", strings.Join(strings.Fields(mustIn("ls", "/dev")), " "))
	sysMount := mustIn("awk", `$2 == "/sys" { print $3, $4 }`, "/proc/self/mounts")
	t.Logf("plugin container /sys: %s", sysMount)
	if !strings.HasPrefix(sysMount, "sysfs ro") {
		t.Errorf("the plugin's /sys is %q, want the container's own sysfs, read-only", sysMount)
	}
	// The mounter's records: not in the plugin's container.
	records := e.c.cfg.path("state") + "-mounter"
	if _, err := os.Stat(records); err != nil {
		t.Errorf("the mounter's records dir %s: %v", records, err)
	}
	if out, err := in("ls", "-d", records); err == nil {
		t.Errorf("the plugin's container sees the mounter's records: %s", out)
	}
	pluginRegistration(t, e, in, refused)
	pluginSeesNoPodFiles(t, e, in)

	// The mounter's container, for contrast: CAP_SYS_ADMIN, hostPID.
	mpid := e.containerPID(t, mounterComponent, mounterContainer, mounterComm)
	if !e.has(t, mpid, capSysAdmin) {
		t.Errorf("the mounter (host PID %d) lacks CAP_SYS_ADMIN", mpid)
	}
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", mpid))
	caps, _ := capEff(string(b))
	t.Logf("mounter (host PID %d): CapEff %016x", mpid, caps)

	// The mounter's socket directory on the node: root's alone.
	dir := filepath.Join(e.c.cfg.path("kubelet"), "plugins", driverName+"-mounter")
	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the mounter's socket directory %s: %v", dir, fi.Mode())
	if fi.Mode().Perm() != 0o700 {
		t.Errorf("the mounter's socket directory %s is %v, want 0700", dir, fi.Mode().Perm())
	}
}

// pluginRegistration (issue 33, F5): kubelet's registration directory is
// neither visible nor writable in the plugin's container, at the chart's
// former mount point or at its host path: a socket there claims a driver's
// name and names the CSI socket kubelet sends that driver's stage and
// publish calls to. The mounter serves the registration (registration:
// builtin), and kubelet took it: the node's CSINode lists the driver.
func pluginRegistration(t *testing.T, e *env, in func(cmd ...string) (string, error), refused func(what string, cmd ...string)) {
	t.Helper()
	registry := filepath.Join(e.c.cfg.path("kubelet"), "plugins_registry")
	for _, p := range []string{"/registration", registry} {
		if out, err := in("ls", "-d", p); err == nil {
			t.Errorf("the plugin's container sees kubelet's registration dir at %s: %s", p, out)
		}
		refused("a socket file in kubelet's registration dir at "+p, "touch", filepath.Join(p, "other.csi.example.com-reg.sock"))
	}
	sock := filepath.Join(registry, driverName+"-reg.sock")
	if fi, err := os.Lstat(sock); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Errorf("the registration socket %s on the node: %v %v", sock, fi, err)
	}
	if _, err := e.containerExec(t, mounterComponent, mounterContainer, "test", "-S", "/registration/"+driverName+"-reg.sock"); err != nil {
		t.Errorf("the mounter's container has no registration socket at /registration: %v", err)
	}
	drivers, err := e.c.kubectl("get", "csinode", nodeName, "-o", "jsonpath={.spec.drivers[*].name}")
	if err != nil || !strings.Contains(" "+drivers+" ", " "+driverName+" ") {
		t.Errorf("CSINode %s lists drivers %q (%v), want %s: kubelet did not take the mounter's registration", nodeName, drivers, err, driverName)
	}
}

// pluginSeesNoPodFiles (issue 33, F4): kubelet's pods/ and
// plugins/kubernetes.io/csi are not visible in the plugin's container, and
// a pod's ServiceAccount token that is on the node (the recipe
// read one) cannot be read there. The mounter makes the plugin's targets.
func pluginSeesNoPodFiles(t *testing.T, e *env, in func(cmd ...string) (string, error)) {
	t.Helper()
	kubelet := e.c.cfg.path("kubelet")
	// The tokens are on tmpfs mounts kubelet made in the node's mount
	// namespace: looked for there, named as the node sees them.
	view := fmt.Sprintf("/proc/%d/root", e.c.nodePID())
	found, err := filepath.Glob(filepath.Join(view, kubelet, "pods", "*", "volumes", "kubernetes.io~projected", "*", "token"))
	if err != nil || len(found) == 0 {
		t.Errorf("no pod's ServiceAccount token on the node under %s/pods to look for: %v", kubelet, err)
	}
	var tokens []string
	for _, p := range found {
		tokens = append(tokens, strings.TrimPrefix(p, view))
	}
	for _, p := range append([]string{filepath.Join(kubelet, "pods"), filepath.Join(kubelet, "plugins", "kubernetes.io", "csi")}, tokens...) {
		if out, err := in("ls", "-d", p); err == nil {
			t.Errorf("the plugin's container sees %s: %s", p, out)
		}
	}
	if len(tokens) > 0 {
		if out, err := in("cat", tokens[0]); err == nil {
			t.Errorf("the plugin's container reads the token %s (%d bytes)", tokens[0], len(out))
		}
	}
}
