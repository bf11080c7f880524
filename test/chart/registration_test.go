package chart_test

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/pkg/plan"
)

// TestRegistrationDirOnlyInTheRegistrar (issue 33, F5): kubelet's
// plugins_registry is mounted by the one container that registers the
// driver, and never by the plugin's, whatever the registration mode. A
// socket there claims a driver's name (and a version) and names the CSI
// socket kubelet then sends that driver's stage and publish calls to, with
// their secrets and requested service-account tokens: a compromised plugin
// that could write there could take over another driver's volumes. With
// registration: builtin the mounter registers, from its own flags: the
// driver's name is the plugin's (one chart value), the CSI socket kubelet
// dials is the plugin's, and the mounter reaches that socket only to wait
// until it accepts a connection, through a read-only mount.
func TestRegistrationDirOnlyInTheRegistrar(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		regDir := r.kubeletDir(t) + "/plugins_registry"
		registrar := "node-driver-registrar"
		if r.builtin(t) {
			registrar = "mounter"
		}
		for _, ds := range r.daemonSets() {
			for _, c := range ds.Spec.Template.Spec.Containers {
				for _, m := range c.VolumeMounts {
					hv := volumeOf(t, ds, m.Name).HostPath
					if hv == nil || !(plan.Within(hv.Path, regDir) || plan.Within(regDir, hv.Path)) {
						continue
					}
					if c.Name != registrar {
						t.Errorf("container %s mounts %s (host %s), which is or holds kubelet's registration dir %s: only %s may",
							c.Name, m.MountPath, hv.Path, regDir, registrar)
					}
				}
			}
		}
		plugin := r.container(t, "plugin")
		for _, a := range plugin.Args {
			if strings.Contains(a, "registration") {
				t.Errorf("the plugin is given %s: it registers nothing", a)
			}
		}
		if !r.builtin(t) {
			return
		}
		mounter := r.container(t, "mounter")
		m, v := r.mountAt(t, mounter, "/registration")
		if v.HostPath == nil || v.HostPath.Path != regDir || m.ReadOnly || m.MountPropagation != nil {
			t.Errorf("mounter /registration: %+v (read-only %v, propagation %v), want hostPath %s, writable, no propagation",
				v.VolumeSource, m.ReadOnly, m.MountPropagation, regDir)
		}
		driver := args(t, plugin)["--driver-name"]
		if driver != r.str(t, "driverName") {
			t.Errorf("plugin --driver-name=%q, want the chart's driverName %q", driver, r.str(t, "driverName"))
		}
		wantArg(t, mounter, "--driver-name", driver)
		wantArg(t, mounter, "--registration-socket", "/registration/"+driver+"-reg.sock")
		pluginEP := args(t, plugin)["--endpoint"]
		pluginDir := r.kubeletDir(t) + "/plugins/" + driver
		wantArg(t, mounter, "--kubelet-registration-path", pluginDir+"/"+filepath.Base(socketPath(t, pluginEP)))
		// It waits for the plugin's own socket, through the same host
		// directory, mounted read-only (a unix socket connects on it).
		wantArg(t, mounter, "--plugin-endpoint", pluginEP)
		sm, sv := r.mountAt(t, mounter, filepath.Dir(socketPath(t, pluginEP)))
		if sv.HostPath == nil || sv.HostPath.Path != pluginDir || !sm.ReadOnly {
			t.Errorf("mounter reaches the plugin's socket through %+v (read-only %v), want hostPath %s read-only", sv.VolumeSource, sm.ReadOnly, pluginDir)
		}
	})
}
