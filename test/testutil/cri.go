package testutil

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// CRI is a containerd 2 with its CRI and NRI plugins, private to one test:
// root, state, gRPC socket, NRI socket, pod logs and the cgroup parent of
// its pods are its own. The binaries (containerd, its runc shim, ctr and
// crictl) come from hack/tools/build.sh, which builds pinned versions from
// the Go module proxy once into a cache; runc is Debian's.
//
// Nothing is pulled from a registry: a busybox image (CRIImage) is built
// from the static busybox and imported with `ctr images import`; it is also
// the pinned pod sandbox ("pause") image, whose command waits for a
// signal. Pods use the host's network namespace, so no CNI is needed.
//
// Quirks handled here:
//   - CRI asks runc for oom_score_adj -998 for sandboxes, which needs
//     CAP_SYS_RESOURCE; restrict_oom_score_adj caps it at containerd's own.
//   - Shim sockets live in /run/containerd/s whatever the state dir; shims
//     remove them when they exit.
//   - Pods get cgroups under a parent of this instance's own, removed by
//     Stop.
type CRI struct {
	Dir          string // everything below lives here
	Address      string // containerd's gRPC socket (CRI endpoint)
	NRISocket    string // where NRI plugins connect
	CgroupParent string // cgroup parent of every pod
	LogPath      string // containerd's stdout and stderr
	// Runtime is "containerd", or "CRI-O" (StartCRIO).
	Runtime string

	bin, crictl string // containerd's bin dir, crictl's path
	crio        bool   // CRI-O's differences (crio.go)
	cmd         *exec.Cmd
	done        chan struct{}
	stopOnce    sync.Once
	stopErr     error
	logTail     string
}

// CRIImage is the image every pod and container of a CRI runs: a static
// busybox with its applets in /bin, PATH=/bin, command `sleep infinity`.
const CRIImage = "mountplan.test/busybox:1"

const criConfig = `version = 3
root = %[1]q
state = %[2]q
disabled_plugins = [
  'io.containerd.internal.v1.opt',
  'io.containerd.snapshotter.v1.btrfs',
  'io.containerd.snapshotter.v1.zfs',
  'io.containerd.snapshotter.v1.devmapper',
  'io.containerd.snapshotter.v1.blockfile',
  'io.containerd.snapshotter.v1.erofs',
  'io.containerd.differ.v1.erofs',
  'io.containerd.mount-handler.v1.erofs',
  'io.containerd.image-verifier.v1.bindir',
]

[grpc]
  address = %[3]q

[ttrpc]
  address = '%[3]s.ttrpc'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = %[4]q

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  cdi_spec_dirs = []
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['%[5]s/cni']
    conf_dir = '%[5]s/cni'

[plugins.'io.containerd.nri.v1.nri']
  disable = false
  socket_path = %[6]q
  plugin_path = '%[5]s/nri-plugins'
  plugin_config_path = '%[5]s/nri-plugins'
  plugin_registration_timeout = '5s'
  # Not containerd's 2s: the hook's bound follows it (three quarters), and
  # these tests check what the hook does, not how fast it is on a loaded
  # CI machine (the hook's speed is make bench-cluster's and the
  # benchmarks' to measure).
  plugin_request_timeout = '10s'
`

// CRITools returns the directory holding containerd, containerd-shim-runc-v2
// and ctr, and the path of crictl, building them with hack/tools/build.sh
// when its cache lacks them (a few minutes, once per machine).
func CRITools(t testing.TB) (bin, crictl string) {
	t.Helper()
	criTools.once.Do(func() {
		dirs, err := toolDirs("containerd", "crictl")
		if err != nil {
			criTools.err = err
			return
		}
		criTools.bin, criTools.crictl = dirs[0], filepath.Join(dirs[1], "crictl")
	})
	if criTools.err != nil {
		t.Fatal(criTools.err)
	}
	return criTools.bin, criTools.crictl
}

// toolDirs builds tools with hack/tools/build.sh when its cache lacks
// them and returns their bin directories, in order.
func toolDirs(tools ...string) ([]string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(root, "hack/tools/build.sh"), tools...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("hack/tools/build.sh %s: %v\n%s", strings.Join(tools, " "), err, stderr.String())
	}
	dirs := strings.Fields(string(out))
	if len(dirs) != len(tools) {
		return nil, fmt.Errorf("hack/tools/build.sh printed %q, want %d directories", out, len(tools))
	}
	return dirs, nil
}

var criTools struct {
	once        sync.Once
	bin, crictl string
	err         error
}

