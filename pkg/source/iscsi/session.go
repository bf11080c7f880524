package iscsi

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/pkg/errdefs"
	"github.com/mountplan/mountplan/pkg/fsutil"
	"github.com/mountplan/mountplan/pkg/source"
	"github.com/mountplan/mountplan/pkg/toolrun"
)

// kernelReady fails with ErrFailedPrecondition, naming the module, when the
// kernel has no iSCSI TCP transport.
func (s *Source) kernelReady() error {
	if _, err := os.Stat(filepath.Join(s.SysDir, "module", "iscsi_tcp")); err != nil {
		return fmt.Errorf("this node's kernel has no iSCSI TCP transport (%s/module/iscsi_tcp is missing): load the kernel module iscsi_tcp (modprobe iscsi_tcp) on the node: %w",
			s.SysDir, errdefs.ErrFailedPrecondition)
	}
	return nil
}

// owner is the registry's record of a session the plugin logged in.
type owner struct {
	Target string `json:"target"`
	Portal string `json:"portal"`
	TPGT   int    `json:"tpgt"`
	// SID is 0 between the intent and the login's completion.
	SID int `json:"sid"`
	// CreatedRecord: the node record did not exist before; logout deletes it.
	CreatedRecord bool `json:"createdRecord,omitempty"`
}

func sessionKey(iqn, portal string) string {
	sum := sha256.Sum256([]byte(iqn + "\x00" + portal))
	return hex.EncodeToString(sum[:12])
}

// sharedKind names the driver-kept records of sessions (Host.WithShared).
const sharedKind = "iscsi-session"

// session is what the plugin keeps of a session several volumes (LUNs of
// one target) may share: who uses it, and whether the plugin logged it in.
type session struct {
	Users []string `json:"users"`
	Owner *owner   `json:"owner,omitempty"`
}

// sessionTx is a session's record, read and written under its lock.
type sessionTx struct {
	session
	save func([]byte) error
}

// commit writes the record before the side effect it describes; a
// session nobody uses and the plugin does not own is forgotten.
func (tx *sessionTx) commit() error {
	if len(tx.Users) == 0 && tx.Owner == nil {
		return tx.save(nil)
	}
	b, err := json.Marshal(tx.session)
	if err != nil {
		return err
	}
	return tx.save(b)
}

func (tx *sessionTx) uses(id string) bool { return slices.Contains(tx.Users, id) }

// withSession runs fn with the record of the session key locked. The
// driver keeps the record and its lock: logins and logouts of volumes
// sharing a session wait for each other.
func (s *Source) withSession(ctx context.Context, key, op string, fn func(tx *sessionTx) error) error {
	host := s.getHost()
	if host == nil {
		return fmt.Errorf("iscsi: no driver keeps the session records: %w", errdefs.ErrFailedPrecondition)
	}
	return host.WithShared(ctx, sharedKind, key, op, func(data []byte, save func([]byte) error) error {
		tx := &sessionTx{save: save}
		if data != nil {
			if err := json.Unmarshal(data, &tx.session); err != nil {
				return fmt.Errorf("iscsi session record %s: %w", key, err)
			}
		}
		return fn(tx)
	})
}

// join marks volume id as a user of the session to t at p, logging in
// when there is no session yet, and returns the state without the disk.
//
// With c (a stage), a login writes c into the node record first, and a
// failure leaves the session as it was before. With c nil (Adopt of a
// staged volume whose session was lost), a login uses the node record as
// the stage left it, which still holds the CHAP fields, so the secrets
// never pass through the plugin again; a failure keeps the volume among
// the session's users, since the volume is still staged, and the next
// Adopt tries again.
func (s *Source) join(ctx context.Context, id string, t target, p Portal, c *credentials) (State, error) {
	key := sessionKey(t.iqn, p.Address)
	st := State{Target: t.iqn, Portal: p.Address, TPGT: p.TPGT, LUN: t.lun, Session: key}
	err := s.withSession(ctx, key, "login", func(tx *sessionTx) error {
		// Intent first: a crash from here on leaves a user unstage finds.
		if !tx.uses(id) {
			tx.Users = append(tx.Users, id)
			if err := tx.commit(); err != nil {
				return err
			}
		}
		sid, err := s.findSession(t.iqn, p.Address)
		if err == nil && sid == 0 {
			sid, err = s.login(ctx, tx, t.iqn, p, c)
		}
		if err != nil {
			if c != nil {
				if rerr := s.leave(context.WithoutCancel(ctx), tx, id); rerr != nil {
					klog.FromContext(ctx).Error(rerr, "Rollback: leaving the iSCSI session failed", "target", t.iqn)
				}
			}
			return err
		}
		st.SID = sid
		return nil
	})
	return st, err
}

