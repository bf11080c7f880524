// Package nbd is the NBD volume source: stage connects an NBD device to an
// export of an NBD server the admin allows, formats it on demand and
// records the device; the plan mounts the device.
//
// The plugin, with no privilege, does all the network work: it dials the
// server, speaks the whole handshake (Dialer.Negotiate: fixed newstyle,
// STARTTLS, NBD_OPT_GO) and hands the connected socket, in the
// transmission phase, to the mounter as a descriptor (mounter.NBD over
// internal/unixrpc, SCM_RIGHTS); the mounter only gives it to the kernel
// (internal/nbdnl) and records the device. The kernel cannot speak TLS: for a
// TLS volume the kernel's socket is one end of a socketpair, and a proxy
// in this process carries its bytes to the server (per volume, until
// unstage).
//
// Identity: every connect gets a new backend identifier
// (mounter.NewNBDBackend), which the kernel shows in
// /sys/block/nbdN/backend. Stage records it before the connect, so that
// an undo after a crash finds the device by it; unstage, health and adopt
// trust a device only while sysfs shows it, and the mounter acts only on
// a device it recorded with it.
//
// A connection that dies does not end the device: it is connected with a
// dead-connection timeout, during which the kernel holds its I/O, and
// this process reconnects it (a new handshake, then mounter.ReconnectNBD)
// when the kernel reports the link dead (nbdnl.WatchLinkDead) and the
// server answers again. A plugin restart is such a pause for TLS volumes,
// whose proxy died with the process: Adopt negotiates again at once.
//
// The package also speaks the handshake for what needs no kernel: Probe
// (NBD_OPT_INFO: does the export exist, its size, read-only?) before every
// connect and for health checks, and List. So a wrong export is a clear
// NotFound before any device is touched, on any node.
package nbd

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/metrics"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/nbdnl"
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/internal/blockdev"
	"github.com/mountplan/mountplan/pkg/plan"
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

// DefaultDeadConnTimeout is how long the kernel holds a device's I/O once
// its connection died, for this process to connect it again: longer than
// a plugin restart, shorter than anyone waits for a hung write.
const DefaultDeadConnTimeout = 2 * time.Minute

// State is what the journal keeps of a staged NBD volume.
type State struct {
	// Device is /dev/nbdN and Index its N; "" and -1 while the connect
	// is only intended (Pending: a crash then leaves it set).
	Device  string `json:"device,omitempty"`
	Index   int    `json:"index"`
	Pending bool   `json:"pending,omitempty"`
	// Backend is the connection's identifier, chosen before the connect:
	// the kernel shows it in /sys/block/nbdN/backend while the device is
	// connected to this volume's export.
	Backend string `json:"backend"`
	Server  string `json:"server"`
	Export  string `json:"export"`
	Size    int64  `json:"size,omitempty"`
	// BlockSize is the device's logical block size.
	BlockSize uint64 `json:"blockSize,omitempty"`
	TLS       bool   `json:"tls,omitempty"`
	// ReadOnly: connected read-only.
	ReadOnly bool `json:"readOnly,omitempty"`
	// FsType is the filesystem found or made ("" for block access).
	FsType string `json:"fsType,omitempty"`
}

