package chart_test

import (
	"path/filepath"
	"slices"
	"testing"

	"github.com/mountplan/mountplan/pkg/plan"
)

// TestPluginSeesNoKubeletFiles (issue 33, F4): of kubelet's directory the
// plugin's container mounts its own CSI socket dir and the mounter's socket
// dir, nothing else: not pods/ (every pod's Secrets and ServiceAccount
// tokens, other pods' etc-hosts, configMap and emptyDir files), not
// plugins/kubernetes.io/csi, not plugins_registry, nor a host directory
// that holds kubelet's. The mounter makes, looks at, measures and removes
// the plugin's targets (mounter.Targets).
func TestPluginSeesNoKubeletFiles(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		kubelet := r.kubeletDir(t)
		allowed := []string{kubelet + "/plugins/" + r.str(t, "driverName"), r.mounterSocketDir(t)}
		c := r.container(t, "plugin")
		for _, m := range c.VolumeMounts {
			hv := volumeOf(t, r.ds, m.Name).HostPath
			if hv == nil {
				continue
			}
			p := filepath.Join(hv.Path, m.SubPath)
			if !plan.Within(kubelet, p) && !plan.Within(p, kubelet) {
				continue
			}
			if !slices.Contains(allowed, p) {
				t.Errorf("the plugin's container mounts %s at %s, in kubelet's directory %s: only %v may be",
					p, m.MountPath, kubelet, allowed)
			}
		}
	})
}
