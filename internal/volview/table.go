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
// consumer (kind, mode, what the kernel says, then the path and who), and
// at the end how many consumers the records and the kernel disagree about.
// Volume lines are aligned with each other, consumer lines likewise.
func WriteTable(w io.Writer, r *Report) error {
	vols, err := columns(func(tw io.Writer) {
		fmt.Fprintln(tw, "VOLUME\tTYPE\tSTAGE\tHEALTH\tDEVICE\tSOURCE")
		for _, v := range r.Volumes {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", v.ID, v.Type, v.Stage, healthText(v.Health), orDash(v.Device), orDash(sourceText(v)))
		}
	})
	if err != nil {
		return err
	}
	cons, err := columns(func(tw io.Writer) {
		for _, v := range r.Volumes {
			for _, c := range v.Consumers {
				fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", c.Kind, mode(c.ReadOnly), kernelText(c.Kernel), consumerText(c))
			}
		}
	})
	if err != nil {
		return err
	}
	var b strings.Builder
	b.WriteString(vols[0])
	for i, v := range r.Volumes {
		b.WriteString(vols[i+1])
		for range v.Consumers {
			b.WriteString(cons[0])
			cons = cons[1:]
		}
	}
	for _, e := range r.Errors {
		fmt.Fprintf(&b, "error: %s\n", e)
	}
	switch n := r.Disagreements(); {
	case len(r.Volumes) == 0:
		b.WriteString("no volumes\n")
	case n > 0:
		fmt.Fprintf(&b, "%d consumer(s): records and kernel disagree\n", n)
	}
	_, err = io.WriteString(w, b.String())
	return err
}

// columns aligns what write writes in columns and returns it as lines,
// each with its newline.
func columns(write func(io.Writer)) ([]string, error) {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	write(tw)
	if err := tw.Flush(); err != nil {
		return nil, err
	}
	lines := strings.SplitAfter(b.String(), "\n")
	return lines[:len(lines)-1], nil // the part after the last newline is empty
}

// consumerText is a consumer's path, who it is (a container's IDs) and
// why the kernel check says what it says.
func consumerText(c Consumer) string {
	s := c.Path
	if who := whoText(c); who != "" {
		s += " in " + who
	}
	if c.Kernel.Detail != "" && c.Kernel.State != Present {
		s += ": " + c.Kernel.Detail
	}
	return s
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

// whoText names a consumer: its pod (and container), and for a
// container its ID, process and mount namespace, as far as recorded.
func whoText(c Consumer) string {
	var parts []string
	if c.Pod != nil {
		if s := c.Pod.String(); s != "" {
			parts = append(parts, "pod "+s)
		}
	}
	if c.Kind != KindContainer {
		return strings.Join(parts, " ")
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
