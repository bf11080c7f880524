package main

import (
	"context"
	"debug/buildinfo"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/mounter/service"
	api "github.com/mountplan/mountplan/pkg/api/v1alpha1"
	"github.com/mountplan/mountplan/pkg/plan"
)

// instance is one plugin with a state dir, a socket and a volume of its
// own and, in the split shape, the mounter it reaches (mountplan-sidecar
// serve, with the plugin's --mounter-endpoint): the deployment's shape.
// Without a mounter the plugin runs the mounter's code in process.
//
// The bench's main instance is the current build, split unless -alone; the
// others take turns with it in measurements 1 and 4: the current build
// alone (-hop), a second plugin binary alone (-compare) and the lean CSI
// node server (-lean, hack/bench/leancsi), which has no controller, no
// state dir and no mounter: its volume is an image the bench copies, named
// in the volume context of each stage.
type instance struct {
	name   string // directory below the bench's dir; "" for the main instance
	label  string // for the reports: "now, split", "before (1c3132f), alone", ...
	binary string
	split  bool // a mountplan-sidecar serve beside the plugin
	lean   bool // the lean server, not a plugin
	root   string

	stateDir  string // the plugin's --state-dir, the mounter's too
	config    string // the admin config (--config) of the plugin and the mounter; "" for none
	sock      string
	pluginLog string
	staging   string // staging_target_path (the plugin mounts nothing there)
	target    string // target_path of NodePublishVolume
	consMount string // the consumer's mount point, as its namespace sees it

	// The mounter: its socket (in a directory of its own, which it makes
	// 0700), its log and its records. Without a mounter process,
	// recordsDir is where the plugin's in-process mounter keeps them.
	mounterSock, mounterLog, recordsDir string

	metricsAddr string // the plugin's --metrics-address, "" if it has none
	// reconcileInterval is the plugin's --reconcile-interval ("" for 1h);
	// the last start took pluginListening from exec to the socket
	// accepting, pluginReady to Probe ready.
	reconcileInterval            string
	pluginListening, pluginReady time.Duration

	plugin      *child
	mounterProc *child
	// mnt is the mounter's client (split only): the prepare cycle performs
	// the plan through it, as the sidecar's mount command or the NRI hook
	// do.
	mnt  *service.Client
	conn *grpc.ClientConn
	node csi.NodeClient
	ctrl csi.ControllerClient
	prep api.NodePrepareClient

	volumeID string
	image    string
	journal  *writeCounter // the plugin's volume records
	records  *writeCounter // the mounter's records (loops, mounts)
	// volumeContext goes with every stage: the lean server's names its
	// image; a plugin's is nil (its volume records hold the image).
	volumeContext map[string]string

	// What a cycle left half done, for the teardown.
	published, prepared, staged bool
	attributed                  bool // the consumer was named to the mounter (split)
	preparedCons                plan.Consumer
}

func newInstance(base, name, label, binary string, split bool) (*instance, error) {
	root := filepath.Join(base, name)
	in := &instance{
		name: name, label: label, binary: binary, split: split, root: root,
		stateDir:  filepath.Join(root, "state"),
		sock:      filepath.Join(root, "csi.sock"),
		pluginLog: filepath.Join(root, "plugin.log"),
		staging:   filepath.Join(root, "staging"),
		target:    filepath.Join(root, "publish", "target"),
		consMount: filepath.Join(root, "consumer-mnt"),
	}
	if split {
		in.mounterSock = filepath.Join(root, "mounter", "mounter.sock")
		in.mounterLog = filepath.Join(root, "mounter.log")
		in.recordsDir = filepath.Join(root, "mounter-records")
	} else {
		in.recordsDir = mounter.DefaultRecordsDir(in.stateDir) // as the plugin sets it
	}
	for _, d := range []string{in.stateDir, in.staging, filepath.Dir(in.target), in.consMount} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return in, err
		}
	}
	return in, nil
}

// shape names how the instance's privileged work is done.
func (in *instance) shape() string {
	if in.split {
		return "plugin + mounter (mountplan-sidecar serve) over its socket"
	}
	return "plugin alone, mounter in process"
}

// revision names the commit a Go binary was built from (vcs.revision,
// shortened; "+dirty" when the tree was modified), or "".
func revision(binary string) string {
	bi, err := buildinfo.ReadFile(binary)
	if err != nil {
		return ""
	}
	rev, dirty := "", false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if len(rev) > 7 {
		rev = rev[:7]
	}
	if rev != "" && dirty {
		rev += "+dirty"
	}
	return rev
}

// startMounter starts `mountplan-sidecar serve` for in and waits until it
// answers a call.
func (b *bench) startMounter(ctx context.Context, in *instance) error {
	logf, err := os.OpenFile(in.mounterLog, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	start := time.Now()
	args := append([]string{b.o.sidecar, "serve",
		"--endpoint", "unix://" + in.mounterSock, "--state-dir", in.stateDir, "--records-dir", in.recordsDir, "--kubelet-dir", b.dir},
		in.configArgs()...)
	in.mounterProc, err = startChild("mounter", logf, logf, args...)
	if err != nil {
		return err
	}
	b.logf("mounter pid %d, log %s", in.mounterProc.pid(), in.mounterLog)
	in.mnt = service.NewClient(in.mounterSock)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if in.mounterProc.exited() {
			return fmt.Errorf("mounter exited at start: %v", in.mounterProc.err)
		}
		if c, err := net.DialTimeout("unix", in.mounterSock, time.Second); err == nil {
			c.Close()
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err = mounterNoop(cctx, in.mnt)
			cancel()
			if err == nil {
				b.logf("mounter serving after %v", time.Since(start))
				return nil
			}
		}
		if time.Now().After(deadline) {
			return errors.New("mounter did not answer within 30s")
		}
		if err := sleepCtx(ctx, time.Millisecond); err != nil {
			return err
		}
	}
}

// configArgs are the flags that give the plugin and the mounter in's admin
// config, if it has one.
func (in *instance) configArgs() []string {
	if in.config == "" {
		return nil
	}
	return []string{"--config", in.config}
}

// mounterNoop is a call the mounter answers without work: whether a
// consumer that names no namespace is alive (the client sends nothing for
// an empty list).
func mounterNoop(ctx context.Context, c *service.Client) error {
	_, err := c.LiveNamespaces(ctx, []plan.Consumer{{}})
	return err
}

// stopMounter stops the mounter (SIGTERM): the kernel clears the loop
// devices it held that nothing mounts.
func (in *instance) stopMounter() error {
	if in.mnt != nil {
		_ = in.mnt.Close()
	}
	if in.mounterProc == nil {
		return nil
	}
	return in.mounterProc.stop(syscall.SIGTERM, 10*time.Second)
}

// logTails returns the last n lines of the plugin's and the mounter's logs.
func (in *instance) logTails(n int) string {
	var out []string
	for _, l := range []struct{ what, path string }{{"plugin", in.pluginLog}, {"mounter", in.mounterLog}} {
		if t := logTail(l.path, n); t != "" {
			out = append(out, fmt.Sprintf("%s log (%s), last lines:\n%s", l.what, in.label, t))
		}
	}
	return strings.Join(out, "\n")
}
