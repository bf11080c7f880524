package fuseprofile

import (
	"errors"
	"testing"

	"github.com/mountplan/mountplan/internal/daemon/cgroup"
	"github.com/mountplan/mountplan/internal/errdefs"
)

func TestResources(t *testing.T) {
	base := Profile{Name: "p", Binary: "/bin/true", Args: []string{"{mountpoint}"}, Source: SourceRule{Pattern: "x"}}
	ok := map[string]struct {
		r    Resources
		want cgroup.Limits
	}{
		"none":          {Resources{}, cgroup.Limits{}},
		"memory":        {Resources{Memory: "256Mi"}, cgroup.Limits{MemoryBytes: 256 << 20}},
		"memory in G":   {Resources{Memory: "1G"}, cgroup.Limits{MemoryBytes: 1e9}},
		"millicores":    {Resources{CPU: "500m"}, cgroup.Limits{CPUMilli: 500}},
		"whole cpus":    {Resources{CPU: "2"}, cgroup.Limits{CPUMilli: 2000}},
		"both":          {Resources{Memory: "64Mi", CPU: "0.1"}, cgroup.Limits{MemoryBytes: 64 << 20, CPUMilli: 100}},
		"smallest both": {Resources{Memory: "4Mi", CPU: "10m"}, cgroup.Limits{MemoryBytes: 4 << 20, CPUMilli: 10}},
		"pids":          {Resources{Pids: 64}, cgroup.Limits{Pids: 64}},
	}
	for name, c := range ok {
		t.Run(name, func(t *testing.T) {
			p := base
			p.Resources = c.r
			if err := Validate([]Profile{p}); err != nil {
				t.Fatal(err)
			}
			if l, err := p.Resources.Limits(); err != nil || l != c.want {
				t.Fatalf("Limits() = %+v, %v; want %+v", l, err, c.want)
			}
		})
	}
	bad := map[string]Resources{
		"memory not a quantity": {Memory: "lots"},
		"memory too small":      {Memory: "1Mi"},
		"memory negative":       {Memory: "-64Mi"},
		"memory fractional":     {Memory: "0.5"},
		"cpu not a quantity":    {CPU: "fast"},
		"cpu too small":         {CPU: "5m"},
		"cpu zero":              {CPU: "0"},
		"cpu negative":          {CPU: "-1"},
		"cpu absurd":            {CPU: "1001"},
		"pids too few":          {Pids: 2},
		"pids negative":         {Pids: -1},
		"pids absurd":           {Pids: 1 << 23},
	}
	for name, r := range bad {
		t.Run(name, func(t *testing.T) {
			p := base
			p.Resources = r
			if err := Validate([]Profile{p}); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("Validate(%+v) = %v, want InvalidArgument", r, err)
			}
		})
	}
}
