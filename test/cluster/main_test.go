//go:build clustertest

package cluster

import (
	"os"
	"path/filepath"
	"testing"
)

func TestMain(m *testing.M) {
	if filepath.Base(os.Args[0]) == runcOOM {
		os.Exit(runcMain())
	}
	if os.Getenv(nodeEnv) != "" {
		os.Exit(nodeMain())
	}
	if spec := os.Getenv(attackEnv); spec != "" {
		os.Exit(attackMain(spec))
	}
	os.Exit(m.Run())
}
