// Package nbd is the NBD volume source: stage connects a free /dev/nbdN to
// an export of an NBD server the admin allows, formats it on demand and
// records the device; the plan mounts the device.
//
// The connection itself is made by nbd-client from Debian's packages, in
// its netlink mode: it performs the handshake (fixed newstyle, NBD_OPT_GO,
// TLS through GnuTLS when asked), hands the socket to the kernel and exits,
// so no process of ours holds the device and a plugin restart changes
// nothing. Writing our own netlink client would save one binary but means
// re-implementing TLS for the kernel's socket (nbd-client keeps a TLS proxy
// process for that) and tracking the kernel's netlink ABI ourselves.
//
// The package does speak the handshake itself, for what needs no kernel:
// Probe (NBD_OPT_INFO: does the export exist, its size, read-only?) before
// every connect and for health checks, and List. So a wrong export is a
// clear NotFound before any device is touched, on any node.
//
// Identity: the kernel records in /sys/block/nbdN/pid the PID of the
// process that connected the device (nbd-client). Stage records it; unstage
// and health only trust a device whose pid file still holds it, since a
// disconnected device is soon reused by another connection.
package nbd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/config"
	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/journal"
	"github.com/mountplan/mountplan/pkg/metrics"
	"github.com/mountplan/mountplan/pkg/mounter"
	"github.com/mountplan/mountplan/pkg/plan"
	"github.com/mountplan/mountplan/pkg/source"
	"github.com/mountplan/mountplan/pkg/source/internal/blockdev"
	"github.com/mountplan/mountplan/pkg/toolrun"
)

// Type is the volume_context type of this source.
const Type = "nbd"

// Volume context keys.
const (
	CtxAddress = "address"
	CtxExport  = "export"
	CtxFsType  = "fsType"
	CtxTLS     = "tls"
)

// State is what the journal keeps of a staged NBD volume.
type State struct {
	Device string `json:"device"`
	// PID is /sys/block/nbdN/pid right after the connect; 0 while the
	// connect is only intended (a crash then leaves Pending set).
	PID     int    `json:"pid,omitempty"`
	Pending bool   `json:"pending,omitempty"`
	Server  string `json:"server"`
	Export  string `json:"export"`
	Size    int64  `json:"size,omitempty"`
	TLS     bool   `json:"tls,omitempty"`
	// ReadOnly: connected read-only (-R).
	ReadOnly bool `json:"readOnly,omitempty"`
	// FsType is the filesystem found or made ("" for block access).
	FsType string `json:"fsType,omitempty"`
}

// Source connects NBD exports.
type Source struct {
	Config  config.NBDConfig
	Metrics *metrics.Metrics
	// SysDir and DevDir are /sys and /dev (tests may point elsewhere).
	SysDir, DevDir string
	// Devices is the mounter: it hands sockets to the kernel, formats.
	Devices Devices

	rules    []config.EndpointRule
	rulesErr error      // a config that bypassed config.Load: every volume is refused
	mu       sync.Mutex // guards claimed only
	claimed  map[string]bool
	runner   toolrun.Runner // nbd-client; its zero value runs the real one
}

var (
	_ source.Source        = (*Source)(nil)
	_ source.HealthChecker = (*Source)(nil)
)

// Devices is what the source asks of the mounter.
type Devices interface {
	mounter.Filesystems
	mounter.NBD
}

// New returns an NBD source with the admin's policy (checked by
// config.Load) and the mounter devs, timing its steps in m (nil: not
// recorded).
func New(cfg config.NBDConfig, devs Devices, m *metrics.Metrics) *Source {
	rules, err := cfg.ServerRules()
	return &Source{Config: cfg, Devices: devs, Metrics: m, SysDir: "/sys", DevDir: "/dev",
		rules: rules, rulesErr: err, claimed: map[string]bool{}}
}

func (s *Source) timeout() time.Duration {
	if s.Config.TimeoutSeconds > 0 {
		return time.Duration(s.Config.TimeoutSeconds) * time.Second
	}
	return 30 * time.Second
}