// StartCRI starts a private containerd 2 with CRI and NRI, imports CRIImage
// and waits until CRI answers. A cleanup stops it (see Stop).
func StartCRI(t testing.TB) *CRI {
	t.Helper()
	RequireRoot(t)
	RequireCommands(t, "runc", "busybox")
	bin, crictl := CRITools(t)
	c := newCRI(t, "mpcri-", "containerd", bin, crictl)
	for _, d := range []string{"cni", "nri-plugins"} {
		if err := os.Mkdir(filepath.Join(c.Dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	cfg := filepath.Join(c.Dir, "config.toml")
	conf := fmt.Sprintf(criConfig, filepath.Join(c.Dir, "root"), filepath.Join(c.Dir, "state"), c.Address, CRIImage, c.Dir, c.NRISocket)
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	c.launch(t, nil, filepath.Join(bin, "containerd"), "--config", cfg)
	img, err := busyboxImage(filepath.Join(c.Dir, "image.tar"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ctr("images", "import", "--no-unpack=false", img); err != nil {
		t.Fatalf("importing %s: %v", CRIImage, err)
	}
	return c
}

// newCRI is a CRI of runtime with its directory (named after prefix)
// and the paths in it, not started yet.
func newCRI(t testing.TB, prefix, runtime, bin, crictl string) *CRI {
	t.Helper()
	dir := MarkedTempDir(t, prefix)
	if err := os.Mkdir(filepath.Join(dir, "pods"), 0o700); err != nil {
		t.Fatal(err)
	}
	return &CRI{
		Dir:          dir,
		Address:      filepath.Join(dir, "c.sock"),
		NRISocket:    filepath.Join(dir, "nri.sock"),
		CgroupParent: "/" + filepath.Base(dir),
		LogPath:      filepath.Join(dir, "runtime.log"),
		Runtime:      runtime,
		bin:          bin,
		crictl:       crictl,
		done:         make(chan struct{}),
	}
}

// launch starts the runtime (argv, with env added to the test's
// environment), registers the cleanup that stops it (Stop) and waits until
// CRI answers.
func (c *CRI) launch(t testing.TB, env []string, argv ...string) {
	t.Helper()
	if err := c.start(env, argv); err != nil {
		os.RemoveAll(c.Dir)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Errorf("stopping %s (CRI): %v", c.Runtime, err)
		}
		if t.Failed() {
			t.Logf("%s log, last lines:\n%s", c.Runtime, c.logTail)
		}
	})
	if err := c.waitReady(); err != nil {
		t.Fatal(err)
	}
}

func (c *CRI) start(env, argv []string) error {
	logf, err := os.Create(c.LogPath)
	if err != nil {
		return err
	}
	defer logf.Close()
	c.cmd = exec.Command(argv[0], argv[1:]...)
	c.cmd.Env = append(os.Environ(), append(env, "PATH="+c.bin+":"+os.Getenv("PATH"))...)
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := c.cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", c.Runtime, err)
	}
	go func() { _ = c.cmd.Wait(); close(c.done) }()
	return nil
}

// waitReady waits (30s at most) until CRI answers and the NRI socket exists.
func (c *CRI) waitReady() error {
	var lastErr error
	up := Poll(30*time.Second, 20*time.Millisecond, func() bool {
		if closed(c.done) {
			return true
		}
		if _, lastErr = c.Crictl("version"); lastErr != nil {
			return false
		}
		_, lastErr = os.Stat(c.NRISocket)
		return lastErr == nil
	})
	select {
	case <-c.done:
		return fmt.Errorf("%s exited at start (%v); log:\n%s", c.Runtime, c.cmd.ProcessState, tailFile(c.LogPath, 40))
	default:
	}
	if !up {
		return fmt.Errorf("%s (CRI) not ready within 30s: %v; log:\n%s", c.Runtime, lastErr, tailFile(c.LogPath, 40))
	}
	return nil
}

// Crictl runs crictl against this containerd and returns its standard
// output; on failure the error carries standard error.
func (c *CRI) Crictl(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return runCmd(ctx, c.crictl, append([]string{"--config", "/dev/null",
		"--runtime-endpoint", "unix://" + c.Address, "--image-endpoint", "unix://" + c.Address,
		"--timeout", "90s"}, args...)...)
}

func (c *CRI) ctr(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return runCmd(ctx, filepath.Join(c.bin, "ctr"), append([]string{"--address", c.Address, "-n", "k8s.io"}, args...)...)
}

// CRIMount is a mount of a container config (CRI's Mount).
type CRIMount struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Readonly      bool   `json:"readonly,omitempty"`
}

// CRIDevice is a device of a container config (CRI's Device).
type CRIDevice struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Permissions   string `json:"permissions"`
}

