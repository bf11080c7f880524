package testutil

import (
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
	for _, d := range []string{"cni/net.d", "cni/bin"} {
		if err := os.MkdirAll(filepath.Join(c.Dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	o := CRIOOptions{Dir: c.Dir, Socket: c.Address, Pinns: filepath.Join(crioBin, "pinns"), PauseImage: CRIImage,
		NRISocket: c.NRISocket, CNIConfDir: filepath.Join(c.Dir, "cni/net.d"), CNIBinDir: filepath.Join(c.Dir, "cni/bin"),
		// Not CRI-O's 2s, for the reason the containerd config gives.
		NRIRequestTimeout: "10s"}
	env, err := WriteCRIOConfig(o)
	if err != nil {
		t.Fatal(err)
	}
	// Into its storage before it starts: CRI-O pulls a pause image it
	// does not find, and no registry is reachable.
	img, err := busyboxImage(filepath.Join(c.Dir, "image.tar"))
	if err != nil {
		t.Fatal(err)
	}
	if err := ImportIntoCRIO(o, env, "oci-archive:"+img, CRIImage); err != nil {
		t.Fatal(err)
	}
	c.launch(t, env, CRIOArgs(filepath.Join(crioBin, "crio"), c.Dir)...)
	return c
}

// CRIOOptions are what a CRI-O's configuration names (WriteCRIOConfig).
type CRIOOptions struct {
	Dir               string // everything CRI-O writes lies below it
	Socket            string // CRI
	Pinns             string // its helper's path
	PauseImage        string // already in its storage: nothing is pulled
	NRISocket         string
	CNIConfDir        string
	CNIBinDir         string
	RuntimePath       string // the OCI runtime; empty: /usr/sbin/runc
	NRIRequestTimeout string // how long a plugin may take (CRI-O's default: 2s)
}

// Storage is its containers-storage reference prefix (skopeo's form).
func (o CRIOOptions) Storage() string {
	return fmt.Sprintf("containers-storage:[overlay@%s+%s]", filepath.Join(o.Dir, "root"), filepath.Join(o.Dir, "runroot"))
}

// WriteCRIOConfig writes o.Dir/crio.conf, the files it names and the
// directories it needs, and returns the environment crio and skopeo need
// to find them. Debian's crun (1.8.1) refuses CRI-O 1.34's specs: CRI-O's
// built-in crun handler is pointed at the runtime too.
func WriteCRIOConfig(o CRIOOptions) (env []string, _ error) {
	runtime := o.RuntimePath
	if runtime == "" {
		runtime = "/usr/sbin/runc"
	}
	for _, d := range []string{"root", "runroot", "logs", "exits", "attach", "ns", "nri/plugins", "nri/conf.d",
		"crio.conf.d", "hooks.d", "cdi", "runc-root", "crun-root", "policies"} {
		if err := os.MkdirAll(filepath.Join(o.Dir, d), 0o700); err != nil {
			return nil, err
		}
	}
	files := map[string]string{
		"crio.conf": fmt.Sprintf(crioConfig, o.Dir, o.Socket, o.Pinns, o.PauseImage, o.NRISocket, o.CNIConfDir, o.CNIBinDir,
			runtime, o.NRIRequestTimeout),
		"policy.json":     `{"default":[{"type":"insecureAcceptAnything"}]}`,
		"storage.conf":    fmt.Sprintf("[storage]\ndriver = \"overlay\"\ngraphroot = %q\nrunroot = %q\n", filepath.Join(o.Dir, "root"), filepath.Join(o.Dir, "runroot")),
		"registries.conf": "",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(o.Dir, name), []byte(content), 0o600); err != nil {
			return nil, err
		}
	}
	return CRIOEnv(o.Dir), nil
}

// CRIOEnv is the environment crio and skopeo need to find the files
// WriteCRIOConfig wrote in dir.
func CRIOEnv(dir string) []string {
	return []string{"CONTAINERS_STORAGE_CONF=" + filepath.Join(dir, "storage.conf"),
		"CONTAINERS_REGISTRIES_CONF=" + filepath.Join(dir, "registries.conf")}
}

// CRIOArgs is crio's command line for the configuration in dir.
func CRIOArgs(crio, dir string) []string {
	return []string{crio, "--config", filepath.Join(dir, "crio.conf"), "--config-dir", filepath.Join(dir, "crio.conf.d")}
}

// crioConfig: %[1]s the directory, %[2]s the socket, %[3]s pinns, %[4]s the
// pause image, %[5]s the NRI socket, %[6]s and %[7]s CNI's configuration
// and plugins, %[8]s the OCI runtime, %[9]s the NRI request timeout.
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
runtime_path = "%[8]s"
runtime_type = "oci"
runtime_root = "%[1]s/runc-root"
monitor_path = "/usr/bin/conmon"
monitor_cgroup = "pod"

[crio.runtime.runtimes.crun]
runtime_path = "%[8]s"
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
network_dir = "%[6]s"
plugin_dirs = ["%[7]s"]

[crio.metrics]
enable_metrics = false

[crio.nri]
enable_nri = true
nri_listen = "%[5]s"
nri_plugin_dir = "%[1]s/nri/plugins"
nri_plugin_config_dir = "%[1]s/nri/conf.d"
nri_plugin_registration_timeout = "5s"
nri_plugin_request_timeout = "%[9]s"
`

// ImportIntoCRIO copies an image (a skopeo source: oci-archive:FILE,
// docker-archive:FILE) into the storage of the CRI-O of o as name. skopeo
// writes a cache under /var/lib/containers whatever it is told: it runs in
// a mount namespace of its own with a tmpfs on /var/lib, so that nothing
// of the host's is written: on /var/lib/containers when it exists (the
// test cluster covers it), else on /var/lib, where the image and the
// storage must then not lie.
func ImportIntoCRIO(o CRIOOptions, env []string, src, name string) error {
	script := `if [ -d /var/lib/containers ]; then cache=/var/lib/containers; else cache=/var/lib; fi
mount -t tmpfs tmpfs "$cache" && exec skopeo --policy "$1" copy --quiet "$2" "$3"`
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
		filepath.Join(o.Dir, "policy.json"), src, o.Storage()+name)
	cmd.Env = append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("importing %s into CRI-O's storage as %s: %v: %s", src, name, err, out)
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
		dirs, err := toolDirs("crio")
		if err != nil {
			crioBuild.err = err
			return
		}
		crioBuild.bin = dirs[0]
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
