package toolrun

import (
	"os"

	"golang.org/x/sys/unix"
)

// outputFile is a memfd: no directory needs to be writable and nothing is
// left behind whatever happens to the plugin.
func outputFile() (*os.File, error) {
	fd, err := unix.MemfdCreate("mountplan-tool-output", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, os.NewSyscallError("memfd_create", err)
	}
	return os.NewFile(uintptr(fd), "tool-output"), nil
}
