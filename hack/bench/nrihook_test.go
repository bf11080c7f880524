package main

import (
	"strings"
	"testing"
)

func TestParseNRIBenchmark(t *testing.T) {
	out := `goos: linux
BenchmarkContainerStart
container start latency (crictl create + start), median of 20 interleaved starts

| container's /data | median ms | p90 ms | median vs. published on the host |
|---|---|---|---|
| host directory, no volume | 77.1 | 91.7 | -4.6 ms |
| volume published on the host (no hook) | 81.7 | 111.0 | +0.0 ms |
| volume in NRI mode (hook) | 81.2 | 91.7 | -0.5 ms |

in the hook (the sidecar's log): CreateContainer median 1.26 ms (p90 1.70), StartContainer median 1.12 ms (p90 1.53)
BenchmarkContainerStart-2   	       1	5000000000 ns/op	        77.10 ms-median-0
PASS
`
	for _, tc := range []struct {
		name    string
		out     string
		wantErr bool
	}{
		{"as printed", out, false},
		{"no hook line", strings.Replace(out, "in the hook", "in a hook", 1), true},
		{"no table", strings.ReplaceAll(out, "|", ""), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, err := parseNRIBenchmark(strings.NewReader(tc.out))
			if tc.wantErr {
				if err == nil {
					t.Fatalf("parsed %+v, want an error", res)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(res.starts) != 3 || res.starts[2].what != "volume in NRI mode (hook)" || res.starts[2].p50 != 81.2 || res.starts[1].p90 != 111.0 {
				t.Errorf("starts = %+v", res.starts)
			}
			if res.createP50 != 1.26 || res.createP90 != 1.70 || res.startP50 != 1.12 || res.startP90 != 1.53 {
				t.Errorf("hook = %+v", res)
			}
		})
	}
}
