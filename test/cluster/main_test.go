//go:build clustertest

package cluster

import (
	"os"
	"testing"
)

func TestMain(m *testing.M) {
	if os.Getenv(nodeEnv) != "" {
		os.Exit(nodeMain())
	}
	os.Exit(m.Run())
}
