//go:build clustertest

package cluster

import (
	"regexp"
	"strings"
	"testing"
)

// helmTest: `helm test` of the installed chart passes: its pod, from the
// plugin's image (imported, never pulled), finds a ready plugin of the
// chart's driver name on the CSI socket kubelet uses. A passed test's pod
// is deleted at once (hook-succeeded), so helm's --logs cannot read it; a
// failed one stays, and its log is shown.
func helmTest(t *testing.T, e *env) {
	out, err := e.c.helm("test", "mountplan", "--namespace", "kube-system", "--timeout", "3m")
	t.Logf("helm test:\n%s", out)
	if err != nil {
		logs, _ := e.c.kubectl("--namespace", "kube-system", "logs", "mountplan-test-plugin")
		t.Fatalf("helm test: %v\nthe test pod's log:\n%s", err, logs)
	}
	if !regexp.MustCompile(`Phase:\s+Succeeded`).MatchString(out) {
		t.Errorf("helm test says no Succeeded phase")
	}
	if !strings.Contains(out, "mountplan-test-plugin") {
		t.Errorf("helm test ran no mountplan-test-plugin")
	}
}
