//go:build clustertest

package cluster

import (
	"regexp"
	"strings"
	"testing"
)

// helmTest: `helm test` of the installed chart passes: its pod, from the
// plugin's image (imported, never pulled), finds a ready plugin of the
// chart's driver name on the CSI socket kubelet uses. Its log is shown
// either way; a failed pod stays for it.
func helmTest(t *testing.T, e *env) {
	out, err := e.c.helm("test", "mountplan", "--namespace", "kube-system", "--timeout", "3m", "--logs")
	t.Logf("helm test:\n%s", out)
	if err != nil {
		logs, _ := e.c.kubectl("--namespace", "kube-system", "logs", "mountplan-test-plugin")
		t.Fatalf("helm test: %v\nthe test pod's log:\n%s", err, logs)
	}
	if !regexp.MustCompile(`Phase:\s+Succeeded`).MatchString(out) {
		t.Errorf("helm test says no Succeeded phase")
	}
	if !strings.Contains(out, "is ready") {
		t.Errorf("the test pod's log does not say the plugin is ready")
	}
}
