package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/volview"
)

// TestVolumesCommand: the command prints the plugin's listing, checked
// here: a publish target nothing is mounted at on this machine disagrees.
func TestVolumesCommand(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/debug/volumes" {
			http.NotFound(w, r)
			return
		}
		_ = json.NewEncoder(w).Encode(volview.Report{Node: "n1", Volumes: []volview.Volume{{ID: "pvc-1", Type: "loop",
			Stage: "staged", Health: volview.Health{Status: "ok"},
			Consumers: []volview.Consumer{{Kind: volview.KindPublish, Path: "/nonexistent/mountplan/target"}}}}})
	}))
	defer srv.Close()
	var out bytes.Buffer
	if err := runVolumes(context.Background(), []string{"--plugin-url", srv.URL}, &out); err != nil {
		t.Fatal(err)
	}
	if s := out.String(); !strings.Contains(s, "pvc-1") || !strings.Contains(s, "absent DISAGREES") {
		t.Errorf("table:\n%s", s)
	}
	out.Reset()
	if err := runVolumes(context.Background(), []string{"--plugin-url", srv.URL + "/", "-o", "json"}, &out); err != nil {
		t.Fatal(err)
	}
	var r volview.Report
	if err := json.Unmarshal(out.Bytes(), &r); err != nil || r.Disagreements() != 1 {
		t.Errorf("json (%v):\n%s", err, out.String())
	}
}

func TestVolumesCommandErrors(t *testing.T) {
	notFound := httptest.NewServer(http.NotFoundHandler())
	defer notFound.Close()
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close()
	for _, tc := range []struct {
		name  string
		args  []string
		usage bool
		want  string
	}{
		{"bad format", []string{"-o", "yaml"}, true, "table or json"},
		{"bad url", []string{"--plugin-url", "unix:///x"}, true, "want http://host:port"},
		{"extra argument", []string{"x"}, true, "unexpected"},
		{"no endpoint", []string{"--plugin-url", notFound.URL}, false, "404"},
		{"plugin down", []string{"--plugin-url", down.URL}, false, "--metrics-address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := runVolumes(context.Background(), tc.args, &bytes.Buffer{})
			if err == nil || errors.Is(err, errUsage) != tc.usage || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want one containing %q (usage error: %v)", err, tc.want, tc.usage)
			}
		})
	}
}
