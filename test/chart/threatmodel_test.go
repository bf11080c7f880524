package chart_test

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
)

// threatModel is the page whose table of what each pod holds must say
// what the chart renders with its default values.
var threatModel = filepath.Join("..", "..", "docs", "threat-model.md")

// holdsHeading starts the section whose first table is checked.
const holdsHeading = "## What each pod holds"

// podHolds is one row of that table, every cell as the page writes it
// (backticks removed); hostPaths is a set of normalized entries.
type podHolds struct {
	pod, privileged, capabilities, hostPID, hostNetwork string
	hostPaths                                           []string
}

func (h podHolds) String() string {
	return fmt.Sprintf("pod %s, privileged %s, capabilities %s, hostPID %s, hostNetwork %s, host paths %s",
		h.pod, h.privileged, h.capabilities, h.hostPID, h.hostNetwork, strings.Join(h.hostPaths, "; "))
}

// TestThreatModelTable renders the chart with its default values and
// checks docs/threat-model.md's table of what each pod holds against it:
// the same containers, and for each its pod, privilege, capabilities,
// host namespaces and host paths (path, where mounted, propagation,
// read-only). The page and the chart must not disagree.
func TestThreatModelTable(t *testing.T) {
	doc, err := parseHoldsTable(threatModel)
	if err != nil {
		t.Fatal(err)
	}
	r := render(t, nil)
	got := map[string]podHolds{}
	for _, ds := range r.daemonSets() {
		for _, c := range ds.Spec.Template.Spec.Containers {
			got[c.Name] = holdsOf(t, ds, c)
		}
	}
	var names []string
	for n := range got {
		names = append(names, n)
	}
	for n := range doc {
		if _, ok := got[n]; !ok {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	for _, n := range names {
		g, inChart := got[n]
		d, inDoc := doc[n]
		switch {
		case !inDoc:
			t.Errorf("%s: the chart runs container %s, which the table does not list: %s", threatModel, n, g)
		case !inChart:
			t.Errorf("%s: the table lists container %s, which the chart does not run", threatModel, n)
		default:
			if g.String() != d.String() {
				t.Errorf("%s: container %s:\n  page:  %s\n  chart: %s", threatModel, n, d, g)
			}
		}
	}
}

// holdsOf is what container c of ds's pod holds, in the table's words.
func holdsOf(t *testing.T, ds *appsv1.DaemonSet, c corev1.Container) podHolds {
	t.Helper()
	spec := ds.Spec.Template.Spec
	yesNo := func(b bool) string { return map[bool]string{true: "yes", false: "no"}[b] }
	sc := c.SecurityContext
	privileged := sc != nil && sc.Privileged != nil && *sc.Privileged
	caps := "the runtime's default"
	switch {
	case privileged:
		caps = "all (privileged)"
	case sc != nil && sc.Capabilities != nil:
		var parts []string
		if len(sc.Capabilities.Add) > 0 {
			parts = append(parts, fmt.Sprintf("add %v", sc.Capabilities.Add))
		}
		if slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
			if len(parts) == 0 {
				parts = append(parts, "none")
			}
			parts = append(parts, "(drop ALL)")
		} else if len(sc.Capabilities.Drop) > 0 {
			parts = append(parts, fmt.Sprintf("drop %v", sc.Capabilities.Drop))
		}
		caps = strings.Join(parts, " ")
	}
	h := podHolds{pod: ds.Name, privileged: yesNo(privileged), capabilities: caps,
		hostPID: yesNo(spec.HostPID), hostNetwork: yesNo(spec.HostNetwork)}
	for _, m := range c.VolumeMounts {
		v := volumeOf(t, ds, m.Name)
		if v.HostPath == nil {
			continue
		}
		var flags []string
		if m.MountPropagation != nil && *m.MountPropagation != corev1.MountPropagationNone {
			flags = append(flags, string(*m.MountPropagation))
		}
		if m.ReadOnly {
			flags = append(flags, "ro")
		}
		h.hostPaths = append(h.hostPaths, hostPathEntry(v.HostPath.Path, m.MountPath, flags))
	}
	slices.Sort(h.hostPaths)
	return h
}

// hostPathEntry is the normalized form of a host path cell's entry.
func hostPathEntry(host, at string, flags []string) string {
	e := host
	if at != "" && at != host {
		e += " at " + at
	}
	if len(flags) > 0 {
		e += " (" + strings.Join(flags, ", ") + ")"
	}
	return e
}

// hostPathCell matches one entry of the host paths cell, backticks kept:
// `host` [at `path`] [(flag, flag)].
var hostPathCell = regexp.MustCompile("^`([^`]+)`(?: at `([^`]+)`)?(?: \\(([^)]*)\\))?$")

// parseHoldsTable reads the first table after holdsHeading, by container.
func parseHoldsTable(file string) (map[string]podHolds, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	_, section, ok := strings.Cut(string(b), "\n"+holdsHeading+"\n")
	if !ok {
		return nil, fmt.Errorf("%s has no section %q", file, holdsHeading)
	}
	var rows [][]string
	inTable := false
	for _, line := range strings.Split(section, "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "## ") {
			break
		}
		if !strings.HasPrefix(line, "|") {
			if inTable {
				break
			}
			continue
		}
		inTable = true
		cells := strings.Split(strings.Trim(line, "|"), "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		rows = append(rows, cells)
	}
	want := []string{"container", "pod", "privileged", "capabilities", "hostPID", "hostNetwork", "host paths"}
	if len(rows) < 3 || !slices.Equal(rows[0], want) {
		return nil, fmt.Errorf("%s: the first table of %q must have the columns %q and rows; found %q", file, holdsHeading, want, rows)
	}
	unquote := func(s string) string { return strings.ReplaceAll(s, "`", "") }
	out := map[string]podHolds{}
	for _, row := range rows[2:] {
		if len(row) != len(want) {
			return nil, fmt.Errorf("%s: row %q has %d cells, want %d", file, row, len(row), len(want))
		}
		name := unquote(row[0])
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("%s: container %s listed twice", file, name)
		}
		h := podHolds{pod: unquote(row[1]), privileged: row[2], capabilities: row[3], hostPID: row[4], hostNetwork: row[5]}
		if row[6] != "none" && row[6] != "" {
			for _, e := range strings.Split(row[6], ";") {
				m := hostPathCell.FindStringSubmatch(strings.TrimSpace(e))
				if m == nil {
					return nil, fmt.Errorf("%s: container %s: host path entry %q is not `path` [at `path`] [(flags)]", file, name, strings.TrimSpace(e))
				}
				var flags []string
				if m[3] != "" {
					for _, f := range strings.Split(m[3], ",") {
						flags = append(flags, strings.TrimSpace(f))
					}
				}
				h.hostPaths = append(h.hostPaths, hostPathEntry(m[1], m[2], flags))
			}
		}
		slices.Sort(h.hostPaths)
		out[name] = h
	}
	return out, nil
}
