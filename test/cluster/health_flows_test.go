//go:build clustertest

package cluster

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// volumeHealthInPodStatus: Kubernetes' own view of a volume's health. With
// the CSIVolumeHealth feature gate (alpha, on in this cluster: kubelet and
// API server), kubelet calls NodeGetVolumeHealth every volumeStatsAggPeriod
// and writes what the plugin says into the pod's status.volumeHealth. The
// squashfuse daemon of a pod's volume is killed while its image is away, so
// the restart fails and the volume stays down; the pod's status must say so
// (Inaccessible, with the plugin's reason), and must say nothing once the
// image is back and the volume healed.
func volumeHealthInPodStatus(t *testing.T, e *env) {
	sqTok, _ := e.fuseSetup(t)
	const name, vol = "sqhealth", "v-sqfuse"
	e.run(t, pod(name, withClaim("sqfuse", "/data", true)))
	if err := e.podHolds(name, "/data/file", sqTok); err != nil {
		t.Fatal(err)
	}
	img := e.c.cfg.path("srv", "fuse", "tree.sqfs")
	// Not in the mounter's container: in cgroups of their own
	// (fuse_rollout_flows_test.go).
	daemon := e.daemonPID(t, "squashfuse")

	// The image goes away first: the supervisor's restarts fail until it
	// is back.
	restore := moveAway(t, img)
	defer restore()
	killed := time.Now()
	if err := unix.Kill(daemon, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var down []volumeHealthCondition
	waitFor(t, 90*time.Second, "pod status to report the volume abnormal", func() error {
		c, err := e.podVolumeHealth(name, vol)
		if err != nil {
			return err
		}
		if len(c) == 0 {
			return fmt.Errorf("status.volumeHealth of %s has no condition yet", vol)
		}
		down = c
		return nil
	})
	t.Logf("pod status reports the volume abnormal %v after the kill: %+v", time.Since(killed).Round(100*time.Millisecond), down)
	// The claim and the pod are told too, in Events (mountplan-resizer's
	// health events), whatever kubelet's feature gates.
	claimUID := strings.TrimSpace(must(t)(e.c.kubectl("-n", testNS, "get", "pvc", "sqfuse", "-o", "jsonpath={.metadata.uid}")))
	podUID := strings.TrimSpace(must(t)(e.c.kubectl("-n", testNS, "get", "pod", name, "-o", "jsonpath={.metadata.uid}")))
	healthEvents := func(reason string) error {
		for _, on := range []struct{ kind, name, uid string }{{"PersistentVolumeClaim", "sqfuse", claimUID}, {"Pod", name, podUID}} {
			msg, err := e.eventsOn(reason, on.kind, on.name, on.uid)
			if err != nil {
				return err
			}
			t.Logf("event %s on %s %s: %s", reason, on.kind, on.name, msg)
		}
		return nil
	}
	waitFor(t, time.Minute, "VolumeConditionAbnormal events on the claim and the pod", func() error { return healthEvents("VolumeConditionAbnormal") })
	// The claim's status.healthStatus says so too (the same resizer).
	waitFor(t, time.Minute, "the claim's status.healthStatus", func() error {
		c, err := e.claimHealth("sqfuse")
		if err == nil && (len(c) == 0 || c[0].Status != "Inaccessible") {
			err = fmt.Errorf("status.healthStatus of claim sqfuse: %+v, want an Inaccessible condition", c)
		}
		if err == nil {
			t.Logf("claim sqfuse status.healthStatus: %+v", c)
		}
		return err
	})
	for _, c := range down {
		if c.Status != "Inaccessible" || (c.Reason != "DaemonDown" && c.Reason != "RestartFailed") {
			t.Errorf("condition %+v, want status Inaccessible with reason DaemonDown or RestartFailed", c)
		}
	}

	restore()
	back := time.Now()
	waitFor(t, 3*time.Minute, "the volume to heal and the pod status to clear", func() error {
		if err := e.podHolds(name, "/data/file", sqTok); err != nil {
			return err
		}
		c, err := e.podVolumeHealth(name, vol)
		if err != nil {
			return err
		}
		if len(c) != 0 {
			return fmt.Errorf("status.volumeHealth of %s still has %+v", vol, c)
		}
		return nil
	})
	t.Logf("heal time: the pod reads the volume again and its status is clear %v after the image came back", time.Since(back).Round(100*time.Millisecond))
	waitFor(t, time.Minute, "VolumeConditionNormal events on the claim and the pod", func() error { return healthEvents("VolumeConditionNormal") })
	waitFor(t, time.Minute, "the claim's status.healthStatus cleared", func() error {
		c, err := e.claimHealth("sqfuse")
		if err == nil && len(c) != 0 {
			err = fmt.Errorf("status.healthStatus of claim sqfuse still has %+v", c)
		}
		return err
	})
	e.c.deleteAndWait(t, "pod", name)
	e.fuseTeardown(t, "sqfuse", "rclone")
}

// volumeHealthCondition is one entry of a pod's status.volumeHealth[].healthConditions.
type volumeHealthCondition struct {
	Status  string `json:"status"`
	Reason  string `json:"reason"`
	Message string `json:"message"`
}

// podVolumeHealth returns the conditions kubelet wrote for one of a pod's
// volumes (none: the volume is healthy, or kubelet has not probed it).
func (e *env) podVolumeHealth(pod, volume string) ([]volumeHealthCondition, error) {
	out, err := e.c.kubectl("-n", testNS, "get", "pod", pod, "-o", "json")
	if err != nil {
		return nil, err
	}
	var p struct {
		Status struct {
			VolumeHealth []struct {
				Name             string                  `json:"name"`
				HealthConditions []volumeHealthCondition `json:"healthConditions"`
			} `json:"volumeHealth"`
		} `json:"status"`
	}
	if err := json.NewDecoder(strings.NewReader(out)).Decode(&p); err != nil {
		return nil, fmt.Errorf("pod %s: %w", pod, err)
	}
	for _, v := range p.Status.VolumeHealth {
		if v.Name == volume {
			return v.HealthConditions, nil
		}
	}
	return nil, nil
}

// eventsOn returns the messages of the Events of a reason on one object
// of the test namespace (by kind, name and UID); an error while there are
// none.
func (e *env) eventsOn(reason, kind, name, uid string) (string, error) {
	msg, err := e.c.kubectl("-n", testNS, "get", "events", "-o", "jsonpath={.items[*].message}", "--field-selector",
		"reason="+reason+",involvedObject.kind="+kind+",involvedObject.name="+name+",involvedObject.uid="+uid)
	if err != nil {
		return "", err
	}
	if strings.TrimSpace(msg) == "" {
		return "", fmt.Errorf("no %s event on %s %s yet", reason, kind, name)
	}
	return msg, nil
}

// claimHealth returns the conditions of a claim's status.healthStatus
// (none: healthy, or nothing written).
func (e *env) claimHealth(claim string) ([]volumeHealthCondition, error) {
	out, err := e.c.kubectl("-n", testNS, "get", "pvc", claim, "-o", "jsonpath={.status.healthStatus.healthConditions}")
	if err != nil || strings.TrimSpace(out) == "" {
		return nil, err
	}
	var c []volumeHealthCondition
	if err := json.Unmarshal([]byte(out), &c); err != nil {
		return nil, fmt.Errorf("claim %s: %w", claim, err)
	}
	return c, nil
}

// moveAway renames path aside (path.away) and returns what moves it back,
// once however often it is called.
func moveAway(t *testing.T, path string) (restore func()) {
	t.Helper()
	away := path + ".away"
	if err := os.Rename(path, away); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			if err := os.Rename(away, path); err != nil {
				t.Error(err)
			}
		})
	}
}
