package chart_test

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/mountplan/mountplan/test/chart/chartrender"
)

// nbdTLSDir is where the chart mounts the Secret nbdTLSSecret names.
const nbdTLSDir = "/etc/mountplan-nbd-tls"

// networkSources allows NBD and iSCSI volumes (a value set of valueSets).
var networkSources = map[string]any{
	"nbdTLSSecret": "nbd-tls",
	"config": map[string]any{
		"imageRoots": []any{"/srv/shared"},
		"nbd": map[string]any{
			"allowedServers": []any{"10.0.0.0/8:10809", "nbd.example.org:*"},
			"socketRoots":    []any{"/run/nbd", "/srv/shared", "/var/lib/mountplan/nbd"},
			"tls": map[string]any{"caFile": nbdTLSDir + "/ca.crt", "certFile": nbdTLSDir + "/tls.crt",
				"keyFile": nbdTLSDir + "/tls.key", "required": true},
			"timeoutSeconds": 20,
		},
		"iscsi": map[string]any{
			"allowedPortals":       []any{"192.0.2.0/24:3260"},
			"deviceTimeoutSeconds": 45,
			"nodeDBDir":            "/var/lib/iscsi/nodes",
			"initiatorNameFile":    "/etc/iscsi-node/initiatorname.iscsi",
		},
	},
}

// TestNetworkSourcesConfig: the plugin, reading the rendered config with its
// own strict loader, gets the NBD and iSCSI settings as given; by default it
// gets none (no NBD or iSCSI volume is allowed) and the chart mounts nothing
// for them.
func TestNetworkSourcesConfig(t *testing.T) {
	r := render(t, networkSources)
	n, i := r.config.NBD, r.config.ISCSI
	if !slices.Equal(n.AllowedServers, []string{"10.0.0.0/8:10809", "nbd.example.org:*"}) ||
		!slices.Equal(n.SocketRoots, []string{"/run/nbd", "/srv/shared", "/var/lib/mountplan/nbd"}) ||
		n.TimeoutSeconds != 20 || n.TLS == nil || !n.TLS.Required ||
		n.TLS.CAFile != nbdTLSDir+"/ca.crt" || n.TLS.CertFile != nbdTLSDir+"/tls.crt" || n.TLS.KeyFile != nbdTLSDir+"/tls.key" {
		t.Errorf("the plugin reads nbd %+v (tls %+v)", n, n.TLS)
	}
	if !slices.Equal(i.AllowedPortals, []string{"192.0.2.0/24:3260"}) || i.DeviceTimeoutSeconds != 45 ||
		i.NodeDBDir != "/var/lib/iscsi/nodes" || i.InitiatorNameFile != "/etc/iscsi-node/initiatorname.iscsi" {
		t.Errorf("the plugin reads iscsi %+v", i)
	}

	d := render(t, nil)
	if _, ok := d.rawConfig["nbd"]; ok {
		t.Errorf("the default config has an nbd section: %v", d.rawConfig["nbd"])
	}
	if _, ok := d.rawConfig["iscsi"]; ok {
		t.Errorf("the default config has an iscsi section: %v", d.rawConfig["iscsi"])
	}
	for _, ds := range d.daemonSets() {
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if strings.HasPrefix(v.Name, "iscsi-") || v.Name == "nbd-tls" {
				t.Errorf("default render has volume %s in %s", v.Name, ds.Name)
			}
		}
	}
}

