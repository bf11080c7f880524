package main

import (
	"testing"
)

// TestMetricsNameTheNode: the plugin's metrics carry the node's name it was
// started with (--node-id) as mountplan_node_info{node=...} 1, which the
// dashboard's Node variable lists; with metrics off there are none.
func TestMetricsNameTheNode(t *testing.T) {
	mx := newMetrics(flags{nodeID: "node-a", metricsAddress: "127.0.0.1:0"}, nil, nil)
	if mx == nil {
		t.Fatal("no metrics with --metrics-address")
	}
	mfs, err := mx.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, mf := range mfs {
		if mf.GetName() != "mountplan_node_info" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "node" && l.GetValue() == "node-a" && m.GetGauge().GetValue() == 1 {
					found = true
				}
			}
		}
	}
	if !found {
		t.Error(`no mountplan_node_info{node="node-a"} 1 in the plugin's metrics`)
	}
	if newMetrics(flags{nodeID: "node-a"}, nil, nil) != nil {
		t.Error("metrics without --metrics-address")
	}
}
