//go:build clustertest

package cluster

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// flow is one scenario of the issue, run in order against the same
// cluster. A pending flow is listed, not run: what it needs is not done yet.
type flow struct {
	name    string
	pending string
	run     func(t *testing.T, e *env)
}

var flows = []flow{
	{name: "DynamicPVC", run: dynamicPVC},
	{name: "PodRecreated", run: podRecreated},
	{name: "TwoPodsRWO_RWOPRefused", run: twoPodsRWO},
}

// dynamicPVC: a claim of the chart's StorageClass, provisioned on the node
// of its first pod, written and read back.
func dynamicPVC(t *testing.T, e *env) {
	e.apply(t, pvc("data", storageClass, "64Mi"))
	e.run(t, pod("a1", withClaim("data", "/data", false)))
	e.shared["data"] = e.write(t, "a1", "/data/token")
	out := must(t)(e.c.podExec("a1", "df", "-k", "/data"))
	if !strings.Contains(out, "/data") {
		t.Errorf("df /data: %s", out)
	}
}

// podRecreated: the pod deleted and a new one on the same claim finds the data.
func podRecreated(t *testing.T, e *env) {
	e.c.deleteAndWait(t, "pod", "a1")
	e.run(t, pod("a2", withClaim("data", "/data", false)))
	e.expect(t, "a2", "/data/token", e.shared["data"])
	e.shared["data"] = e.write(t, "a2", "/data/token")
}

// twoPodsRWO: two pods of one node share a ReadWriteOnce claim; a second
// pod of a ReadWriteOncePod claim is refused until the first is gone.
func twoPodsRWO(t *testing.T, e *env) {
	e.run(t, pod("a3", withClaim("data", "/data", false)))
	e.expect(t, "a3", "/data/token", e.shared["data"])
	tok := e.write(t, "a3", "/data/token")
	e.expect(t, "a2", "/data/token", tok)
	e.shared["data"] = tok
	e.c.deleteAndWait(t, "pod", "a3")

	e.apply(t, pvc("once", storageClass, "32Mi", "ReadWriteOncePod"))
	e.run(t, pod("o1", withClaim("once", "/data", false)))
	tok = e.write(t, "o1", "/data/token")
	e.apply(t, pod("o2", withClaim("once", "/data", false)))
	waitFor(t, 60*time.Second, "o2 refused for ReadWriteOncePod", func() error {
		out, err := e.c.kubectl("-n", testNS, "get", "pod", "o2", "-o",
			`jsonpath={.status.phase} {.status.conditions[?(@.type=="PodScheduled")].reason}: {.status.conditions[?(@.type=="PodScheduled")].message}`)
		if err != nil {
			return err
		}
		if !strings.HasPrefix(out, "Pending Unschedulable") || !strings.Contains(out, "ReadWriteOncePod") {
			return fmt.Errorf("o2: %s", out)
		}
		return nil
	})
	// Refused, not lost: once o1 is gone, o2 runs and finds the data.
	e.c.deleteAndWait(t, "pod", "o1")
	e.c.waitPod(t, "o2")
	e.expect(t, "o2", "/data/token", tok)
	e.c.deleteAndWait(t, "pod", "o2")
	e.c.deleteAndWait(t, "pvc", "once")
}

// deleteEverything deletes every object of the flows, uninstalls the chart
// and checks inside the node that nothing of the volumes is left: journal
// records, images, mounts of the state dir and of kubelet's volume paths,
// loop devices backed by the state dir's files.
func (e *env) deleteEverything(t *testing.T) {
	t.Helper()
	must(t)(e.c.kubectl("delete", "namespace", testNS, "--wait=true", "--timeout=180s"))
	waitFor(t, 2*time.Minute, "every PersistentVolume deleted", func() error {
		out, err := e.c.kubectl("get", "pv", "-o", "name")
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "" {
			return fmt.Errorf("left: %s", out)
		}
		return nil
	})
	if recs := e.records(t); len(recs) != 0 {
		t.Errorf("journal records left with no volume: %v", recs)
	}
	must(t)(e.c.helm("uninstall", "mountplan", "--namespace", "kube-system", "--wait", "--timeout", "3m"))
	waitFor(t, 2*time.Minute, "no pod left", func() error {
		out, err := e.c.kubectl("get", "pods", "-A", "-o", "name")
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != "" {
			return fmt.Errorf("left: %s", out)
		}
		return nil
	})
	e.checkNodeClean(t)
}
