package toolrun

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
)

// execute runs name for real with env added to this process's
// environment (the spawner's: the plugin's as it was at start), its
// standard output and error going to one anonymous file that is read back
// afterwards.
func execute(ctx context.Context, name string, args, env []string) ([]byte, int, error) {
	f, err := outputFile()
	if err != nil {
		return nil, -1, err
	}
	defer f.Close()
	status, ok, err := viaSpawner(ctx, name, args, env, f)
	if !ok {
		status, err = startDirectly(ctx, name, args, env, f)
	}
	out, _ := io.ReadAll(io.LimitReader(io.NewSectionReader(f, 0, readLimit+1), readLimit+1))
	return out, status, err
}

// startDirectly runs the tool as a child of this process. It returns the
// exit status of a tool that exited, else -1 and why.
func startDirectly(ctx context.Context, name string, args, env []string, out *os.File) (int, error) {
	return exitStatus(command(ctx, name, args, env, out).Run())
}

// command is name with env added to this process's environment, its
// standard output and error going to out, killed when ctx ends.
func command(ctx context.Context, name string, args, env []string, out *os.File) *exec.Cmd {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = out, out
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	return cmd
}

// exitStatus reads cmd.Run's error: the exit status of a tool that exited
// (with any status), else -1 and why (not started, killed by a signal).
func exitStatus(runErr error) (int, error) {
	var ee *exec.ExitError
	if errors.As(runErr, &ee) && ee.Exited() {
		return ee.ExitCode(), nil
	}
	if runErr != nil {
		return -1, runErr
	}
	return 0, nil
}