// ContainerSpec is what a test chooses of a container's CRI config.
type ContainerSpec struct {
	Command []string // default: sleep infinity
	Mounts  []CRIMount
	Devices []CRIDevice
	// RunAsUser and SupplementalGroups make the process non-root (for
	// fsGroup tests); zero values leave it root.
	RunAsUser          int64
	SupplementalGroups []int64
}

// Pod is a pod sandbox of a CRI.
type Pod struct {
	ID, Name, UID string
	c             *CRI
	config        string // its sandbox config file, which crictl create needs
}

// RunPod starts a pod sandbox (host network) named name; a cleanup stops
// and removes it with all its containers.
func (c *CRI) RunPod(t testing.TB, name string) *Pod {
	t.Helper()
	p, err := c.runPod(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Remove(); err != nil {
			t.Errorf("removing pod %s: %v", name, err)
		}
	})
	return p
}

func (c *CRI) runPod(name string) (*Pod, error) {
	uid := fmt.Sprintf("uid-%s-%d", name, time.Now().UnixNano())
	logDir := filepath.Join(c.Dir, "pods", uid)
	cfg := map[string]any{
		"metadata":      map[string]any{"name": name, "namespace": "default", "uid": uid},
		"log_directory": logDir,
		"linux": map[string]any{
			"cgroup_parent":    c.CgroupParent,
			"security_context": map[string]any{"namespace_options": c.namespaces()},
		},
	}
	path := filepath.Join(c.Dir, "pods", uid+".json")
	if err := writeJSON(path, cfg); err != nil {
		return nil, err
	}
	out, err := c.Crictl("runp", path)
	if err != nil {
		return nil, fmt.Errorf("crictl runp %s: %w", name, err)
	}
	return &Pod{ID: strings.TrimSpace(out), Name: name, UID: uid, c: c, config: path}, nil
}

// CreateContainer creates (not starts) container name in the pod and
// returns its ID, or crictl's error.
func (p *Pod) CreateContainer(name string, spec ContainerSpec) (string, error) {
	cmd := spec.Command
	if len(cmd) == 0 {
		cmd = []string{"/bin/sleep", "infinity"}
	}
	sc := map[string]any{}
	if spec.RunAsUser != 0 {
		sc["run_as_user"] = map[string]any{"value": spec.RunAsUser}
	}
	if len(spec.SupplementalGroups) > 0 {
		sc["supplemental_groups"] = spec.SupplementalGroups
	}
	if p.c.crio {
		sc["namespace_options"] = p.c.namespaces()
	}
	cfg := map[string]any{
		"metadata": map[string]any{"name": name},
		// kubelet's: CRI-O names the container to NRI plugins after it.
		"annotations": map[string]string{"io.kubernetes.container.name": name},
		"image":       map[string]any{"image": CRIImage},
		"command":     cmd,
		"log_path":    name + ".log",
		"mounts":      spec.Mounts,
		"devices":     spec.Devices,
		"linux":       map[string]any{"security_context": sc},
	}
	path := filepath.Join(p.c.Dir, "pods", fmt.Sprintf("%s-%s-%d.json", p.UID, name, time.Now().UnixNano()))
	if err := writeJSON(path, cfg); err != nil {
		return "", err
	}
	out, err := p.c.Crictl("create", p.ID, path, p.config)
	if err != nil {
		return "", fmt.Errorf("crictl create %s: %w", name, err)
	}
	return strings.TrimSpace(out), nil
}

// RunContainer creates and starts container name, failing the test on error.
func (p *Pod) RunContainer(t testing.TB, name string, spec ContainerSpec) string {
	t.Helper()
	id, err := p.CreateContainer(name, spec)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.c.StartContainer(id); err != nil {
		t.Fatal(err)
	}
	return id
}

// StartContainer starts a created container.
func (c *CRI) StartContainer(id string) error {
	if _, err := c.Crictl("start", id); err != nil {
		return fmt.Errorf("crictl start %s: %w", id, err)
	}
	return nil
}

// Exec runs argv in a running container and returns its standard output.
func (c *CRI) Exec(id string, argv ...string) (string, error) {
	return c.Crictl(append([]string{"exec", id}, argv...)...)
}