// login logs in to iqn at p and records the new session as the plugin's
// own. With c it first creates the node record if there is none and writes
// c's CHAP fields into it; with c nil it logs in with the record as it is,
// and a missing record is ErrFailedPrecondition: the secrets went with it.
func (s *Source) login(ctx context.Context, tx *sessionTx, iqn string, p Portal, c *credentials) (int, error) {
	own := owner{Target: iqn, Portal: p.Address, TPGT: p.TPGT}
	rec, existed, err := s.recordPath(iqn, p)
	if err != nil {
		return 0, err
	}
	if c == nil && !existed {
		return 0, fmt.Errorf("the iSCSI session to %s at %s is gone and so is its node record %s, which held the CHAP credentials (the plugin keeps them nowhere else): unstage the volume and stage it again: %w",
			iqn, p.Address, filepath.Dir(rec), errdefs.ErrFailedPrecondition)
	}
	// A record the plugin made for an earlier session to the same target
	// stays the plugin's to delete, whoever made the session that ended.
	prev := tx.Owner
	own.CreatedRecord = !existed || (prev != nil && prev.CreatedRecord && prev.Target == iqn && prev.Portal == p.Address)
	tx.Owner = &own
	if err := tx.commit(); err != nil {
		return 0, err
	}
	var redact credentials
	if c != nil {
		redact = *c
		if err := s.writeRecord(ctx, iqn, p, rec, existed, *c); err != nil {
			return 0, err
		}
	}
	err = s.Metrics.Step("iscsi_login", func() error {
		_, err := s.adm(ctx, redact, "-m", "node", "-T", iqn, "-p", p.Address, "--login")
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("login to %s at %s: %w", iqn, p.Address, err)
	}
	sid, err := s.findSession(iqn, p.Address)
	if err == nil && sid == 0 {
		err = fmt.Errorf("iscsiadm logged in to %s but no session shows in sysfs: %w", iqn, errdefs.ErrUnavailable)
	}
	if err != nil {
		return 0, err
	}
	own.SID = sid
	return sid, tx.commit()
}

// writeRecord creates iqn's node record at p unless it exists and writes
// c's CHAP fields into it (the record at rec).
func (s *Source) writeRecord(ctx context.Context, iqn string, p Portal, rec string, existed bool, c credentials) error {
	if !existed {
		if _, err := s.adm(ctx, c, "-m", "node", "-o", "new", "-T", iqn, "-p", fmt.Sprintf("%s,%d", p.Address, p.TPGT)); err != nil {
			return err
		}
		var err error
		if rec, existed, err = s.recordPath(iqn, p); err != nil {
			return err
		} else if !existed {
			return fmt.Errorf("iscsiadm created no node record for %s at %s under %s (check iscsi.nodeDBDir): %w", iqn, p.Address, s.Config.NodeDBDir, errdefs.ErrFailedPrecondition)
		}
	}
	return writeAuth(rec, c)
}

// release removes volume id from every session it uses (normally one).
// It looks at every session record rather than the volume's state, so a
// stage a crash interrupted before it recorded its session is undone too.
func (s *Source) release(ctx context.Context, id string) error {
	host := s.getHost()
	if host == nil {
		return fmt.Errorf("iscsi: no driver keeps the session records: %w", errdefs.ErrFailedPrecondition)
	}
	keys, err := host.SharedKeys(sharedKind)
	if err != nil {
		return err
	}
	var errs []error
	for _, key := range keys {
		errs = append(errs, s.withSession(ctx, key, "logout", func(tx *sessionTx) error {
			if !tx.uses(id) {
				return nil
			}
			return s.leave(ctx, tx, id)
		}))
	}
	return errors.Join(errs...)
}

// leave, when nobody else uses the session and the plugin created it, logs
// it out and forgets it, then drops id from its users. The user goes last:
// if the logout fails, the retry still finds the session as id's to
// release. Called with the session's record locked.
func (s *Source) leave(ctx context.Context, tx *sessionTx, id string) error {
	others := slices.ContainsFunc(tx.Users, func(u string) bool { return u != id })
	if !others && tx.Owner != nil {
		if err := s.logout(ctx, *tx.Owner); err != nil {
			return err
		}
		tx.Owner = nil
	}
	tx.Users = slices.DeleteFunc(tx.Users, func(u string) bool { return u == id })
	return tx.commit()
}

// logout ends the session own describes, if sysfs still shows it for the
// same target and portal, and deletes the node record if the plugin made it.
func (s *Source) logout(ctx context.Context, own owner) error {
	sid, err := s.findSession(own.Target, own.Portal)
	if err != nil {
		return err
	}
	if sid != 0 && (own.SID == 0 || own.SID == sid) {
		err := s.Metrics.Step("iscsi_logout", func() error {
			_, err := s.adm(ctx, credentials{}, "-m", "session", "-r", strconv.Itoa(sid), "--logout")
			return err
		})
		if err != nil {
			return fmt.Errorf("logout of session %d (%s): %w", sid, own.Target, err)
		}
	} else if sid != 0 {
		klog.FromContext(ctx).Info("iSCSI session to the target is not the one the plugin made; leaving it", "target", own.Target, "sid", sid, "recorded", own.SID)
	}
	if own.CreatedRecord {
		_, err := s.adm(ctx, credentials{}, "-m", "node", "-o", "delete", "-T", own.Target, "-p", own.Portal)
		if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("deleting the node record of %s: %w", own.Target, err)
		}
	}
	return nil
}

