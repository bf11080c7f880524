package chart_test

import (
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"

	"github.com/mountplan/mountplan/test/chart/chartrender"
)

// TestStorageCapacityOnByDefault: capacity tracking is the default, so that
// the scheduler never picks a node blindly unless the admin says so.
func TestStorageCapacityOnByDefault(t *testing.T) {
	r := render(t, nil)
	if r.value(t, "storageCapacity.enabled") != true {
		t.Fatalf("storageCapacity.enabled defaults to %v", r.value(t, "storageCapacity.enabled"))
	}
	if r.driver.Spec.StorageCapacity == nil || !*r.driver.Spec.StorageCapacity {
		t.Error("the default CSIDriver does not say storageCapacity: true")
	}
}

// TestStorageCapacity: with storageCapacity.enabled, the CSIDriver tells the
// scheduler to read CSIStorageCapacity objects, each node's provisioner
// publishes them (external-provisioner's README, "Capacity support": with
// --node-deployment, --capacity-ownerref-level=1 and NAMESPACE/POD_NAME
// make the DaemonSet their owner, so that uninstalling removes them) and
// may do so in the release namespace alone; without it, none of that.
func TestStorageCapacity(t *testing.T) {
	forEachValueSet(t, func(t *testing.T, r *rendered) {
		enabled := r.value(t, "storageCapacity.enabled") == true
		if got := r.driver.Spec.StorageCapacity; got == nil || *got != enabled {
			t.Errorf("CSIDriver storageCapacity %v, want %v", got, enabled)
		}
		c := r.container(t, "csi-provisioner")
		a := args(t, c)
		if !enabled {
			for _, f := range []string{"--enable-capacity", "--capacity-ownerref-level"} {
				if _, ok := a[f]; ok {
					t.Errorf("provisioner passes %s with storageCapacity.enabled false", f)
				}
			}
			if r.nsRole != nil || r.nsBinding != nil {
				t.Errorf("Role %v, RoleBinding %v rendered with storageCapacity.enabled false", r.nsRole, r.nsBinding)
			}
			return
		}
		wantArg(t, c, "--enable-capacity", "")
		// Level 1 is the pod's controller: the provisioner must run in the
		// node DaemonSet's pod, not a Deployment's (level 2).
		wantArg(t, c, "--capacity-ownerref-level", "1")
		if r.podOf(t, c) != r.ds {
			t.Errorf("the provisioner runs in %s, not the node DaemonSet", r.podOf(t, c).Name)
		}
		envFromField(t, c, "NAMESPACE", "metadata.namespace")
		envFromField(t, c, "POD_NAME", "metadata.name")
		r.checkCapacityRole(t)
	})
}

// checkCapacityRole: the provisioner's ServiceAccount may manage
// CSIStorageCapacity objects and read pods (its own, for the owner) in the
// release namespace, and nothing more there; the ClusterRole grants
// neither cluster-wide.
func (r *rendered) checkCapacityRole(t *testing.T) {
	t.Helper()
	if r.nsRole == nil || r.nsBinding == nil {
		t.Fatalf("no Role/RoleBinding for CSIStorageCapacity (Role %v, RoleBinding %v)", r.nsRole, r.nsBinding)
	}
	if r.nsRole.Namespace != chartrender.Namespace || r.nsBinding.Namespace != chartrender.Namespace {
		t.Errorf("Role in %q, RoleBinding in %q, want the release namespace %q", r.nsRole.Namespace, r.nsBinding.Namespace, chartrender.Namespace)
	}
	for _, verb := range []string{"get", "list", "watch", "create", "update", "patch", "delete"} {
		if !roleAllows(r.nsRole.Rules, "storage.k8s.io", "csistoragecapacities", verb) {
			t.Errorf("Role %s does not allow %s csistoragecapacities", r.nsRole.Name, verb)
		}
	}
	if !roleAllows(r.nsRole.Rules, "", "pods", "get") {
		t.Errorf("Role %s does not allow get pods (the owner lookup)", r.nsRole.Name)
	}
	for _, rule := range r.nsRole.Rules {
		for _, res := range rule.Resources {
			if res != "csistoragecapacities" && res != "pods" {
				t.Errorf("Role %s grants %s, more than capacity tracking needs", r.nsRole.Name, res)
			}
		}
		if slices.Contains(rule.Resources, "pods") && !slices.Equal(rule.Verbs, []string{"get"}) {
			t.Errorf("Role %s grants %v on pods, want get alone", r.nsRole.Name, rule.Verbs)
		}
	}
	for _, rule := range r.role.Rules {
		if slices.Contains(rule.Resources, "csistoragecapacities") {
			t.Errorf("ClusterRole %s grants csistoragecapacities cluster-wide", r.role.Name)
		}
		// The resizer's health Events watch the pods of their node: list
		// and watch, never more.
		if slices.Contains(rule.Resources, "pods") && !slices.Equal(rule.Verbs, []string{"list", "watch"}) {
			t.Errorf("ClusterRole %s grants %v on pods cluster-wide, want list and watch alone", r.role.Name, rule.Verbs)
		}
	}
	ref := r.nsBinding.RoleRef
	if ref.Kind != "Role" || ref.Name != r.nsRole.Name || ref.APIGroup != rbacv1.GroupName {
		t.Errorf("RoleBinding refers to %+v, want Role %s", ref, r.nsRole.Name)
	}
	want := rbacv1.Subject{Kind: "ServiceAccount", Name: r.ds.Spec.Template.Spec.ServiceAccountName, Namespace: chartrender.Namespace}
	if !slices.Contains(r.nsBinding.Subjects, want) {
		t.Errorf("RoleBinding subjects %+v lack %+v", r.nsBinding.Subjects, want)
	}
}

func roleAllows(rules []rbacv1.PolicyRule, group, resource, verb string) bool {
	return slices.ContainsFunc(rules, func(r rbacv1.PolicyRule) bool {
		return slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, verb)
	})
}

// envFromField checks that a container's env var comes from a field of its pod.
func envFromField(t *testing.T, c *corev1.Container, name, field string) {
	t.Helper()
	for _, e := range c.Env {
		if e.Name == name {
			if e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != field || e.Value != "" {
				t.Errorf("container %s: env %s is not taken from %s: %+v", c.Name, name, field, e)
			}
			return
		}
	}
	t.Errorf("container %s: no env %s", c.Name, name)
}

// The resizer's health Events: its interval is the value's, and the
// ClusterRole's pods rule (list and watch) is there only while they are on.
func TestHealthEventsValue(t *testing.T) {
	podsRule := func(r *rendered) bool {
		return slices.ContainsFunc(r.role.Rules, func(rule rbacv1.PolicyRule) bool { return slices.Contains(rule.Resources, "pods") })
	}
	on := render(t, nil)
	wantArg(t, on.container(t, "resizer"), "--health-events-interval", "10s")
	if !podsRule(on) {
		t.Error("health Events on by default, but the ClusterRole cannot list pods")
	}
	for _, off := range []any{"0s", "0", 0} {
		r := render(t, map[string]any{"resizer": map[string]any{"healthEventsInterval": off}})
		if podsRule(r) {
			t.Errorf("healthEventsInterval %v: the ClusterRole still lists pods", off)
		}
	}
}
