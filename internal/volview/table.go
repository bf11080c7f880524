package volview

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// WriteJSON writes r as indented JSON.
func WriteJSON(w io.Writer, r *Report) error {
	e := json.NewEncoder(w)
	e.SetIndent("", "  ")
	return e.Encode(r)
}

// WriteTable writes r for a person: a line per volume, below it a line per
// consumer, and at the end how many consumers the records and the kernel
// disagree about.
func WriteTable(w io.Writer, r *Report) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "VOLUME\tTYPE\tSOURCE\tDEVICE\tSTAGE\tHEALTH")
	for _, v := range r.Volumes {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", v.ID, v.Type, orDash(sourceText(v)), orDash(v.Device), v.Stage, healthText(v.Health))
		for _, c := range v.Consumers {
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\n", c.Kind, c.Path, mode(c.ReadOnly), orDash(whoText(c)), kernelText(c.Kernel), c.Kernel.Detail)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, e := range r.Errors {
		if _, err := fmt.Fprintf(w, "error: %s\n", e); err != nil {
			return err
		}
	}
	n := r.Disagreements()
	var err error
	switch {
	case len(r.Volumes) == 0:
		_, err = fmt.Fprintln(w, "no volumes")
	case n > 0:
		_, err = fmt.Fprintf(w, "%d consumer(s): records and kernel disagree\n", n)
	}
	return err
}

func sourceText(v Volume) string {
	if v.DaemonPID != 0 {
		return fmt.Sprintf("%s (daemon pid %d)", v.Source, v.DaemonPID)
	}
	return v.Source
}

func healthText(h Health) string {
	if h.Reason != "" {
		return h.Status + " " + h.Reason
	}
	return h.Status
}

func mode(ro bool) string {
	if ro {
		return "ro"
	}
	return "rw"
}

// whoText names a container consumer: pod, container ID, process and
// mount namespace, as far as recorded; a publish target is on the node.
func whoText(c Consumer) string {
	if c.Kind != KindContainer {
		return "node"
	}
	var parts []string
	if c.Pod != "" {
		parts = append(parts, "pod "+c.Pod)
	}
	if c.ContainerID != "" {
		id := c.ContainerID
		if len(id) > 13 {
			id = id[:13]
		}
		parts = append(parts, "container "+id)
	}
	if c.PID != 0 {
		parts = append(parts, fmt.Sprintf("pid %d", c.PID))
	}
	if c.MountNS != 0 {
		parts = append(parts, fmt.Sprintf("mntns %d", c.MountNS))
	}
	return strings.Join(parts, " ")
}

func kernelText(k Kernel) string {
	switch {
	case k.Disagrees:
		return k.State + " DISAGREES"
	case k.State == Unchecked:
		return "unchecked"
	}
	return k.State
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
