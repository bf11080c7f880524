//go:build linux

package nri

import (
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/mountplan/mountplan/pkg/plan"
)

// failingMounter refuses every plan.
type failingMounter struct{}

func (failingMounter) Mount(context.Context, []plan.Mount, plan.Consumer) error {
	return errors.New("leads through a symlink")
}

func (failingMounter) Unmount(context.Context, []plan.Mount, plan.Consumer) error { return nil }

// TestRefusedStartUnderCRIO: a runtime that starts a container whatever
// the hook answers at StartContainer (CRI-O) gets the refused container
// killed before it runs; one that heeds the answer (containerd) is left to
// fail the start itself, and no process is killed.
func TestRefusedStartUnderCRIO(t *testing.T) {
	kubelet := "/var/lib/kubelet"
	target := podTarget(kubelet, "uid-pod-a", "pv-a")
	rec, err := json.Marshal([]Claim{{VolumeID: "vol-a", Target: target, Destination: "/data", SubPath: "x", AtStart: true}})
	if err != nil {
		t.Fatal(err)
	}
	pod := &nriapi.PodSandbox{Id: "sandbox-a", Uid: "uid-pod-a", Name: "a", Namespace: "shop"}
	for _, rt := range []struct {
		name   string
		killed bool
	}{{"cri-o", true}, {"containerd", false}} {
		t.Run(rt.name, func(t *testing.T) {
			// The container's process, waiting for its start.
			proc := exec.Command("sleep", "60")
			if err := proc.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan error, 1)
			go func() { exited <- proc.Wait() }()
			t.Cleanup(func() { _ = proc.Process.Kill(); <-exited })

			vols := &hostileVolumes{byTarget: map[string][]plan.Mount{target: {{Type: "ext4", Source: "/dev/loop7"}}}}
			h := NewHook(vols, failingMounter{}, t.TempDir(), kubelet)
			if _, err := h.Configure(context.Background(), "", rt.name, "1.0"); err != nil {
				t.Fatal(err)
			}
			ctr := &nriapi.Container{Id: "ctr-a", PodSandboxId: pod.Id, Name: "app", Pid: uint32(proc.Process.Pid),
				Annotations: map[string]string{Annotation: string(rec)}}
			if err := h.StartContainer(context.Background(), pod, ctr); err == nil || !strings.Contains(err.Error(), "symlink") {
				t.Errorf("StartContainer: %v, want the mounter's refusal", err)
			}
			select {
			case <-exited:
				exited <- nil // for the cleanup
				if !rt.killed {
					t.Error("the hook killed the container's process; the runtime fails the start itself")
				}
			case <-time.After(2 * time.Second):
				if rt.killed {
					t.Error("the container's process still runs; under CRI-O it would run with the guard in place of its volume")
				}
			}
		})
	}
}
