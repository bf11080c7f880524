package toolrun

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
)

// execute runs name for real with env added to this process's
// environment, its standard output and error going to one anonymous file
// that is read back afterwards.
func execute(ctx context.Context, name string, args, env []string) ([]byte, int, error) {
	f, err := outputFile()
	if err != nil {
		return nil, -1, err
	}
	defer f.Close()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = f, f
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	runErr := cmd.Run()
	out, _ := io.ReadAll(io.LimitReader(io.NewSectionReader(f, 0, readLimit+1), readLimit+1))
	var ee *exec.ExitError
	if errors.As(runErr, &ee) && ee.Exited() {
		return out, ee.ExitCode(), nil
	}
	if runErr != nil {
		return out, -1, runErr
	}
	return out, 0, nil
}