// NewVolume checks a static NBD volume's context: an address the admin
// allows (host:port, or a unix socket under a socket root), an export name,
// an optional fsType and tls.
func (s *Source) NewVolume(id string, vctx map[string]string) (source.Volume, error) {
	for k := range vctx {
		switch {
		case k == "type", k == CtxAddress, k == CtxExport, k == CtxFsType, k == CtxTLS, strings.HasPrefix(k, source.ReservedPrefix):
		default:
			return source.Volume{}, fmt.Errorf("unknown nbd volume attribute %q: %w", k, errdefs.ErrInvalidArgument)
		}
	}
	if s.rulesErr != nil {
		return source.Volume{}, s.rulesErr
	}
	addr := vctx[CtxAddress]
	if addr == "" {
		return source.Volume{}, fmt.Errorf("nbd volume %s: attribute %q is required: %w", id, CtxAddress, errdefs.ErrInvalidArgument)
	}
	server, err := s.checkAddress(addr)
	if err != nil {
		return source.Volume{}, err
	}
	wantTLS, err := s.wantTLS(vctx[CtxTLS])
	if err != nil {
		return source.Volume{}, err
	}
	if wantTLS && strings.HasPrefix(server, "/") {
		return source.Volume{}, fmt.Errorf("nbd volume %s: TLS over a unix socket is not supported: %w", id, errdefs.ErrInvalidArgument)
	}
	export := vctx[CtxExport]
	if len(export) > 4096 || strings.ContainsRune(export, 0) {
		return source.Volume{}, fmt.Errorf("nbd volume %s: export name is not a valid NBD name: %w", id, errdefs.ErrInvalidArgument)
	}
	params := map[string]string{CtxAddress: server, CtxExport: export}
	if wantTLS {
		params[CtxTLS] = "true"
	}
	return source.Volume{ID: id, Kind: journal.KindStatic, FsType: vctx[CtxFsType], Parameters: params}, nil
}

// checkAddress returns the canonical form of addr if the admin allows it.
func (s *Source) checkAddress(addr string) (string, error) {
	if strings.HasPrefix(addr, "/") {
		return s.checkSocket(addr)
	}
	ep, err := config.ParseEndpoint(addr, config.NBDDefaultPort)
	if err != nil {
		return "", err
	}
	if err := config.AllowEndpoint(s.rules, ep, "nbd.allowedServers"); err != nil {
		return "", err
	}
	return ep.String(), nil
}

// checkSocket accepts a unix socket path under a socket root, symlinks
// resolved (the resolved path is what nbd-client gets).
func (s *Source) checkSocket(p string) (string, error) {
	if filepath.Clean(p) != p {
		return "", fmt.Errorf("socket path %q is not clean: %w", p, errdefs.ErrInvalidArgument)
	}
	resolved, err := filepath.EvalSymlinks(p)
	if err != nil {
		resolved = p // checked below as given; connect will fail if absent
	}
	for _, root := range s.Config.SocketRoots {
		r, err := filepath.EvalSymlinks(root)
		if err != nil {
			r = root
		}
		if strings.HasPrefix(resolved, r+"/") {
			if len(resolved) > 107 {
				return "", fmt.Errorf("socket path %q is too long for a unix socket: %w", resolved, errdefs.ErrInvalidArgument)
			}
			return resolved, nil
		}
	}
	return "", fmt.Errorf("socket %s is not under the admin config's nbd.socketRoots %v: %w", p, s.Config.SocketRoots, errdefs.ErrInvalidArgument)
}

func (s *Source) wantTLS(attr string) (bool, error) {
	var want bool
	switch attr {
	case "", "false":
	case "true":
		want = true
	default:
		return false, fmt.Errorf("nbd attribute tls must be true or false, not %q: %w", attr, errdefs.ErrInvalidArgument)
	}
	if s.Config.TLS == nil && want {
		return false, fmt.Errorf("nbd volume asks for TLS but the admin config has no nbd.tls: %w", errdefs.ErrInvalidArgument)
	}
	if s.Config.TLS != nil && s.Config.TLS.Required {
		if attr == "false" {
			return false, fmt.Errorf("the admin config requires TLS for nbd volumes: %w", errdefs.ErrInvalidArgument)
		}
		want = true
	}
	return want, nil
}

