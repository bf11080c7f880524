// Package iscsi is the iSCSI volume source: stage discovers the target
// (SendTargets, in Go), has the mounter log in to it (mounter.ISCSI: the
// mounter runs iscsiadm, writes the node record and keeps the session's
// record), waits for the LUN's SCSI disk in sysfs, formats it on demand
// and records the session; the plan mounts the disk. The plugin runs no
// iscsiadm and writes nothing under /etc/iscsi; it only reads sysfs.
//
// CHAP credentials come from the node-stage secret and never reach a
// command line, an environment, a log line or an error: the plugin hands
// them to the mounter in a typed call, which writes them into the
// target's node record (a 0600 file, replaced atomically) for iscsiadm
// --login to pass to iscsid.
//
// Several volumes may be LUNs of one target and share its session. The
// driver keeps a record per session for this source (Host.WithShared):
// the volumes using it, and the session the mounter logged in for them;
// unstage asks the mounter to log out a session no volume uses any more.
// Whether a volume may join a session is the mounter's decision: only a
// session it made, and only with the credentials it was made with.
package iscsi

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
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
	"github.com/mountplan/mountplan/internal/source"
	"github.com/mountplan/mountplan/internal/source/internal/blockdev"
	"github.com/mountplan/mountplan/pkg/plan"
)

// Type is the volume_context type of this source.
const Type = "iscsi"

// Volume context keys.
const (
	CtxPortals = "portals"
	CtxIQN     = "iqn"
	CtxLUN     = "lun"
	CtxFsType  = "fsType"
)

// Node-stage secret keys, as open-iscsi names the record fields.
const (
	SecretUsername   = "node.session.auth.username"
	SecretPassword   = "node.session.auth.password"
	SecretUsernameIn = "node.session.auth.username_in"
	SecretPasswordIn = "node.session.auth.password_in"
)

// State is what the journal keeps of a staged iSCSI volume.
type State struct {
	Target string `json:"target"`
	Portal string `json:"portal"`
	TPGT   int    `json:"tpgt"`
	LUN    int    `json:"lun"`
	// Session names the session's directory under the state dir.
	Session string `json:"session"`
	SID     int    `json:"sid"`
	// Device is /dev/sdX; DevNum its major:minor, HCTL its SCSI address.
	Device string `json:"device"`
	DevNum string `json:"devNum"`
	HCTL   string `json:"hctl"`
	FsType string `json:"fsType,omitempty"`
}

// Source logs in to iSCSI targets.
type Source struct {
	Config  config.ISCSIConfig
	Metrics *metrics.Metrics
	// SysDir and DevDir are /sys and /dev.
	SysDir, DevDir string
	// Devices is the mounter: it logs in and out, formats.
	Devices Devices

	rules    []config.EndpointRule
	rulesErr error // a config that bypassed config.Load: every volume is refused

	mu   sync.Mutex
	host source.Host // keeps the session records and their locks
}

var (
	_ source.Source        = (*Source)(nil)
	_ source.HealthChecker = (*Source)(nil)
	_ source.HostUser      = (*Source)(nil)
	_ source.Forgetter     = (*Source)(nil)
)

// SetHost receives the driver, which keeps the session records.
func (s *Source) SetHost(h source.Host) {
	s.mu.Lock()
	s.host = h
	s.mu.Unlock()
}

func (s *Source) getHost() source.Host {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.host
}

// Devices is what the source asks of the mounter.
type Devices interface {
	mounter.Filesystems
	mounter.ISCSI
}

// New returns an iSCSI source with the admin's policy (checked by
// config.Load), logging in through devs (the mounter) and timing its steps
// in m (nil: not recorded).
func New(cfg config.ISCSIConfig, devs Devices, m *metrics.Metrics) *Source {
	rules, err := cfg.PortalRules()
	if cfg.InitiatorNameFile == "" {
		cfg.InitiatorNameFile = "/etc/iscsi/initiatorname.iscsi"
	}
	return &Source{Config: cfg, Devices: devs, Metrics: m, SysDir: "/sys", DevDir: "/dev",
		rules: rules, rulesErr: err}
}

