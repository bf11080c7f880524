// Command kubectl-mountplan is mountplan's kubectl plugin: on the PATH,
// `kubectl mountplan ...` runs it with the operator's kubeconfig and
// credentials.
//
//	kubectl mountplan forget-node NODE [--driver-name mountplan.csi.io] [--yes]
//	kubectl mountplan volumes [NODE] [-o table|json|yaml]
//
// forget-node shows what a node that is gone for good left of the driver's
// objects in the API (its node-local PersistentVolumes, the claims bound
// to them, its CSIStorageCapacity objects); with --yes it deletes them.
// The node must be deleted first: the data on it is lost with it.
//
// volumes lists each node's volumes as its plugin records them (its
// /debug/volumes), asked through the API server's proxy to the plugin's
// pod: no pod IP, no port-forward.
//
// Flags go anywhere on the line, before or after the command and the
// node, as kubectl takes them; --kubeconfig, --context and -n/--namespace
// are kubectl's.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/mountplan/mountplan/internal/flagalias"
	"github.com/mountplan/mountplan/internal/forgetnode"
	"github.com/mountplan/mountplan/internal/version"
)

const usage = `usage: kubectl mountplan forget-node NODE [--driver-name NAME] [--yes]
       kubectl mountplan volumes [NODE] [-o table|json|yaml] [-l SELECTOR]
       kubectl mountplan version

forget-node: NODE is gone for good (deleted from the cluster); show what it
left of the driver's objects: its PersistentVolumes (node-local, their data
was on it), the claims bound to them, its CSIStorageCapacity objects. With
--yes, delete the claims, delete the volumes and take the provisioner's
finalizer off them (the provisioner that would have deleted them ran on
NODE), and delete the capacities. (Cluster-wide: -n does not narrow it.)

volumes: list the volumes of NODE (default: of every node) as its plugin
records them: source, device, stage, health and consumers, each consumer
checked against the kernel by the plugin. Asked through the API server's
proxy to the plugin's pod (-n: the chart's namespace; default: every
namespace), on its metrics port: the chart's metrics.enabled must be true.
-o json and -o yaml: a list of the volumes, each with its node.

flags (before or after the command and the node):
  --kubeconfig FILE      kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)
  --context NAME         the kubeconfig context to use (default: its current context)
  -n, --namespace NS     volumes: the namespace of mountplan's pods (default: every namespace)
  --timeout DURATION     how long the whole command may take (default 1m)
  --driver-name NAME     forget-node: the CSI driver's name, the chart's driverName (--driver NAME: deprecated)
                         (default mountplan.csi.io)
  --yes                  forget-node: delete what the node left (without it, only show it)
  -o, --output FORMAT    volumes: table (default), json or yaml
  -l, --selector LABELS  volumes: the labels of the plugin's pods, the chart's node
                         DaemonSet (default ` + defaultSelector + `)
  --version              print the version, git revision, build date and Go version
  -h, --help             print this help
`

// Flags of one command only; given to another they are a mistake.
var commandFlags = map[string][]string{
	"forget-node": {"driver-name", "driver", "yes"},
	"volumes":     {"o", "output", "l", "selector"},
}

// errUsage marks a wrong command line: the error says what is wrong, and
// --help says the rest.
var errUsage = errors.New("see kubectl mountplan --help")

// connectFunc makes the client from kubectl's flags (a fake in tests).
type connectFunc func(clientcmd.ClientConfig) (kubernetes.Interface, error)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr, connect)
	stop()
	os.Exit(exitCode(err, os.Stderr))
}

// exitCode says err on w and returns the exit status: 0 for none and for
// --help, 1 for anything else, as kubectl does.
func exitCode(err error, w io.Writer) int {
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return 0
	}
	fmt.Fprintln(w, "kubectl mountplan:", err)
	return 1
}

func connect(cc clientcmd.ClientConfig) (kubernetes.Interface, error) {
	cfg, err := cc.ClientConfig()
	if err != nil {
		return nil, err
	}
	cfg.UserAgent = "kubectl-mountplan/" + version.Get().Version
	return kubernetes.NewForConfig(cfg)
}

// options are every flag of every command, parsed from one line.
type options struct {
	kubeconfig, context, namespace string
	timeout                        time.Duration
	driver                         string
	yes                            bool
	output, selector               string
	showVersion                    bool
	warnings                       []string // deprecated flags given, said on stderr
}

func newFlagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet("kubectl mountplan", flag.ContinueOnError)
	// Usage and errors are written by run: help to stdout, errors once.
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)")
	fs.StringVar(&o.context, "context", "", "the kubeconfig context to use (default: its current context)")
	fs.StringVar(&o.namespace, "namespace", "", "volumes: the namespace of mountplan's pods (default: every namespace)")
	fs.StringVar(&o.namespace, "n", "", "short for --namespace")
	fs.DurationVar(&o.timeout, "timeout", time.Minute, "how long the whole command may take")
	fs.BoolVar(&o.showVersion, "version", false, "print the version, git revision, build date and Go version")
	fs.StringVar(&o.driver, "driver-name", "mountplan.csi.io", "forget-node: CSI driver name (the chart's driverName)")
	// --driver-name, as the plugin, the resizer and the sidecar call it.
	flagalias.Deprecated(fs, "driver", "driver-name", func(m string) { o.warnings = append(o.warnings, m) })
	fs.BoolVar(&o.yes, "yes", false, "forget-node: delete what the node left (without it, only show it)")
	fs.StringVar(&o.output, "output", "table", "volumes: output format, one of "+strings.Join(outputs, ", "))
	fs.StringVar(&o.output, "o", "table", "short for --output")
	fs.StringVar(&o.selector, "selector", defaultSelector, "volumes: the labels of the plugin's pods (the chart's node DaemonSet)")
	fs.StringVar(&o.selector, "l", defaultSelector, "short for --selector")
	return fs
}

func run(ctx context.Context, args []string, out, errOut io.Writer, connect connectFunc) error {
	var o options
	fs := newFlagSet(&o)
	words, err := parseInterspersed(fs, args)
	help := errors.Is(err, flag.ErrHelp) || (len(words) > 0 && words[0] == "help")
	if help {
		fmt.Fprint(out, usage)
		return flag.ErrHelp
	}
	if err != nil {
		return fmt.Errorf("%w (%w)", err, errUsage)
	}
	for _, w := range o.warnings {
		fmt.Fprintln(errOut, "warning:", w)
	}
	if o.showVersion || (len(words) > 0 && words[0] == "version") {
		version.Get().Print(out, "kubectl-mountplan")
		return nil
	}
	if len(words) == 0 {
		return fmt.Errorf("a command is needed: forget-node or volumes (%w)", errUsage)
	}
	cmd, words := words[0], words[1:]
	allowed, ok := commandFlags[cmd]
	if !ok {
		return fmt.Errorf("unknown command %q: the commands are forget-node and volumes (%w)", cmd, errUsage)
	}
	var misplaced error
	fs.Visit(func(f *flag.Flag) {
		for other, names := range commandFlags {
			if other != cmd && slices.Contains(names, f.Name) && !slices.Contains(allowed, f.Name) {
				misplaced = fmt.Errorf("%s: -%s is a flag of %s (%w)", cmd, f.Name, other, errUsage)
			}
		}
	})
	if misplaced != nil {
		return misplaced
	}
	// Everything kubectl's own flags say: kubeconfig file, context,
	// namespace, with the same defaults ($KUBECONFIG, ~/.kube/config).
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = o.kubeconfig
	overrides := &clientcmd.ConfigOverrides{CurrentContext: o.context}
	overrides.Context.Namespace = o.namespace
	cc := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, overrides)
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	switch cmd {
	case "forget-node":
		if len(words) != 1 || words[0] == "" {
			return fmt.Errorf("forget-node: one node's name is needed, got %q (%w)", words, errUsage)
		}
		return forgetNode(ctx, cc, connect, o, words[0], out)
	default: // volumes
		if len(words) > 1 {
			return fmt.Errorf("volumes: at most one node's name, got %q (%w)", words, errUsage)
		}
		if !slices.Contains(outputs, o.output) {
			return fmt.Errorf("volumes: -o %q: the output formats are %s (%w)", o.output, strings.Join(outputs, ", "), errUsage)
		}
		node := ""
		if len(words) == 1 {
			node = words[0]
		}
		return listVolumes(ctx, cc, connect, o, node, out, errOut)
	}
}

// parseInterspersed parses flags anywhere among the words, as kubectl
// does (the standard flag package stops at the first word that is not a
// flag), and returns the words in order. After "--" everything is a word.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var words []string
	for {
		if err := fs.Parse(args); err != nil {
			return words, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return words, nil
		}
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			return append(words, rest...), nil
		}
		words, args = append(words, rest[0]), rest[1:]
	}
}

func forgetNode(ctx context.Context, cc clientcmd.ClientConfig, connect connectFunc, o options, node string, out io.Writer) error {
	cs, err := connect(cc)
	if err != nil {
		return err
	}
	p, err := forgetnode.Make(ctx, cs, o.driver, node)
	if err != nil {
		return err
	}
	p.Print(out)
	if p.Empty() {
		return nil
	}
	if !o.yes {
		fmt.Fprintf(out, "run again with --yes to delete them: the data of these volumes was on %s and is lost with it\n", node)
		return nil
	}
	return p.Apply(ctx, cs, out)
}