// target is where a volume's server is.
type target struct {
	server, export string
	tls            bool
}

func targetOf(v source.Volume) target {
	return target{server: v.Parameters[CtxAddress], export: v.Parameters[CtxExport], tls: v.Parameters[CtxTLS] == "true"}
}

func (t target) String() string { return fmt.Sprintf("export %q on %s", t.export, t.server) }

// dialer returns the probe's dialer for t.
func (s *Source) dialer(t target, timeout time.Duration) (Dialer, error) {
	d := Dialer{Network: "tcp", Address: t.server, Timeout: timeout}
	if strings.HasPrefix(t.server, "/") {
		d.Network = "unix"
	}
	if t.tls {
		cfg, err := s.tlsConfig(t.server)
		if err != nil {
			return d, err
		}
		d.TLS = cfg
	}
	return d, nil
}

func (s *Source) tlsConfig(server string) (*tls.Config, error) {
	c := s.Config.TLS
	if c == nil {
		return nil, fmt.Errorf("TLS asked for but the admin config has no nbd.tls: %w", errdefs.ErrFailedPrecondition)
	}
	pem, err := os.ReadFile(c.CAFile)
	if err != nil {
		return nil, fmt.Errorf("nbd.tls.caFile: %w: %w", err, errdefs.ErrFailedPrecondition)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("nbd.tls.caFile %s holds no PEM certificate: %w", c.CAFile, errdefs.ErrFailedPrecondition)
	}
	host, _, err := splitHostPort(server)
	if err != nil {
		return nil, err
	}
	cfg := &tls.Config{RootCAs: pool, ServerName: host, MinVersion: tls.VersionTLS12}
	if c.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("nbd.tls client certificate: %w: %w", err, errdefs.ErrFailedPrecondition)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// Stage probes the export, connects a free NBD device to it and, for mount
// access, makes sure it holds a filesystem. The device is not mounted.
func (s *Source) Stage(ctx context.Context, v source.Volume, req source.StageRequest) (_ json.RawMessage, err error) {
	t := targetOf(v)
	exp, err := s.probe(ctx, t, s.timeout())
	if err != nil {
		return nil, err
	}
	if exp.ReadOnly && !req.ReadOnly {
		return nil, fmt.Errorf("%s is read-only; stage it with a read-only access mode: %w", t, errdefs.ErrFailedPrecondition)
	}
	st, err := s.connect(ctx, t, exp, req.ReadOnly, req.Record)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			// Not the request's context: if it expired, that is why the
			// stage failed, and the rollback must still run.
			if derr := s.disconnect(context.WithoutCancel(ctx), st); derr != nil {
				klog.FromContext(ctx).Error(derr, "Rollback: disconnect failed", "device", st.Device)
			}
		}
	}()
	if !req.Block {
		dev, err := blockdev.DeviceOf(s.SysDir, st.Device)
		if err != nil {
			return nil, err
		}
		st.FsType, err = blockdev.EnsureFilesystem(ctx, v, dev, req, blockdev.Filesystem{What: t.String(), Tools: s.Devices, Metrics: s.Metrics})
		if err != nil {
			return nil, err
		}
	}
	return json.Marshal(st)
}

func (s *Source) probe(ctx context.Context, t target, timeout time.Duration) (Export, error) {
	d, err := s.dialer(t, timeout)
	if err != nil {
		return Export{}, err
	}
	return d.Probe(ctx, t.export)
}

