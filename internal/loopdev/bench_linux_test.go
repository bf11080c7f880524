package loopdev

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/testenv"
)

// BenchmarkAttachDetach: LOOP_CTL_GET_FREE + LOOP_CONFIGURE + status
// read-back, then identity check + LOOP_CLR_FD + close.
func BenchmarkAttachDetach(b *testing.B) {
	testenv.RequireRoot(b)
	for _, dio := range []bool{false, true} {
		b.Run(mode(dio), func(b *testing.B) {
			img := sparseImage(b, testDir(b), "bench.img", 64*mib)
			for b.Loop() {
				d, err := Attach(b.Context(), img, Options{Autoclear: true, DirectIO: dio})
				if err != nil {
					b.Fatal(err)
				}
				if err := d.Detach(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkLosetupTool does the same through util-linux, for comparison.
func BenchmarkLosetupTool(b *testing.B) {
	testenv.RequireRoot(b)
	testenv.RequireCommands(b, "losetup")
	for _, dio := range []bool{false, true} {
		b.Run(mode(dio), func(b *testing.B) {
			img := sparseImage(b, testDir(b), "bench.img", 64*mib)
			args := []string{"--find", "--show", img}
			if dio {
				args = append(args, "--direct-io=on")
			}
			for b.Loop() {
				out, err := exec.Command("losetup", args...).Output()
				if err != nil {
					b.Fatal(err)
				}
				dev := strings.TrimSpace(string(out))
				if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err != nil {
					b.Fatalf("losetup -d %s: %v\n%s", dev, err, out)
				}
			}
		})
	}
}

func mode(dio bool) string {
	if dio {
		return "direct-io"
	}
	return "buffered"
}
