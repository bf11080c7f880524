package chart_test

import (
	"path/filepath"
	"testing"
)

// TestNRIWiring: off by default (no flag, no socket); with nri.enabled the
// plugin offers NRI mode and the mounter registers with the runtime's NRI
// socket (its directory from the node), reaches the plugin's socket, and
// knows the state and kubelet directories.
func TestNRIWiring(t *testing.T) {
	r := render(t, nil)
	for _, name := range []string{"plugin", "mounter"} {
		if _, ok := args(t, r.container(t, name))["--nri"]; ok {
			t.Errorf("%s has --nri by default", name)
		}
	}
	const sock = "/run/containerd-nri/nri.sock"
	r = render(t, map[string]any{"nri": map[string]any{"enabled": true, "socketPath": sock}})
	wantArg(t, r.container(t, "plugin"), "--nri", "")
	c := r.container(t, "mounter")
	wantArg(t, c, "--nri", "")
	wantArg(t, c, "--nri-socket", sock)
	wantArg(t, c, "--state-dir", r.stateDir(t))
	wantArg(t, c, "--kubelet-dir", r.kubeletDir(t))
	checkHostMount(t, r, c, "nri-socket-dir", filepath.Dir(sock), "")
	// --plugin-endpoint is the plugin's own --endpoint, through the same volume.
	pe, pluginEP := args(t, c)["--plugin-endpoint"], args(t, r.container(t, "plugin"))["--endpoint"]
	if pe != pluginEP {
		t.Errorf("mounter --plugin-endpoint=%s, plugin --endpoint=%s", pe, pluginEP)
	}
	_, v := r.mountAt(t, c, filepath.Dir(socketPath(t, pe)))
	_, pv := r.mountAt(t, r.container(t, "plugin"), filepath.Dir(socketPath(t, pluginEP)))
	if v.HostPath == nil || pv.HostPath == nil || v.HostPath.Path != pv.HostPath.Path {
		t.Errorf("the mounter reaches the plugin's socket dir through %+v, the plugin serves it from %+v", v.VolumeSource, pv.VolumeSource)
	}
	// Without NRI, and without registration: builtin (which waits for the
	// plugin's socket, TestRegistrationDirOnlyInTheRegistrar), the mounter
	// has no business with the plugin's socket.
	d := render(t, map[string]any{"registration": "sidecar"})
	for _, m := range d.container(t, "mounter").VolumeMounts {
		if m.MountPath == filepath.Dir(socketPath(t, pluginEP)) {
			t.Errorf("the mounter mounts the plugin's socket dir without nri.enabled, with registration: sidecar")
		}
	}
	if _, ok := args(t, d.container(t, "mounter"))["--plugin-endpoint"]; ok {
		t.Errorf("the mounter has --plugin-endpoint without nri.enabled, with registration: sidecar")
	}
}