// connect claims a free device, records it as an intent, runs nbd-client
// and records the kernel's pid of the connection.
func (s *Source) connect(ctx context.Context, t target, exp Export, readOnly bool, rec source.Recorder) (State, error) {
	if err := s.kernelReady(); err != nil {
		return State{}, err
	}
	var lastErr error
	for range 3 { // a device taken by someone else between scan and connect: take the next
		dev, release, err := s.claimFree()
		if err != nil {
			return State{}, err
		}
		st := State{Device: dev, Pending: true, Server: t.server, Export: t.export, Size: exp.Size, TLS: t.tls, ReadOnly: readOnly}
		if err := source.SaveState(rec, st); err != nil {
			release()
			return State{}, err
		}
		err = s.Metrics.Step("nbd_connect", func() error { return s.runConnect(ctx, t, dev, exp, readOnly) })
		if err == nil {
			st.PID, err = s.devicePID(dev)
			if err == nil && st.PID == 0 {
				err = fmt.Errorf("nbd-client reported success but %s is not connected: %w", dev, errdefs.ErrUnavailable)
			}
		}
		release()
		if err == nil {
			st.Pending = false
			return st, source.SaveState(rec, st)
		}
		lastErr = err
		if pid, _ := s.devicePID(dev); pid == 0 || errors.Is(err, errdefs.ErrFailedPrecondition) {
			break // not a race for the device: the error is the answer
		}
	}
	return State{}, lastErr
}

// Plan mounts the device (mount access) or binds its node (block access).
func (s *Source) Plan(v source.Volume, req source.PlanRequest) ([]plan.Mount, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	if st.Pending {
		return nil, fmt.Errorf("volume %s is not staged: %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	return blockdev.Plan(v.ID, st.Device, st.FsType, st.ReadOnly, req)
}

// Unstage disconnects the device if it is still the connection stage made.
// A server that is gone does not matter: the disconnect is local.
func (s *Source) Unstage(ctx context.Context, v source.Volume) error {
	if len(v.State) == 0 {
		return nil // a crash before the intent: nothing was connected
	}
	st, err := source.DecodeState[State](v)
	if err != nil {
		return err
	}
	return s.disconnect(ctx, st)
}

// Adopt checks that a staged volume's device is still connected, and
// connects it again when it is not (a node reboot).
func (s *Source) Adopt(ctx context.Context, v source.Volume) (json.RawMessage, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	if ours, _ := s.owns(st); ours {
		return v.State, nil
	}
	klog.FromContext(ctx).Info("NBD device no longer connected; connecting again", "volume", v.ID, "device", st.Device, "server", st.Server)
	t := targetOf(v)
	exp, err := s.probe(ctx, t, s.timeout())
	if err != nil {
		return nil, err
	}
	fresh, err := s.connect(ctx, t, exp, st.ReadOnly, nil)
	if err != nil {
		return nil, err
	}
	fresh.FsType = st.FsType
	return json.Marshal(fresh)
}

// Health reports a device that was disconnected behind the plugin's back,
// and a server that no longer answers.
func (s *Source) Health(ctx context.Context, v source.Volume) source.Health {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Health{Abnormal: true, Reason: "NotStaged", Message: err.Error()}
	}
	if ours, err := s.owns(st); !ours {
		msg := fmt.Sprintf("%s is no longer connected to %s", st.Device, targetOf(v))
		if err != nil {
			msg += ": " + err.Error()
		}
		return source.Health{Abnormal: true, Reason: "DeviceDisconnected", Message: msg}
	}
	timeout := min(s.timeout(), 5*time.Second)
	if _, err := s.probe(ctx, targetOf(v), timeout); err != nil {
		return source.Health{Abnormal: true, Reason: "ServerUnreachable", Message: err.Error()}
	}
	return source.Health{}
}

func splitHostPort(server string) (string, int, error) {
	host, p, err := net.SplitHostPort(server)
	if err != nil {
		return "", 0, fmt.Errorf("server %q: %v: %w", server, err, errdefs.ErrInvalidArgument)
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		return "", 0, fmt.Errorf("server %q: bad port: %w", server, errdefs.ErrInvalidArgument)
	}
	return host, port, nil
}
