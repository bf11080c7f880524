//go:build !linux

package toolrun

import "os"

// outputFile is a temp file removed at once: only the open file remains.
func outputFile() (*os.File, error) {
	f, err := os.CreateTemp("", "mountplan-tool-output-")
	if err != nil {
		return nil, err
	}
	_ = os.Remove(f.Name())
	return f, nil
}
