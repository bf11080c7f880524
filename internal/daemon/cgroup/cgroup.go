// Package cgroup gives each FUSE daemon a cgroup v2 leaf of its own below
// the mounter's cgroup, with the limits of its profile, and reads back what
// each leaf used. The mounter's cgroup is laid out as cgroup v2's "no
// internal processes" rule demands once controllers are enabled for
// children:
//
//	<base>/            the mounter's own cgroup (its container's)
//	  mounter/         the mounter and whatever else ran in <base>
//	  daemons/         memory and cpu enabled for its children
//	    <volume>/      one volume's daemon (every generation of it)
//
// A daemon is started directly in its leaf (clone3 CLONE_INTO_CGROUP, see
// daemon.Command.Cgroup), so neither it nor a child of it runs a moment
// outside the accounting. On a cgroup v1 (or hybrid) host, or where the
// mounter cannot write its cgroup, there is no Manager: daemons run as
// before and their profiles' limits are not enforced, which the mounter
// says (Mode, Reason) rather than pretending.
package cgroup

import (
	"fmt"
	"math"

	"k8s.io/apimachinery/pkg/api/resource"
)

// Limits are a daemon's resource limits; zero fields are no limit.
type Limits struct {
	// MemoryBytes becomes memory.max (and memory.swap.max is 0).
	MemoryBytes int64
	// CPUMilli (1000 = one CPU) becomes cpu.max: quota per Period.
	CPUMilli int64
	// Pids becomes pids.max (0: DefaultPids). A daemon outside the
	// mounter's container is no longer bounded by the pod's pids limit;
	// this keeps a runaway daemon from exhausting the host's PIDs.
	Pids int64
}

// DefaultPids is each daemon's pids.max when its profile sets none: far
// above what a FUSE daemon's threads and helpers take.
const DefaultPids = 512

// Period is the cpu.max period, the kernel's default (100ms).
const Period = 100000

// Bounds of what a profile may ask for.
const (
	// MinMemory: below it a daemon hardly starts (the runtime of a Go
	// daemon alone takes a few MiB).
	MinMemory = 4 << 20
	// MinCPUMilli gives the smallest quota the kernel accepts (1ms per
	// 100ms period).
	MinCPUMilli = 10
	// MaxCPUMilli is a thousand CPUs.
	MaxCPUMilli = 1000 * 1000
	// MinPids: a Go daemon's runtime alone starts a few threads.
	MinPids = 8
	// MaxPids is the kernel's largest pid_max (PID_MAX_LIMIT).
	MaxPids = 1 << 22
)

// ParseLimits reads a profile's `resources: {memory, cpu, pids}`: memory
// and cpu Kubernetes quantities ("256Mi", "500m" or "1"), "" no limit;
// pids a number of tasks, 0 DefaultPids.
func ParseLimits(memory, cpu string, pids int64) (Limits, error) {
	var l Limits
	if pids != 0 && (pids < MinPids || pids > MaxPids) {
		return l, fmt.Errorf("resources.pids %d must be between %d and %d", pids, MinPids, MaxPids)
	}
	l.Pids = pids
	if memory != "" {
		q, err := resource.ParseQuantity(memory)
		if err != nil {
			return l, fmt.Errorf("resources.memory %q: %v", memory, err)
		}
		b, ok := q.AsInt64()
		if !ok || b < MinMemory {
			return l, fmt.Errorf("resources.memory %q must be a whole number of bytes, at least 4Mi", memory)
		}
		l.MemoryBytes = b
	}
	if cpu != "" {
		q, err := resource.ParseQuantity(cpu)
		if err != nil {
			return l, fmt.Errorf("resources.cpu %q: %v", cpu, err)
		}
		if q.Cmp(*resource.NewQuantity(MaxCPUMilli/1000, resource.DecimalSI)) > 0 {
			return l, fmt.Errorf("resources.cpu %q is more than %d CPUs", cpu, MaxCPUMilli/1000)
		}
		m := q.MilliValue()
		if m < MinCPUMilli || m > math.MaxInt32 {
			return l, fmt.Errorf("resources.cpu %q must be at least %dm (a 1ms quota per 100ms)", cpu, MinCPUMilli)
		}
		l.CPUMilli = m
	}
	return l, nil
}

// IsZero says whether l limits nothing.
func (l Limits) IsZero() bool { return l == Limits{} }

// cpuMax is cpu.max's "quota period" for l ("max period": no limit).
func (l Limits) cpuMax() string {
	if l.CPUMilli <= 0 {
		return fmt.Sprintf("max %d", Period)
	}
	return fmt.Sprintf("%d %d", l.CPUMilli*Period/1000, Period)
}

// pidsMax is pids.max's value for l (v1 and v2 alike).
func (l Limits) pidsMax() string {
	if l.Pids <= 0 {
		return fmt.Sprint(DefaultPids)
	}
	return fmt.Sprint(l.Pids)
}

// memoryMax is memory.max's value for l.
func (l Limits) memoryMax() string {
	if l.MemoryBytes <= 0 {
		return "max"
	}
	return fmt.Sprint(l.MemoryBytes)
}