func (s *Source) timeout() time.Duration {
	if s.Config.DeviceTimeoutSeconds > 0 {
		return time.Duration(s.Config.DeviceTimeoutSeconds) * time.Second
	}
	return 30 * time.Second
}

// iqnPattern accepts iqn., eui. and naa. names (RFC 3720 3.2.6.3) in
// iSCSI's character set.
var iqnPattern = regexp.MustCompile(`^(iqn\.\d{4}-\d{2}\.[a-z0-9.\-]+(:[a-z0-9.\-:]+)?|eui\.[0-9A-Fa-f]{16}|naa\.[0-9A-Fa-f]{16,32})$`)

// NewVolume checks a static iSCSI volume's context: portals the admin
// allows, a target name, a LUN and an optional fsType.
func (s *Source) NewVolume(id string, vctx map[string]string) (source.Volume, error) {
	if s.rulesErr != nil {
		return source.Volume{}, s.rulesErr
	}
	for k := range vctx {
		switch {
		case k == "type", k == CtxPortals, k == CtxIQN, k == CtxLUN, k == CtxFsType, strings.HasPrefix(k, source.ReservedPrefix):
		default:
			return source.Volume{}, fmt.Errorf("unknown iscsi volume attribute %q: %w", k, errdefs.ErrInvalidArgument)
		}
	}
	iqn := vctx[CtxIQN]
	if len(iqn) > 223 || !iqnPattern.MatchString(iqn) {
		return source.Volume{}, fmt.Errorf("iscsi volume %s: %q is not a valid target name (iqn., eui. or naa.): %w", id, iqn, errdefs.ErrInvalidArgument)
	}
	lun, err := strconv.Atoi(vctx[CtxLUN])
	if err != nil || lun < 0 || lun > 16383 {
		return source.Volume{}, fmt.Errorf("iscsi volume %s: lun %q must be a number from 0 to 16383: %w", id, vctx[CtxLUN], errdefs.ErrInvalidArgument)
	}
	var portals []string
	for _, p := range strings.Split(vctx[CtxPortals], ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		ep, err := config.ParseEndpoint(p, config.ISCSIDefaultPort)
		if err != nil {
			return source.Volume{}, err
		}
		if err := config.AllowEndpoint(s.rules, ep, "iscsi.allowedPortals"); err != nil {
			return source.Volume{}, err
		}
		portals = append(portals, ep.String())
	}
	if len(portals) == 0 {
		return source.Volume{}, fmt.Errorf("iscsi volume %s: attribute %q names no portal: %w", id, CtxPortals, errdefs.ErrInvalidArgument)
	}
	params := map[string]string{CtxPortals: strings.Join(portals, ","), CtxIQN: iqn, CtxLUN: strconv.Itoa(lun)}
	return source.Volume{ID: id, Kind: model.KindStatic, FsType: vctx[CtxFsType], Parameters: params}, nil
}

// credentials are the CHAP secrets of a stage. Their String hides them.
type credentials struct {
	user, password, userIn, passwordIn string
}

func (c credentials) String() string { return "credentials{redacted}" }

// chap is what the mounter is given (empty fields: no authentication).
func (c credentials) chap() mounter.CHAP {
	return mounter.CHAP{User: c.user, Password: c.password, UserIn: c.userIn, PasswordIn: c.passwordIn}
}