// TestNetworkSourcesMounts: what NBD and iSCSI need reaches the container
// that needs it at the paths the config names. The plugin makes NBD's
// connections (the socket roots, the Secret with the TLS files) and does
// iSCSI's SendTargets discovery (the initiator name file, read-only); the
// mounter runs iscsiadm (the host's open-iscsi directories: the node
// records it writes CHAP into, the initiator name, iscsiadm's lock) in the
// host's network for iscsid's abstract socket.
func TestNetworkSourcesMounts(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		plugin, mounter := r.container(t, "plugin"), r.container(t, "mounter")
		if r.config.NBD.TLS != nil {
			m, v := r.mountAt(t, plugin, nbdTLSDir)
			if v.Secret == nil || v.Secret.SecretName != r.str(t, "nbdTLSSecret") || !m.ReadOnly {
				t.Errorf("%s: %+v (read-only %v), want the Secret %s read-only", nbdTLSDir, v.VolumeSource, m.ReadOnly, r.str(t, "nbdTLSSecret"))
			}
			for _, f := range []string{r.config.NBD.TLS.CAFile, r.config.NBD.TLS.CertFile, r.config.NBD.TLS.KeyFile} {
				if f != "" && filepath.Dir(f) != nbdTLSDir {
					t.Errorf("config.nbd.tls names %s, outside the Secret's mount %s", f, nbdTLSDir)
				}
			}
		}
		for _, m := range mounter.VolumeMounts {
			if m.Name == "nbd-tls" || m.MountPath == nbdTLSDir {
				t.Errorf("the mounter mounts the NBD TLS files at %s: the plugin makes the connections", m.MountPath)
			}
		}
		iscsi := len(r.config.ISCSI.AllowedPortals) > 0
		want := map[string]corev1.HostPathType{}
		initiator := ""
		if iscsi {
			want["/etc/iscsi"] = corev1.HostPathDirectory
			want["/run/lock/iscsi"] = corev1.HostPathDirectoryOrCreate
			if p := r.config.ISCSI.NodeDBDir; p != "" && !strings.HasPrefix(p, "/etc/iscsi/") {
				want[p] = corev1.HostPathDirectory
			}
			initiator = "/etc/iscsi/initiatorname.iscsi"
			if p := r.config.ISCSI.InitiatorNameFile; p != "" {
				initiator = p
				if !strings.HasPrefix(p, "/etc/iscsi/") {
					want[p] = corev1.HostPathFile
				}
			}
			if !r.mds.Spec.Template.Spec.HostNetwork {
				t.Error("iSCSI allowed without the mounter in the host's network: iscsiadm cannot reach iscsid")
			}
			// The plugin reads the initiator name, nothing else of open-iscsi.
			m, v := r.mountAt(t, plugin, initiator)
			if v.HostPath == nil || v.HostPath.Path != initiator || v.HostPath.Type == nil || *v.HostPath.Type != corev1.HostPathFile || !m.ReadOnly {
				t.Errorf("plugin: %s is %+v (read-only %v), want the hostPath file read-only", initiator, v.VolumeSource, m.ReadOnly)
			}
		}
		for p, typ := range want {
			_, v := r.mountAt(t, mounter, p)
			if v.HostPath == nil || v.HostPath.Path != p || v.HostPath.Type == nil || *v.HostPath.Type != typ {
				t.Errorf("mounter: %s is %+v, want hostPath %s of type %s", p, v.VolumeSource, p, typ)
			}
		}
		for _, m := range mounter.VolumeMounts {
			if _, ok := want[m.MountPath]; strings.HasPrefix(m.Name, "iscsi-") && !ok {
				t.Errorf("mounter mounts %s at %s", m.Name, m.MountPath)
			}
		}
		for _, m := range plugin.VolumeMounts {
			if strings.HasPrefix(m.Name, "iscsi-") && m.MountPath != initiator || strings.HasPrefix(m.MountPath, "/etc/iscsi") && m.MountPath != initiator || m.MountPath == "/run/lock/iscsi" {
				t.Errorf("plugin mounts %s at %s", m.Name, m.MountPath)
			}
		}
	})
}

func TestInvalidNetworkSourceValues(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values map[string]any
	}{
		{"relative nodeDBDir", map[string]any{"config": map[string]any{"iscsi": map[string]any{
			"allowedPortals": []any{"192.0.2.1:3260"}, "nodeDBDir": "iscsi/nodes"}}}},
		{"relative initiatorNameFile", map[string]any{"config": map[string]any{"iscsi": map[string]any{
			"allowedPortals": []any{"192.0.2.1:3260"}, "initiatorNameFile": "initiatorname"}}}},
		{"relative NBD socket root", map[string]any{"config": map[string]any{"nbd": map[string]any{"socketRoots": []any{"run/nbd"}}}}},
		{"NBD socket root /", map[string]any{"config": map[string]any{"nbd": map[string]any{"socketRoots": []any{"/"}}}}},
		{"NBD TLS without a Secret", map[string]any{"config": map[string]any{"nbd": map[string]any{
			"tls": map[string]any{"caFile": nbdTLSDir + "/ca.crt"}}}}},
		{"NBD TLS file outside the Secret", map[string]any{"nbdTLSSecret": "s", "config": map[string]any{"nbd": map[string]any{
			"tls": map[string]any{"caFile": "/etc/ssl/ca.crt"}}}}},
		{"NBD TLS file beside the Secret's dir", map[string]any{"nbdTLSSecret": "s", "config": map[string]any{"nbd": map[string]any{
			"tls": map[string]any{"caFile": nbdTLSDir + "-x/ca.crt"}}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := chartrender.Render(chartDir, tc.values); err == nil {
				t.Errorf("values %v rendered without error", tc.values)
			}
		})
	}
}
