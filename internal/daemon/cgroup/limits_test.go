package cgroup

import "testing"

// TestLimitFiles: what Prepare writes to memory.max and cpu.max.
func TestLimitFiles(t *testing.T) {
	for _, tt := range []struct {
		l           Limits
		mem, cpuMax string
	}{
		{Limits{}, "max", "max 100000"},
		{Limits{MemoryBytes: 64 << 20, CPUMilli: 500}, "67108864", "50000 100000"},
		{Limits{CPUMilli: 10}, "max", "1000 100000"},
		{Limits{CPUMilli: 2500}, "max", "250000 100000"},
	} {
		if got := tt.l.memoryMax(); got != tt.mem {
			t.Errorf("%+v: memory.max %q, want %q", tt.l, got, tt.mem)
		}
		if got := tt.l.cpuMax(); got != tt.cpuMax {
			t.Errorf("%+v: cpu.max %q, want %q", tt.l, got, tt.cpuMax)
		}
	}
	if got := (Limits{}).pidsMax(); got != "512" {
		t.Errorf("default pids.max %q, want 512", got)
	}
	if got := (Limits{Pids: 64}).pidsMax(); got != "64" {
		t.Errorf("pids.max %q, want 64", got)
	}
}