func credentialsFrom(secrets map[string]string) (credentials, error) {
	c := credentials{user: secrets[SecretUsername], password: secrets[SecretPassword],
		userIn: secrets[SecretUsernameIn], passwordIn: secrets[SecretPasswordIn]}
	for k := range secrets {
		switch k {
		case SecretUsername, SecretPassword, SecretUsernameIn, SecretPasswordIn:
		default:
			return c, fmt.Errorf("unknown iscsi secret key %q (want %s, %s and optionally %s, %s): %w",
				k, SecretUsername, SecretPassword, SecretUsernameIn, SecretPasswordIn, errdefs.ErrInvalidArgument)
		}
	}
	if (c.user == "") != (c.password == "") || (c.userIn == "") != (c.passwordIn == "") {
		return c, fmt.Errorf("iscsi CHAP needs both a user name and a password: %w", errdefs.ErrInvalidArgument)
	}
	if c.userIn != "" && c.user == "" {
		return c, fmt.Errorf("iscsi mutual CHAP (%s) needs one-way CHAP too: %w", SecretUsernameIn, errdefs.ErrInvalidArgument)
	}
	for _, v := range []string{c.user, c.password, c.userIn, c.passwordIn} {
		if len(v) > 255 || strings.ContainsAny(v, "\n\r\x00") {
			return c, fmt.Errorf("an iscsi CHAP secret is longer than 255 bytes or holds a line break: %w", errdefs.ErrInvalidArgument)
		}
	}
	return c, nil
}

// target is what a volume logs in to.
type target struct {
	portals []string
	iqn     string
	lun     int
}

func targetOf(v source.Volume) target {
	lun, _ := strconv.Atoi(v.Parameters[CtxLUN])
	return target{portals: strings.Split(v.Parameters[CtxPortals], ","), iqn: v.Parameters[CtxIQN], lun: lun}
}

// Stage discovers the target, has the mounter log in (or let the volume
// join the session it made with the same credentials), waits for the LUN's disk and, for mount access, makes sure
// it holds a filesystem. The disk is not mounted.
func (s *Source) Stage(ctx context.Context, v source.Volume, req source.StageRequest) (_ json.RawMessage, err error) {
	creds, err := credentialsFrom(req.Secrets)
	if err != nil {
		return nil, err
	}
	t := targetOf(v)
	// The device timeout bounds discovery, login and the wait for the
	// disk; mkfs of a large LUN gets the request's whole deadline.
	devCtx, cancel := context.WithTimeout(ctx, s.timeout())
	defer cancel()
	portal, err := s.discover(devCtx, t)
	if err != nil {
		return nil, err
	}
	if err := s.kernelReady(); err != nil {
		return nil, err
	}
	st, err := s.join(devCtx, v.ID, t, portal, &creds)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			if rerr := s.release(context.WithoutCancel(ctx), v.ID); rerr != nil {
				klog.FromContext(ctx).Error(rerr, "Rollback: leaving the iSCSI session failed", "target", t.iqn)
			}
		}
	}()
	if err := s.waitDisk(devCtx, &st); err != nil {
		return nil, err
	}
	if !req.Block {
		what := fmt.Sprintf("LUN %d of %s", t.lun, t.iqn)
		dev, err := blockdev.DeviceOf(s.SysDir, st.Device)
		if err != nil {
			return nil, err
		}
		if st.FsType, err = blockdev.EnsureFilesystem(ctx, v, dev, req, blockdev.Filesystem{What: what, Tools: s.Devices, Metrics: s.Metrics}); err != nil {
			return nil, err
		}
	}
	return json.Marshal(st)
}

// discover asks the volume's portals, in order, for the target and returns
// the portal to log in to.
func (s *Source) discover(ctx context.Context, t target) (Portal, error) {
	initiator := s.initiatorName()
	var errs []string
	notFound := false
	for _, p := range t.portals {
		targets, err := Discoverer{Portal: p, InitiatorName: initiator, Timeout: min(s.timeout(), 10*time.Second)}.SendTargets(ctx)
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		for _, tg := range targets {
			if tg.Name != t.iqn {
				continue
			}
			for _, tp := range tg.Portals {
				if tp.Address == p {
					return tp, nil
				}
			}
			return Portal{Address: p, TPGT: tg.Portals[0].TPGT}, nil
		}
		notFound = true
		errs = append(errs, fmt.Sprintf("portal %s does not offer %s", p, t.iqn))
	}
	if notFound {
		return Portal{}, fmt.Errorf("iSCSI target %s not found: %s: %w", t.iqn, strings.Join(errs, "; "), errdefs.ErrNotFound)
	}
	return Portal{}, fmt.Errorf("no portal of %s answered: %s: %w", t.iqn, strings.Join(errs, "; "), errdefs.ErrUnavailable)
}