// recordPath returns the node record file of iqn at p and whether it exists.
func (s *Source) recordPath(iqn string, p Portal) (string, bool, error) {
	host, port, err := net.SplitHostPort(p.Address)
	if err != nil {
		return "", false, fmt.Errorf("portal %q: %v: %w", p.Address, err, errdefs.ErrInvalidArgument)
	}
	dir := filepath.Join(s.Config.NodeDBDir, iqn, fmt.Sprintf("%s,%s,%d", host, port, p.TPGT))
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return filepath.Join(dir, "default"), false, nil
	case err != nil:
		return "", false, err
	case !fi.IsDir():
		return dir, true, nil // the old layout: the record is the file itself
	}
	_, err = os.Stat(filepath.Join(dir, "default"))
	return filepath.Join(dir, "default"), err == nil, nil
}

// authKeys are the record fields writeAuth owns.
var authKeys = []string{"node.session.auth.authmethod", "node.session.auth.username", "node.session.auth.password",
	"node.session.auth.username_in", "node.session.auth.password_in"}

// writeAuth replaces the record's CHAP fields with c's, through a 0600
// temp file renamed over the record: the secret exists only in that file
// (and in iscsid's memory), never in argv.
func writeAuth(rec string, c credentials) error {
	old, err := os.ReadFile(rec)
	if err != nil {
		return fmt.Errorf("reading node record: %w", err)
	}
	var b bytes.Buffer
	sc := bufio.NewScanner(bytes.NewReader(old))
	for sc.Scan() {
		line := sc.Text()
		k, _, _ := strings.Cut(line, "=")
		if isAuthKey(strings.TrimSpace(k)) {
			continue
		}
		b.WriteString(line + "\n")
	}
	if c.user == "" {
		b.WriteString("node.session.auth.authmethod = None\n")
	} else {
		fmt.Fprintf(&b, "node.session.auth.authmethod = CHAP\nnode.session.auth.username = %s\nnode.session.auth.password = %s\n", c.user, c.password)
		if c.userIn != "" {
			fmt.Fprintf(&b, "node.session.auth.username_in = %s\nnode.session.auth.password_in = %s\n", c.userIn, c.passwordIn)
		}
	}
	if err := fsutil.WriteFileAtomic(rec, b.Bytes(), 0o600, true); err != nil {
		return fmt.Errorf("writing node record: %w", err)
	}
	return nil
}

