//go:build clustertest

package cluster

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/mountplan/mountplan/test/testutil"
)

// Images the runtime must never pull (there is no registry): the sandbox
// image containerd pins.
const pauseImage = "registry.k8s.io/pause:3.10.2"

// writeConfigs writes containerd's, kubelet's and CNI's configuration under
// the root.
// criNamespace is containerd's namespace for Kubernetes. Without QoS
// cgroups kubelet gives pods no cgroup parent, and containerd puts each
// container's cgroup under /<namespace>/<id> in every hierarchy; runc
// removes the container's own, never the namespace's.
const criNamespace = "k8s.io"

// crioOptions is the configuration of a CRI-O node's runtime: its files
// under the node's root, the NRI socket where the chart's mounter looks
// (as containerd's), the cluster's CNI, and runc through runcOOM.
func (c nodeConfig) crioOptions() testutil.CRIOOptions {
	return testutil.CRIOOptions{Dir: c.path("crio"), Socket: c.runtimeSocket(),
		Pinns: filepath.Join(filepath.Dir(c.Bin["crio"]), "pinns"), PauseImage: pauseImage,
		NRISocket: "/var/run/nri/nri.sock", CNIConfDir: c.path("cni", "net.d"), CNIBinDir: "/usr/lib/cni",
		RuntimePath: c.path(runcOOM), NRIRequestTimeout: "2s"}
}

// runcOOM is the runc a CRI-O node runs (runcMain): this test binary
// under that name.
const runcOOM = "runc-oom"

// runcBeside is the runc that runcOOM runs: a link, in the same directory,
// to hack/tools/build.sh's runc (the test binary is exec-ed by CRI-O with
// no flag of ours; its own path is what it knows).
const runcBeside = "runc"

func writeConfigs(c nodeConfig) error {
	files := map[string]string{
		// containerd 2 with CRI and NRI. restrict_oom_score_adj: setting a
		// negative oom_score_adj needs CAP_SYS_RESOURCE, which this machine's
		// root lacks; without it every sandbox fails in runc. The runc is
		// hack/tools/build.sh's (>= 1.2): Debian's 1.1.5 runs no pod with a
		// user namespace (hostUsers: false).
		"containerd.toml": fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
imports = []
[grpc]
  address = %[3]q
[ttrpc]
  address = %[4]q
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = %[5]q
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = 'io.containerd.runc.v2'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = %[7]q
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = %[6]q
[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = '127.0.0.1'
[plugins.'io.containerd.nri.v1.nri']
  disable = false
  socket_path = '/var/run/nri/nri.sock'
`, c.path("containerd", "root"), c.path("containerd", "state"), c.path("run", "containerd.sock"),
			c.path("run", "containerd.sock.ttrpc"), pauseImage, c.path("cni", "net.d"), c.Bin["runc"]),

		// cgroup v1 host without CAP_SYS_RESOURCE: no QoS cgroups, no
		// node allocatable enforcement; no eviction (the test's disk use is
		// not the node's problem); anonymous read of the kubelet API (inside
		// the node's network namespace only) for logs and exec.
		"kubelet.yaml": fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
containerRuntimeEndpoint: unix://%[1]s
address: %[2]s
readOnlyPort: 0
podLogsDir: %[3]s
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
evictionHard: {memory.available: "0%%", nodefs.available: "0%%", imagefs.available: "0%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
syncFrequency: 10s
nodeStatusUpdateFrequency: 5s
volumeStatsAggPeriod: 10s
shutdownGracePeriod: 0s
featureGates: {CSIVolumeHealth: true}
`, c.runtimeSocket(), c.ip(), c.path("log", "pods")),

		"cni/net.d/10-mountplan.conflist": fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "mountplan-cluster",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}}
  ]
}
`, c.path("cni", "ipam"), c.pods()),
	}
	if c.crio() {
		self, err := os.Executable()
		if err != nil {
			return err
		}
		if err := os.Symlink(self, c.path(runcOOM)); err != nil && !os.IsExist(err) {
			return err
		}
		// The runc runcMain runs, beside it (see runcBeside).
		if err := os.Symlink(c.Bin["runc"], c.path(runcBeside)); err != nil && !os.IsExist(err) {
			return err
		}
		if _, err := testutil.WriteCRIOConfig(c.crioOptions()); err != nil {
			return err
		}
	}
	for name, data := range files {
		p := c.path(name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			return err
		}
	}
	for _, d := range []string{"node", "run", "logs", "log/pods", "kubelet"} {
		if err := os.MkdirAll(c.path(d), 0o755); err != nil {
			return err
		}
	}
	// containerd's root and state: containerd would make their parent 0700,
	// and the runc of a pod with a user namespace, an unprivileged uid of
	// the node by then, could not reach the container's rootfs below the
	// state directory (EACCES: "remount-propagation ... rootfs ... permission
	// denied"). 0711, as containerd makes the state directory itself.
	if err := os.MkdirAll(c.path("containerd"), 0o711); err != nil {
		return err
	}
	if err := os.Chmod(c.path("containerd"), 0o711); err != nil {
		return err
	}
	return nil
}
