package chart_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// TestMounterLivenessProbe: kubelet runs `mountplan-sidecar probe` against
// the very socket serve listens on; the probe's own timeout is shorter than
// kubelet's, so that a silent mounter fails with the probe's reason rather
// than a kill.
func TestMounterLivenessProbe(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		c := r.container(t, "mounter")
		p := c.LivenessProbe
		if p == nil || p.Exec == nil {
			t.Fatalf("the mounter has no exec liveness probe: %+v", p)
		}
		cmd := p.Exec.Command
		if len(cmd) < 3 || cmd[0] != sidecarBinary || cmd[1] != "probe" {
			t.Fatalf("the mounter's probe runs %q, want %s probe --mounter-endpoint=...", cmd, sidecarBinary)
		}
		probeArgs := &corev1.Container{Name: "mounter's probe", Args: cmd[2:]}
		// serve's --endpoint is the socket it serves; probe calls it, so
		// it names it --mounter-endpoint (the deprecated --endpoint warns).
		wantArg(t, probeArgs, "--mounter-endpoint", args(t, c)["--endpoint"])
		timeout, err := time.ParseDuration(args(t, probeArgs)["--timeout"])
		if err != nil || timeout <= 0 {
			t.Fatalf("the mounter's probe has no --timeout: %q", cmd)
		}
		checkProbeTiming(t, p)
		if time.Duration(p.TimeoutSeconds)*time.Second <= timeout {
			t.Errorf("kubelet's probe timeout %ds is not longer than the command's --timeout %v", p.TimeoutSeconds, timeout)
		}
	})
}

// TestResizerLivenessProbe: the resizer serves /healthz on
// --health-address, on resizer.healthPort (localhost only in the host's
// network, as the plugin's), and kubelet probes it there.
func TestResizerLivenessProbe(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		if r.value(t, "resizer.enabled") != true {
			return
		}
		c := r.container(t, "resizer")
		port := r.num(t, "resizer.healthPort")
		host := ""
		if r.value(t, "hostNetwork") == true {
			host = "localhost"
		}
		wantArg(t, c, "--health-address", fmt.Sprintf("%s:%d", host, port))
		if port == r.num(t, "healthPort") || r.value(t, "metrics.enabled") == true && port == r.num(t, "metrics.port") {
			t.Errorf("resizer.healthPort %d is another endpoint's port", port)
		}
		i := slices.IndexFunc(c.Ports, func(p corev1.ContainerPort) bool { return p.ContainerPort == port })
		if i < 0 {
			t.Fatalf("the resizer does not declare its health port %d: %+v", port, c.Ports)
		}
		p := c.LivenessProbe
		if p == nil || p.HTTPGet == nil {
			t.Fatalf("the resizer has no HTTP liveness probe: %+v", p)
		}
		if p.HTTPGet.Path != "/healthz" || p.HTTPGet.Port != intstr.FromString(c.Ports[i].Name) || p.HTTPGet.Host != host {
			t.Errorf("the resizer's probe gets %s:%s%s, want %q:%s/healthz", p.HTTPGet.Host, p.HTTPGet.Port.String(), p.HTTPGet.Path, host, c.Ports[i].Name)
		}
		checkProbeTiming(t, p)
	})
}

// checkProbeTiming: a probe with a period, a timeout and room for a slow
// moment before kubelet restarts the container.
func checkProbeTiming(t *testing.T, p *corev1.Probe) {
	t.Helper()
	if p.PeriodSeconds < 5 || p.TimeoutSeconds < 1 || p.TimeoutSeconds >= p.PeriodSeconds || p.FailureThreshold < 3 {
		t.Errorf("probe every %ds, timeout %ds, %d failures: want a period of 5s or more, a timeout below it and 3 failures or more",
			p.PeriodSeconds, p.TimeoutSeconds, p.FailureThreshold)
	}
}