func isAuthKey(k string) bool {
	for _, a := range authKeys {
		if k == a {
			return true
		}
	}
	return false
}

// iscsiadm is open-iscsi's admin tool, from PATH. Its output is kept in
// errors with the CHAP passwords blotted out (passwordField), in case a
// future iscsiadm echoes a record.
var iscsiadm = toolrun.Tool{Name: "iscsiadm", Package: "open-iscsi", SecretField: passwordField}

// adm runs iscsiadm, blotting c's secrets out of its output; a non-zero
// exit wraps the sentinel its status means.
func (s *Source) adm(ctx context.Context, c credentials, args ...string) (string, error) {
	out, err := s.runner.Run(ctx, iscsiadm, args, c.secrets()...)
	if err == nil {
		return out, nil
	}
	if code := toolrun.Status(err); code > 0 {
		return out, fmt.Errorf("iscsiadm %s: %w: %w", args[1], err, exitSentinel(code))
	}
	return out, fmt.Errorf("iscsiadm %s: %w", args[1], err)
}

// exitSentinel maps iscsiadm's exit codes (iscsiadm(8), EXIT STATUS).
func exitSentinel(code int) error {
	switch code {
	case 24: // ISCSI_ERR_LOGIN_AUTH_FAILED
		return errdefs.ErrPermissionDenied
	case 2, 21: // session not found, no objects found
		return errdefs.ErrNotFound
	case 12: // transport module not loaded
		return errdefs.ErrFailedPrecondition
	case 4, 8, 11, 20, 29: // connect problem, timeouts, iscsid unreachable, try again
		return errdefs.ErrUnavailable
	case 15: // session exists
		return errdefs.ErrAlreadyExists
	}
	return errdefs.ErrFailedPrecondition
}

// passwordField is a CHAP password field as a node record (or iscsiadm
// printing one) shows it: its value is hidden also when the plugin does
// not know it (a re-login from the record).
var passwordField = regexp.MustCompile(`(?m)(auth\.password(?:_in)?[ \t]*=[ \t]*)[^\n]*`)

// findSession returns the SID of a session to iqn through portal, or 0.
func (s *Source) findSession(iqn, portal string) (int, error) {
	dirs, err := filepath.Glob(filepath.Join(s.SysDir, "class", "iscsi_session", "session*"))
	if err != nil {
		return 0, err
	}
	for _, d := range dirs {
		sid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), "session"))
		if err != nil || readTrim(filepath.Join(d, "targetname")) != iqn {
			continue
		}
		conn := filepath.Join(s.SysDir, "class", "iscsi_connection", fmt.Sprintf("connection%d:0", sid))
		addr := readTrim(filepath.Join(conn, "persistent_address"))
		port := readTrim(filepath.Join(conn, "persistent_port"))
		if addr == "" {
			addr, port = readTrim(filepath.Join(conn, "address")), readTrim(filepath.Join(conn, "port"))
		}
		if net.JoinHostPort(addr, port) == portal {
			return sid, nil
		}
	}
	return 0, nil
}