// Source connects NBD exports.
type Source struct {
	Config  config.NBDConfig
	Metrics *metrics.Metrics
	// SysDir is /sys (tests may point elsewhere); the plugin reads it only.
	SysDir string
	// Devices is the mounter: it hands sockets to the kernel, formats.
	Devices Devices
	// DeadConnTimeout: see DefaultDeadConnTimeout (0: that).
	DeadConnTimeout time.Duration

	rules    []config.EndpointRule
	rulesErr error // a config that bypassed config.Load: every volume is refused
	// watchLinks subscribes to the kernel's link-dead notices
	// (nbdnl.WatchLinkDead; tests replace it).
	watchLinks func() (linkWatcher, error)

	mu    sync.Mutex // guards links and the watcher
	links map[string]*link
	watch *watcher
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
	return &Source{Config: cfg, Devices: devs, Metrics: m, SysDir: "/sys", rules: rules, rulesErr: err,
		links: map[string]*link{}, watchLinks: func() (linkWatcher, error) { return nbdnl.WatchLinkDead() }}
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
	return source.Volume{ID: id, Kind: model.KindStatic, FsType: vctx[CtxFsType], Parameters: params}, nil
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
// resolved (the resolved path is what the plugin dials).
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

// Stage probes the export, connects an NBD device to it and, for mount
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
	st, err := s.connect(ctx, v.ID, t, req.ReadOnly, req.Record)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			// Not the request's context: if it expired, that is why the
			// stage failed, and the rollback must still run.
			if derr := s.disconnect(context.WithoutCancel(ctx), v.ID, st); derr != nil {
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

// Plan mounts the device (mount access) or binds its node (block access).
func (s *Source) Plan(v source.Volume, req source.PlanRequest) ([]plan.Mount, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	if st.Pending || st.Device == "" {
		return nil, fmt.Errorf("volume %s is not staged: %w", v.ID, errdefs.ErrFailedPrecondition)
	}
	return blockdev.Plan(v.ID, st.Device, st.FsType, st.ReadOnly, req)
}

// Unstage disconnects the device connected with the volume's backend,
// also one a crash left connected before its index was recorded, and
// stops the volume's proxy and reconnects. A server that is gone does not
// matter: the disconnect is local.
func (s *Source) Unstage(ctx context.Context, v source.Volume) error {
	if len(v.State) == 0 {
		s.dropLink(v.ID)
		return nil // a crash before the intent: nothing was connected
	}
	st, err := source.DecodeState[State](v)
	if err != nil {
		return err
	}
	return s.disconnect(ctx, v.ID, st)
}

// Adopt makes a staged volume's connection live in this process: the
// device still connected with the volume's backend is taken over (a TLS
// volume's proxy died with the last plugin process: it negotiates again
// and hands the mounter the new socket); a device the kernel no longer
// shows (a node reboot) is connected again, and the state says where.
func (s *Source) Adopt(ctx context.Context, v source.Volume) (json.RawMessage, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	t := targetOf(v)
	if !s.shows(st) {
		s.dropLink(v.ID)
		klog.FromContext(ctx).Info("NBD device no longer connected; connecting again", "volume", v.ID, "device", st.Device, "backend", st.Backend, "server", st.Server)
		if _, err := s.probe(ctx, t, s.timeout()); err != nil {
			return nil, err
		}
		fresh, err := s.connect(ctx, v.ID, t, st.ReadOnly, nil)
		if err != nil {
			return nil, err
		}
		fresh.FsType = st.FsType
		return json.Marshal(fresh)
	}
	l := s.linkOf(v.ID)
	if l == nil {
		dev, err := blockdev.DeviceOf(s.SysDir, st.Device)
		if err != nil {
			return nil, err
		}
		// Watching first: a link that dies after this is reconnected on
		// the kernel's notice, one that died before by what follows.
		l = s.addLink(v.ID, t, st, dev)
		if !t.tls {
			// The kernel holds the socket: the connection outlived the last
			// plugin process, unless it died while none ran and its notice
			// went unheard. One new socket, in the background, settles it:
			// the kernel takes it only in a dead connection's place.
			s.kick(l, 1)
			return v.State, nil
		}
	}
	if t.tls && !l.proxyRunning() {
		klog.FromContext(ctx).Info("TLS volume without its proxy in this process; negotiating again", "volume", v.ID, "device", st.Device)
		if err := s.reconnect(ctx, l); err != nil {
			s.kick(l, 0)
			return nil, err
		}
	}
	return v.State, nil
}

// Health reports a device that was disconnected behind the plugin's back,
// a connection that died and is not back yet, and a server that no
// longer answers.
func (s *Source) Health(ctx context.Context, v source.Volume) source.Health {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Health{Abnormal: true, Reason: "NotStaged", Message: err.Error()}
	}
	if !s.shows(st) {
		return source.Health{Abnormal: true, Reason: "DeviceDisconnected",
			Message: fmt.Sprintf("%s is no longer connected to %s (the kernel does not show backend %s)", st.Device, targetOf(v), st.Backend)}
	}
	if lost, why := s.lost(v.ID, st); lost {
		return source.Health{Abnormal: true, Reason: "ConnectionLost", Message: fmt.Sprintf("%s lost its connection to %s; reconnecting: %s", st.Device, targetOf(v), why)}
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

// Describe names the server and export and, once connected, the device.
func (s *Source) Describe(v source.Volume) source.Description {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Description{Source: "nbd"}
	}
	return source.Description{Source: fmt.Sprintf("nbd %s export %q", st.Server, st.Export), Device: st.Device}
}
