//go:build clustertest

package cluster

// A compromised plugin, played in the running cluster (issue 33): this test
// binary, copied into the node's state dir, runs inside the plugin's
// container (its uid, its mount namespace, its view of the mounter's
// socket, no capability) and sends the mounter what the review's recipes
// send; the same binary run in the node's namespaces, outside the plugin's
// container, is not served at all.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter/service"
	"github.com/mountplan/mountplan/pkg/plan"
)

// attackEnv makes the test binary the compromised plugin: its value is an
// attackSpec in JSON.
const attackEnv = "MOUNTPLAN_CLUSTER_ATTACK"

type attackSpec struct {
	Socket     string `json:"socket"`     // the mounter's socket as the attacker sees it
	StateDir   string `json:"stateDir"`   // the plugin's state dir
	KubeletPID int    `json:"kubeletPID"` // kubelet, as the mounter (hostPID) sees it
	TokenDir   string `json:"tokenDir"`   // a pod's ServiceAccount token mount
}

// attackMain sends each hostile request and prints "name: code" per line.
func attackMain(raw string) int {
	var s attackSpec
	if err := json.Unmarshal([]byte(raw), &s); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	src := filepath.Join(s.StateDir, "attack-rules")
	_ = os.MkdirAll(src, 0o755)
	_ = os.WriteFile(filepath.Join(src, "99-attack.rules"), []byte("RUN+=\"/bin/true\"\n"), 0o644)
	c := service.NewClient(s.Socket)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	bind := func(opts ...string) []plan.Mount {
		return []plan.Mount{{Type: plan.TypeBind, Source: src, Options: append([]string{"nosuid", "nodev"}, opts...)}}
	}
	report := func(name string, err error) { fmt.Printf("%s: %s\n", name, errdefs.Code(err)) }
	report("F1 bind into kubelet's host-rooted namespace",
		c.Mount(ctx, bind(), plan.Consumer{PID: s.KubeletPID, MountPoint: "/run/mountplan-attack"}))
	report("F3 recursive bind",
		c.Mount(ctx, bind("rec"), plan.Consumer{PID: s.KubeletPID, MountPoint: "/run/mountplan-attack"}))
	report("F6 unmount of a pod's token tmpfs",
		c.Unmount(ctx, []plan.Mount{{Type: "tmpfs", Source: "tmpfs"}}, plan.Consumer{MountPoint: s.TokenDir}))
	_, err := c.StatFS(ctx, plan.Consumer{PID: s.KubeletPID, MountPoint: "/etc"})
	report("F1 statfs in kubelet's namespace", err)
	_ = os.RemoveAll(src)
	return 0
}

// compromisedPlugin runs attackMain in the plugin's container and in the
// node's namespaces outside it. In the container every request is refused
// with the code of its check, and the node's mount tables show nothing of
// it: kubelet's namespace has no /run/mountplan-attack, the token is still
// mounted. Outside, the mounter drops the connection (F8): the answer is
// no code of a check but the connection's end. (kubelet runs in the node's
// first mount namespace, the one of PID 1 the mounter sees; the root test
// TestAttributedNamespaces covers a host-rooted namespace of another PID.)
func compromisedPlugin(t *testing.T, e *env) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(e.c.cfg.path("state"), "mp-attack")
	if err := copyFile(self, bin); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(bin)
	kubelet := e.c.pidOf(t, "kubelet")
	view := fmt.Sprintf("/proc/%d/root", e.c.nodePID())
	tokens, _ := filepath.Glob(filepath.Join(view, e.c.cfg.path("kubelet"), "pods", "*", "volumes", "kubernetes.io~projected", "*"))
	if len(tokens) == 0 {
		t.Fatal("no pod's ServiceAccount token mount on the node to attack")
	}
	tokenDir := strings.TrimPrefix(tokens[0], view)
	spec := attackSpec{Socket: "/mounter/mounter.sock", StateDir: e.c.cfg.path("state"), KubeletPID: nodePIDOf(t, kubelet), TokenDir: tokenDir}
	raw, _ := json.Marshal(spec)
	out, err := e.containerExec(t, nodeComponent, pluginContainer, "env", attackEnv+"="+string(raw), bin)
	if err != nil {
		t.Fatalf("the attack in the plugin's container: %v: %s", err, out)
	}
	t.Logf("from inside the plugin's container:\n%s", strings.TrimSpace(out))
	for name, want := range map[string]string{
		"F1 bind into kubelet's host-rooted namespace": "PermissionDenied",
		"F3 recursive bind":                            "InvalidArgument",
		"F6 unmount of a pod's token tmpfs":            "PermissionDenied",
		"F1 statfs in kubelet's namespace":             "PermissionDenied",
	} {
		if !strings.Contains(out, name+": "+want+"\n") {
			t.Errorf("%s: not refused with %s", name, want)
		}
	}
	mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", kubelet))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mi), " /run/mountplan-attack ") {
		t.Errorf("kubelet's namespace has a mount at /run/mountplan-attack")
	}
	if !strings.Contains(string(mi), " "+tokenDir+" ") {
		t.Errorf("the token mount %s is gone from the node's mount table", tokenDir)
	}

	// F8: the same binary, root in the node's PID and mount namespaces but
	// not in the plugin's container, reaches the socket and is dropped.
	spec.Socket = filepath.Join(e.c.cfg.path("kubelet"), "plugins", driverName+"-mounter", "mounter.sock")
	raw, _ = json.Marshal(spec)
	outside, err := e.c.inNodeNamespaces(t, []string{attackEnv + "=" + string(raw)}, bin)
	if err != nil {
		t.Fatalf("the attack outside the plugin's container: %v: %s", err, outside)
	}
	t.Logf("from the node, outside the plugin's container:\n%s", strings.TrimSpace(outside))
	for _, l := range strings.Split(strings.TrimSpace(outside), "\n") {
		// No handler ran: the answer is the connection's end (Unavailable,
		// or Unknown for a write the closed socket refused), never a code
		// of the mounter's checks nor OK.
		if !strings.HasSuffix(l, ": Unavailable") && !strings.HasSuffix(l, ": Unknown") {
			t.Errorf("outside the plugin's container: %q, want the connection dropped (Unavailable)", l)
		}
	}
}

// nodePIDOf is a host PID as the node's PID namespace numbers it (the
// second of NSpid's fields), where the mounter, hostPID, lives.
func nodePIDOf(t *testing.T, hostPID int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", hostPID))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 3 && f[0] == "NSpid:" {
			pid, err := strconv.Atoi(f[2])
			if err != nil {
				t.Fatal(err)
			}
			return pid
		}
	}
	t.Fatalf("no node PID for host PID %d", hostPID)
	return 0
}

// inNodeNamespaces runs prog, with env added, in the node's PID and mount
// namespaces (root, every capability: what a node's agent would be), and
// returns its standard output.
func (c *Cluster) inNodeNamespaces(t *testing.T, env []string, prog string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "nsenter", append([]string{"--target", strconv.Itoa(c.nodePID()), "--pid", "--mount", "--", prog}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.Output()
	return string(out), err
}
