package loop

import (
	"testing"

	"github.com/mountplan/mountplan/pkg/plan"
)

// TestChainPlanLeavesTheLabelToItsLayers: a chain's plan binds a layer
// the stage labelled; kubelet's context= reaches no bind (a bind cannot
// take one, and the mounter refuses it there).
func TestChainPlanLeavesTheLabelToItsLayers(t *testing.T) {
	c := &Chain{Lower: "/var/lib/mountplan/chains/v/lower", Merged: "/var/lib/mountplan/chains/v/merged",
		SELinuxContext: "system_u:object_r:container_file_t:s0:c1,c2"}
	for _, ro := range []bool{false, true} {
		mounts, err := chainPlan(c, ro, []string{"noatime", plan.ContextOption(c.SELinuxContext)})
		if err != nil {
			t.Fatalf("chainPlan(readOnly %t) with context=: %v", ro, err)
		}
		if label, _ := plan.ContextOf(mounts[0].Options); label != "" || !mounts[0].HasOption("noatime") {
			t.Fatalf("chainPlan(readOnly %t) options %q: want noatime and no context", ro, mounts[0].Options)
		}
		if err := (plan.Policy{Roots: []string{"/var/lib/mountplan"}}).Validate(mounts); err != nil {
			t.Fatalf("the policy refuses the chain's plan: %v", err)
		}
	}
}