// StopContainer kills a container at once (SIGKILL); RemoveContainer
// removes it.
func (c *CRI) StopContainer(id string) error {
	_, err := c.Crictl("stop", "--timeout", "0", id)
	return err
}

// RemoveContainer removes a stopped or created container.
func (c *CRI) RemoveContainer(id string) error {
	_, err := c.Crictl("rm", id)
	return err
}

// ContainerPID returns the host PID of a running container's process.
func (c *CRI) ContainerPID(id string) (int, error) {
	out, err := c.Crictl("inspect", "--output", "json", id)
	if err != nil {
		return 0, err
	}
	var v struct {
		Info struct {
			PID int `json:"pid"`
		} `json:"info"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		return 0, fmt.Errorf("crictl inspect %s: %w", id, err)
	}
	if v.Info.PID == 0 {
		return 0, fmt.Errorf("container %s has no process", id)
	}
	return v.Info.PID, nil
}

// ContainerState returns CONTAINER_CREATED, CONTAINER_RUNNING,
// CONTAINER_EXITED or CONTAINER_UNKNOWN.
func (c *CRI) ContainerState(id string) (string, error) {
	out, err := c.Crictl("inspect", "--output", "json", id)
	if err != nil {
		return "", err
	}
	var v struct {
		Status struct {
			State string `json:"state"`
		} `json:"status"`
	}
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		return "", fmt.Errorf("crictl inspect %s: %w", id, err)
	}
	return v.Status.State, nil
}

// Remove stops and removes the pod with its containers. Calling it again
// does nothing.
func (p *Pod) Remove() error {
	out, err := p.c.Crictl("pods", "--quiet", "--id", p.ID)
	if err != nil || strings.TrimSpace(out) == "" {
		return err
	}
	if err := p.c.killContainers("--pod", p.ID); err != nil {
		return err
	}
	if _, err := p.c.Crictl("stopp", p.ID); err != nil {
		return err
	}
	_, err = p.c.Crictl("rmp", p.ID)
	return err
}

// Stop removes every pod left, stops containerd (SIGTERM, then SIGKILL
// after 10s), kills the shims that remain, unmounts what is left under
// Dir, removes the pods' cgroups and then Dir. Calling it again returns
// the first call's result.
func (c *CRI) Stop() error {
	c.stopOnce.Do(func() { c.stopErr = c.stop() })
	return c.stopErr
}

func (c *CRI) stop() error {
	var errs []error
	select {
	case <-c.done:
		errs = append(errs, fmt.Errorf("%s exited by itself (%v)", c.Runtime, c.cmd.ProcessState))
	default:
		errs = append(errs, c.killContainers())
		if _, err := c.Crictl("rmp", "--all", "--force"); err != nil {
			errs = append(errs, err)
		}
		errs = append(errs, terminate(c.cmd.Process, c.done, c.Runtime))
	}
	removeCgroups := func() error { return RemoveCgroupTree(c.CgroupParent) }
	if c.crio {
		errs = append(errs, c.killConmons(), unmountUnder(c.Dir), removeCgroups())
		c.logTail = tailFile(c.LogPath, 60)
		return errors.Join(append(errs, removeAllNoMounts(c.Dir))...)
	}
	var more []error
	c.logTail, more = cleanUpAfter(c.Address, c.Dir, c.LogPath, removeCgroups)
	return errors.Join(append(errs, more...)...)
}

// terminate stops a process with SIGTERM, then SIGKILL after 10s; done is
// closed once it has been waited for.
func terminate(p *os.Process, done <-chan struct{}, name string) error {
	_ = p.Signal(syscall.SIGTERM)
	select {
	case <-done:
		return nil
	case <-time.After(10 * time.Second):
		_ = p.Kill()
		<-done
		return fmt.Errorf("%s ignored SIGTERM for 10s; killed it", name)
	}
}

// killShims waits briefly for the shims of the containerd at address to
// exit, then kills those left with everything below them.
func killShims(address string) error {
	return killMonitors("shim", func(p ProcInfo) bool {
		return strings.Contains(p.Cmdline, "containerd-shim") && strings.Contains(p.Cmdline, address)
	})
}

// killMonitors waits briefly for the runtime's container monitors (what
// matches: containerd's shims, CRI-O's conmons) to exit, then kills those
// left with everything below them.
func killMonitors(what string, match func(ProcInfo) bool) error {
	shims := func() map[int]ProcInfo {
		out := map[int]ProcInfo{}
		for pid, p := range readProcs() {
			if match(p) && p.State != 'Z' {
				out[pid] = p
			}
		}
		return out
	}
	if Poll(3*time.Second, 20*time.Millisecond, func() bool { return len(shims()) == 0 }) {
		return nil
	}
	var errs []error
	procs := readProcs()
	for pid, p := range shims() {
		errs = append(errs, fmt.Errorf("stray %s killed: %s", what, p))
		for _, d := range descendants(procs, pid) {
			_ = unix.Kill(d, unix.SIGKILL)
		}
		_ = unix.Kill(pid, unix.SIGKILL)
	}
	if !Poll(5*time.Second, 20*time.Millisecond, func() bool { return len(shims()) == 0 }) {
		errs = append(errs, fmt.Errorf("%ss survived SIGKILL", what))
	}
	return errors.Join(errs...)
}

func writeJSON(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o600)
}

// busyboxImage writes an OCI image archive of CRIImage to path: one
// uncompressed layer holding the static busybox and its applets.
func busyboxImage(path string) (string, error) {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return "", err
	}
	layer, err := busyboxLayer(bb)
	if err != nil {
		return "", err
	}
	blobs := map[string][]byte{}
	add := func(b []byte) (digest string, size int) {
		sum := sha256.Sum256(b)
		d := "sha256:" + hex.EncodeToString(sum[:])
		blobs[d] = b
		return d, len(b)
	}
	layerDigest, layerSize := add(layer)
	config, _ := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Env": []string{"PATH=/bin"}, "Cmd": []string{"/bin/sleep", "infinity"}},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{layerDigest}},
	})
	configDigest, configSize := add(config)
	manifest, _ := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": configDigest, "size": configSize},
		"layers":        []any{map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layerDigest, "size": layerSize}},
	})
	manifestDigest, manifestSize := add(manifest)
	index, _ := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"manifests": []any{map[string]any{
			"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifestDigest, "size": manifestSize,
			"annotations": map[string]string{"io.containerd.image.name": CRIImage},
			"platform":    map[string]string{"architecture": "amd64", "os": "linux"},
		}},
	})
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	files := map[string][]byte{"oci-layout": []byte(`{"imageLayoutVersion":"1.0.0"}`), "index.json": index}
	for d, b := range blobs {
		files["blobs/sha256/"+strings.TrimPrefix(d, "sha256:")] = b
	}
	if err := tw.WriteHeader(&tar.Header{Name: "blobs/", Typeflag: tar.TypeDir, Mode: 0o755}); err != nil {
		return "", err
	}
	if err := tw.WriteHeader(&tar.Header{Name: "blobs/sha256/", Typeflag: tar.TypeDir, Mode: 0o755}); err != nil {
		return "", err
	}
	for name, b := range files {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(b))}); err != nil {
			return "", err
		}
		if _, err := tw.Write(b); err != nil {
			return "", err
		}
	}
	if err := tw.Close(); err != nil {
		return "", err
	}
	return path, os.WriteFile(path, buf.Bytes(), 0o600)
}

// busyboxLayer is a tar of a root file system: /bin/busybox, a symlink per
// applet, the usual empty directories and an /etc/passwd and group.
func busyboxLayer(bb string) ([]byte, error) {
	bin, err := os.ReadFile(bb)
	if err != nil {
		return nil, err
	}
	applets := busyboxApplets
	if out, err := exec.Command(bb, "--list").Output(); err == nil {
		applets = strings.Fields(string(out))
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, d := range []string{"bin", "dev", "etc", "proc", "root", "run", "sys", "tmp", "var"} {
		mode := int64(0o755)
		if d == "tmp" {
			mode = 0o1777
		}
		if err := tw.WriteHeader(&tar.Header{Name: d + "/", Typeflag: tar.TypeDir, Mode: mode}); err != nil {
			return nil, err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Name: "bin/busybox", Mode: 0o755, Size: int64(len(bin))}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(bin); err != nil {
		return nil, err
	}
	for _, a := range applets {
		if a == "busybox" || strings.Contains(a, "/") {
			continue
		}
		if err := tw.WriteHeader(&tar.Header{Name: "bin/" + a, Typeflag: tar.TypeSymlink, Linkname: "busybox", Mode: 0o777}); err != nil {
			return nil, err
		}
	}
	etc := map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n",
		"etc/group":  "root:x:0:\nnogroup:x:65534:\n",
	}
	for name, content := range etc {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(content))}); err != nil {
			return nil, err
		}
		if _, err := tw.Write([]byte(content)); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), tw.Close()
}