func readTrim(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

var hostPattern = regexp.MustCompile(`/host(\d+)/session\d+$`)

// waitDisk scans the session's SCSI host for st.LUN and waits for its disk.
// A LUN the target does not have is ErrNotFound.
func (s *Source) waitDisk(ctx context.Context, st *State) error {
	sess := filepath.Join(s.SysDir, "class", "iscsi_session", fmt.Sprintf("session%d", st.SID))
	link, err := filepath.EvalSymlinks(filepath.Join(sess, "device"))
	if err != nil {
		return fmt.Errorf("session %d has no SCSI host in sysfs: %w: %w", st.SID, err, errdefs.ErrUnavailable)
	}
	m := hostPattern.FindStringSubmatch(link)
	if m == nil {
		return fmt.Errorf("session %d: cannot tell its SCSI host from %s: %w", st.SID, link, errdefs.ErrUnavailable)
	}
	host := m[1]
	pattern := filepath.Join(sess, "device", "target"+host+":*", host+":*:*:"+strconv.Itoa(st.LUN))
	var scsiDev string
	for attempt := 0; scsiDev == "" && attempt < 5; attempt++ {
		if matches, _ := filepath.Glob(pattern); len(matches) > 0 {
			scsiDev = matches[0]
			break
		}
		// A scan of the one LUN; the write returns when the scan is done.
		scan := filepath.Join(s.SysDir, "class", "scsi_host", "host"+host, "scan")
		if err := os.WriteFile(scan, []byte("- - "+strconv.Itoa(st.LUN)), 0); err != nil {
			return fmt.Errorf("scanning SCSI host %s: %w", host, err)
		}
		if err := sleep(ctx, 100*time.Millisecond); err != nil {
			return err
		}
	}
	if scsiDev == "" {
		return fmt.Errorf("LUN %d does not exist on target %s: %w", st.LUN, st.Target, errdefs.ErrNotFound)
	}
	st.HCTL = filepath.Base(scsiDev)
	for {
		if blocks, _ := filepath.Glob(filepath.Join(scsiDev, "block", "*")); len(blocks) > 0 {
			name := filepath.Base(blocks[0])
			st.Device = filepath.Join(s.DevDir, name)
			st.DevNum = readTrim(filepath.Join(blocks[0], "dev"))
			if _, err := os.Stat(st.Device); err == nil && st.DevNum != "" {
				return nil
			}
		}
		if err := sleep(ctx, 50*time.Millisecond); err != nil {
			return fmt.Errorf("waiting for the disk of LUN %d (%s): %w", st.LUN, st.HCTL, err)
		}
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// check tells whether st's session is logged in and its disk is the same.
func (s *Source) check(st State) source.Health {
	sess := filepath.Join(s.SysDir, "class", "iscsi_session", fmt.Sprintf("session%d", st.SID))
	if readTrim(filepath.Join(sess, "targetname")) != st.Target {
		return source.Health{Abnormal: true, Reason: "SessionGone", Message: fmt.Sprintf("iSCSI session %d to %s at %s is gone; the plugin logs in again from the node record when it next reconciles", st.SID, st.Target, st.Portal)}
	}
	if state := readTrim(filepath.Join(sess, "state")); state != "" && state != "LOGGED_IN" {
		return source.Health{Abnormal: true, Reason: "SessionFailed", Message: fmt.Sprintf("iSCSI session %d to %s is %s", st.SID, st.Target, state)}
	}
	if readTrim(filepath.Join(s.SysDir, "class", "block", filepath.Base(st.Device), "dev")) != st.DevNum {
		return source.Health{Abnormal: true, Reason: "DeviceGone", Message: fmt.Sprintf("%s is no longer LUN %d of %s", st.Device, st.LUN, st.Target)}
	}
	return source.Health{}
}

// adoptLegacyRegistry moves what a plugin of an earlier version kept under
// <state-dir>/iscsi/sessions/<key>/ (a file per user volume in users/, and
// owner.json when it logged the session in) into the driver's session
// records, then removes those files.
func (s *Source) adoptLegacyRegistry(ctx context.Context) error {
	dirs, err := filepath.Glob(filepath.Join(s.StateDir, "iscsi", "sessions", "*"))
	if err != nil || len(dirs) == 0 {
		return err
	}
	var errs []error
	for _, dir := range dirs {
		errs = append(errs, s.withSession(ctx, filepath.Base(dir), "adopt-registry", func(tx *sessionTx) error {
			users, err := os.ReadDir(filepath.Join(dir, "users"))
			if err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
			for _, u := range users {
				if !tx.uses(u.Name()) {
					tx.Users = append(tx.Users, u.Name())
				}
			}
			if b, err := os.ReadFile(filepath.Join(dir, "owner.json")); err == nil && tx.Owner == nil {
				own := &owner{}
				if err := json.Unmarshal(b, own); err != nil {
					return fmt.Errorf("%s/owner.json: %w", dir, err)
				}
				tx.Owner = own
			}
			if err := tx.commit(); err != nil {
				return err
			}
			for _, u := range users {
				_ = os.Remove(filepath.Join(dir, "users", u.Name()))
			}
			for _, p := range []string{filepath.Join(dir, "owner.json"), filepath.Join(dir, "users"), dir} {
				if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
					return err
				}
			}
			return nil
		}))
	}
	return errors.Join(errs...)
}