// initiatorName reads this node's InitiatorName (where the plugin can read
// it), or makes up a discovery-only one.
func (s *Source) initiatorName() string {
	b, err := os.ReadFile(s.Config.InitiatorNameFile)
	if err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "InitiatorName="); ok && v != "" {
				return v
			}
		}
	}
	return "iqn.2024-01.io.mountplan:discovery"
}

// Plan mounts the disk (mount access) or binds its node (block access).
func (s *Source) Plan(v source.Volume, req source.PlanRequest) ([]plan.Mount, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	return blockdev.Plan(v.ID, st.Device, st.FsType, false, req)
}

// Unstage leaves the volume's session, logging it out when the plugin
// created it and no other volume uses it. It works from the session
// registry, so a stage a crash interrupted is undone too.
func (s *Source) Unstage(ctx context.Context, v source.Volume) error {
	return s.release(ctx, v.ID)
}

// Forget drops the volume from the sessions of an ended boot: the last
// user's leave asks the mounter to end the session, which it logs out
// only when it is one it logged in during this boot (a SID of an ended
// boot may be someone else's session now), and to delete the node record
// it created. A new stage logs in again with the secrets it is given.
func (s *Source) Forget(ctx context.Context, v source.Volume) error {
	return s.release(ctx, v.ID)
}

// Adopt checks that a staged volume's session and disk are still there and
// repairs what a reboot (or a logout behind the plugin's back) took: when
// the recorded session is gone, it has the mounter log in again from the
// node record the stage wrote (the CHAP secrets are in that 0600 file
// only; a missing record is FailedPrecondition), or join the session it
// made again for another volume of the target, and returns the state with
// the new session and disk. A session that shows but is not logged in is
// iscsid's to recover.
func (s *Source) Adopt(ctx context.Context, v source.Volume) (json.RawMessage, error) {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return nil, err
	}
	switch h := s.check(st); h.Reason {
	case "":
		return v.State, nil
	case "SessionFailed":
		return nil, fmt.Errorf("volume %s: %s; iscsid is recovering it: %w", v.ID, h.Message, errdefs.ErrUnavailable)
	default:
		klog.FromContext(ctx).Info("iSCSI volume lost its session or disk; logging in again from the node record",
			"volume", v.ID, "reason", h.Reason, "target", st.Target, "portal", st.Portal, "sid", st.SID)
	}
	if err := s.kernelReady(); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout())
	defer cancel()
	t := target{portals: []string{st.Portal}, iqn: st.Target, lun: st.LUN}
	fresh, err := s.join(ctx, v.ID, t, Portal{Address: st.Portal, TPGT: st.TPGT}, nil)
	if err != nil {
		return nil, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	// A disk that does not show leaves the session: the volume is still
	// staged, and the next Adopt (or unstage) finds the session.
	if err := s.waitDisk(ctx, &fresh); err != nil {
		return nil, fmt.Errorf("volume %s: %w", v.ID, err)
	}
	fresh.FsType = st.FsType
	klog.FromContext(ctx).Info("iSCSI volume reattached", "volume", v.ID, "sid", fresh.SID, "device", fresh.Device)
	return json.Marshal(fresh)
}

// Health reports a session that is gone or failed, or a disk that vanished.
func (s *Source) Health(ctx context.Context, v source.Volume) source.Health {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Health{Abnormal: true, Reason: "NotStaged", Message: err.Error()}
	}
	return s.check(st)
}

// Describe names the target, portal and LUN and, once logged in, the device.
func (s *Source) Describe(v source.Volume) source.Description {
	st, err := source.DecodeState[State](v)
	if err != nil {
		return source.Description{Source: "iscsi"}
	}
	return source.Description{Source: fmt.Sprintf("iscsi %s at %s lun %d", st.Target, st.Portal, st.LUN), Device: st.Device}
}
