//go:build !linux

package toolrun

import (
	"context"
	"errors"
	"os"
)

// StartSpawner is Linux only; elsewhere tools are started directly.
func StartSpawner() error { return errors.New("toolrun: no spawner on this system") }

// ServeSpawnerIfAsked returns at once: there is no spawner here.
func ServeSpawnerIfAsked() {}

func viaSpawner(context.Context, string, []string, []string, *os.File) (int, bool, error) {
	return 0, false, nil
}
