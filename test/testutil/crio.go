package testutil

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// StartCRIO starts a private CRI-O with NRI (its root, run root, sockets,
// NRI socket, pod logs and the cgroup parent of its pods its own), imports
// CRIImage and waits until CRI answers. A cleanup stops it (see Stop). The
// CRI it returns serves tests as StartCRI's does.
//
// crio and its pinns come from hack/tools/build.sh (CRI-O from the Go
// module proxy); conmon, runc and skopeo are Debian's. CRI-O's
// differences from containerd that the tests meet, handled here:
//   - It gives sandboxes an infra container with oom_score_adj -998, which
//     needs CAP_SYS_RESOURCE: pods run without one (drop_infra_ctr, each
//     container in a PID namespace of its own, as kubelet's default).
//   - Stopping a pod waits out the request's deadline for containers that
//     ignore SIGTERM (sleep): containers are killed first (killContainers).
//   - It names a container to NRI plugins after its
//     io.kubernetes.container.name annotation, which kubelet sets.
//   - It gives NRI plugins no container PID, and only logs a plugin's
//     StartContainer error (the container starts anyway).
//   - Even without an infra container it wants the pause image in its
//     storage: CRIImage is the pause image, with no command of its own.
//
// Debian's crun (1.8.1) refuses CRI-O 1.34's specs: CRI-O's built-in crun
// handler is pointed at runc too.
func StartCRIO(t testing.TB) *CRI {
	t.Helper()
	RequireRoot(t)
	RequireCommands(t, "runc", "busybox", "conmon", "skopeo")
	crioBin := crioTools(t)
	_, crictl := CRITools(t)
	c := newCRI(t, "mpcrio-", "CRI-O", crioBin, crictl)
	c.crio = true
	for _, d := range []string{"root", "runroot", "logs", "exits", "attach", "ns", "cni/net.d", "cni/bin",
		"nri/plugins", "nri/conf.d", "crio.conf.d", "hooks.d", "cdi", "runc-root", "crun-root", "policies"} {
		if err := os.MkdirAll(filepath.Join(c.Dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]string{
		"crio.conf":       fmt.Sprintf(crioConfig, c.Dir, c.Address, filepath.Join(crioBin, "pinns"), CRIImage, c.NRISocket),
		"policy.json":     `{"default":[{"type":"insecureAcceptAnything"}]}`,
		"storage.conf":    fmt.Sprintf("[storage]\ndriver = \"overlay\"\ngraphroot = %q\nrunroot = %q\n", filepath.Join(c.Dir, "root"), filepath.Join(c.Dir, "runroot")),
		"registries.conf": "",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(c.Dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	env := []string{"CONTAINERS_STORAGE_CONF=" + filepath.Join(c.Dir, "storage.conf"),
		"CONTAINERS_REGISTRIES_CONF=" + filepath.Join(c.Dir, "registries.conf")}
	// Into its storage before it starts: CRI-O pulls a pause image it
	// does not find, and no registry is reachable.
	if err := c.importImage(env); err != nil {
		t.Fatal(err)
	}
	c.launch(t, env, filepath.Join(crioBin, "crio"), "--config", filepath.Join(c.Dir, "crio.conf"),
		"--config-dir", filepath.Join(c.Dir, "crio.conf.d"))
	return c
}

// crioConfig: %[1]s the CRI's directory, %[2]s its socket, %[3]s pinns,
// %[4]s the pause image, %[5]s the NRI socket. Everything CRI-O writes lies
// under the directory. The NRI request timeout is not CRI-O's 2s, for the
// reason the containerd config gives.
const crioConfig = `[crio]
root = "%[1]s/root"
runroot = "%[1]s/runroot"
storage_driver = "overlay"
log_dir = "%[1]s/logs"
version_file = "%[1]s/version"
version_file_persist = "%[1]s/version-persist"
clean_shutdown_file = "%[1]s/clean.shutdown"
internal_wipe = true
internal_repair = false

[crio.api]
listen = "%[2]s"
stream_address = "127.0.0.1"
stream_port = "0"

[crio.runtime]
default_runtime = "runc"
cgroup_manager = "cgroupfs"
conmon_cgroup = "pod"
pinns_path = "%[3]s"
namespaces_dir = "%[1]s/ns"
container_exits_dir = "%[1]s/exits"
container_attach_socket_dir = "%[1]s/attach"
hooks_dir = ["%[1]s/hooks.d"]
cdi_spec_dirs = ["%[1]s/cdi"]
default_mounts_file = ""
decryption_keys_path = "%[1]s/keys"
irqbalance_config_file = "%[1]s/irqbalance"
irqbalance_config_restore_file = "disable"
drop_infra_ctr = true
enable_criu_support = false

[crio.runtime.runtimes.runc]
runtime_path = "/usr/sbin/runc"
runtime_type = "oci"
runtime_root = "%[1]s/runc-root"
monitor_path = "/usr/bin/conmon"
monitor_cgroup = "pod"

[crio.runtime.runtimes.crun]
runtime_path = "/usr/sbin/runc"
runtime_type = "oci"
runtime_root = "%[1]s/crun-root"
monitor_path = "/usr/bin/conmon"
monitor_cgroup = "pod"

[crio.image]
pause_image = "%[4]s"
pause_command = ""
signature_policy = "%[1]s/policy.json"
signature_policy_dir = "%[1]s/policies"
global_auth_file = ""

[crio.network]
network_dir = "%[1]s/cni/net.d"
plugin_dirs = ["%[1]s/cni/bin"]

[crio.metrics]
enable_metrics = false

[crio.nri]
enable_nri = true
nri_listen = "%[5]s"
nri_plugin_dir = "%[1]s/nri/plugins"
nri_plugin_config_dir = "%[1]s/nri/conf.d"
nri_plugin_registration_timeout = "5s"
nri_plugin_request_timeout = "10s"
`

// importImage copies CRIImage's archive into the CRI-O storage with
// skopeo. skopeo writes a cache under /var/lib/containers whatever it is
// told: it runs in a mount namespace of its own with a tmpfs there, so
// that nothing of the host's is written.
func (c *CRI) importImage(env []string) error {
	img, err := busyboxImage(filepath.Join(c.Dir, "image.tar"))
	if err != nil {
		return err
	}
	dest := fmt.Sprintf("containers-storage:[overlay@%s+%s]%s", filepath.Join(c.Dir, "root"), filepath.Join(c.Dir, "runroot"), CRIImage)
	script := `mount -t tmpfs tmpfs /var/lib && exec skopeo --policy "$1" copy --quiet "oci-archive:$2" "$3"`
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
		filepath.Join(c.Dir, "policy.json"), img, dest)
	cmd.Env = append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("importing %s into CRI-O's storage: %v: %s", CRIImage, err, out)
	}
	return nil
}

// namespaces are the namespace options of the CRI's pods and containers:
// the host's network; with CRI-O, which runs no infra container, a PID
// namespace per container.
func (c *CRI) namespaces() map[string]any {
	if c.crio {
		return map[string]any{"network": 2, "pid": 1}
	}
	return map[string]any{"network": 2}
}

// killContainers kills (crictl stop --timeout 0) the containers crictl ps
// lists with filter (all without one), for CRI-O, which waits out the
// request's deadline for containers that ignore SIGTERM when it stops a
// pod. containerd's stop of a pod is left as it is.
func (c *CRI) killContainers(filter ...string) error {
	if !c.crio {
		return nil
	}
	out, err := c.Crictl(append([]string{"ps", "--quiet", "--state", "running"}, filter...)...)
	if err != nil {
		return err
	}
	ids := strings.Fields(out)
	if len(ids) == 0 {
		return nil
	}
	_, err = c.Crictl(append([]string{"stop", "--timeout", "0"}, ids...)...)
	return err
}

// killConmons kills the conmons of this CRI-O left after it stopped.
func (c *CRI) killConmons() error {
	return killMonitors("conmon", func(p ProcInfo) bool {
		return strings.HasPrefix(p.Cmdline, "/usr/bin/conmon ") && strings.Contains(p.Cmdline, c.Dir)
	})
}

// crioTools returns the directory holding crio and pinns, building them
// with hack/tools/build.sh when its cache lacks them (about 4 minutes,
// once per machine).
func crioTools(t testing.TB) string {
	t.Helper()
	crioBuild.once.Do(func() {
		root, err := ModuleRoot()
		if err != nil {
			crioBuild.err = err
			return
		}
		cmd := exec.Command(filepath.Join(root, "hack/tools/build.sh"), "crio")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			crioBuild.err = fmt.Errorf("hack/tools/build.sh crio: %v\n%s", err, stderr.String())
			return
		}
		crioBuild.bin = strings.TrimSpace(string(out))
	})
	if crioBuild.err != nil {
		t.Fatal(crioBuild.err)
	}
	return crioBuild.bin
}

var crioBuild struct {
	once sync.Once
	bin  string
	err  error
}
