package mounter

// iSCSI sessions. The mounter logs in to targets with open-iscsi (iscsiadm
// and iscsid, in the host's network namespace) and keeps a record of each
// session it logged in, under <records-dir>/iscsi: the target, the portal,
// the SID and the boot it was logged in during, whether it created the
// node record, and a salted PBKDF2 hash of the CHAP credentials it wrote
// into that record (never the credentials).
//
// The record decides who may use a session:
//
//   - a session to a target and portal that the mounter did not log in (the
//     admin's, or one whose login it did not see through) is never joined,
//     logged out or mounted from: FailedPrecondition;
//   - the mounter's session is joined only with the credentials it was made
//     with (compared by hash): other credentials, or none, are
//     PermissionDenied. While the record lasts (until LogoutISCSI) the node
//     record is never rewritten with other credentials either, so the
//     volumes that use it can still log in again after a reboot;
//   - a plan may name a SCSI disk only if its sysfs path runs through
//     session<SID> of a recorded session of this boot (ownsISCSI).
//
// CHAP secrets are written into the node record only (mode 0600, replaced
// atomically); iscsiadm --login reads them from there and hands them to
// iscsid over its socket. They are never on a command line, in an
// environment, a log line or an error (tool output is redacted).

import (
	"bufio"
	"bytes"
	"context"
	"crypto/pbkdf2"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/config"
	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/fsutil"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/toolrun"
)

// iscsiRecord is a session the mounter logged in, and the node record it
// wrote the credentials into.
type iscsiRecord struct {
	Target string `json:"target"`
	Portal string `json:"portal"`
	TPGT   int    `json:"tpgt"`
	// SID is the session logged in during Boot; 0 while a login is in
	// flight, after one failed, and once a reboot ended the session (the
	// record stays: the node record still holds the credentials, and a
	// staged volume logs in again from it).
	SID  int    `json:"sid"`
	Boot string `json:"boot"`
	// Salt, Iterations and Fingerprint: PBKDF2-SHA256 of the credentials
	// in the node record.
	Salt        string `json:"salt"`
	Iterations  int    `json:"iterations"`
	Fingerprint string `json:"fingerprint"`
	// CreatedRecord: the mounter created the node record; it deletes it
	// at the logout.
	CreatedRecord bool `json:"createdRecord,omitempty"`
}

// iscsiState is what the node keeps of the iSCSI sessions it logged in.
type iscsiState struct {
	db       *journal.Records[iscsiRecord] // nil: observing, and none recorded
	rules    []config.EndpointRule
	rulesErr error
	nodeDB   string
	sysDir   string
	runner   toolrun.Runner

	mu    sync.Mutex
	recs  map[string]iscsiRecord
	locks map[string]chan struct{} // one login or logout per target and portal
}

// fingerprintIterations is the PBKDF2 cost of a new record's hash.
const fingerprintIterations = 100_000

// initISCSI reads the records. A record of an earlier boot keeps its
// credentials' hash (the node record survived the reboot) but no SID:
// the session ended with the boot.
func (n *Local) initISCSI(ctx context.Context) error {
	s := &n.iscsi
	cfg := n.opts.Config.ISCSI
	s.rules, s.rulesErr = cfg.PortalRules()
	s.nodeDB = cfg.NodeDBDir
	if s.nodeDB == "" {
		s.nodeDB = "/etc/iscsi/nodes"
	}
	s.sysDir = "/sys"
	s.recs = map[string]iscsiRecord{}
	s.locks = map[string]chan struct{}{}
	dir := filepath.Join(n.opts.RecordsDir, "iscsi")
	if n.opts.Observe {
		if _, err := os.Stat(dir); err != nil {
			return nil // nothing logged in yet: nothing is trusted
		}
	}
	db, err := journal.OpenRecords[iscsiRecord](dir, true)
	if err != nil {
		return err
	}
	s.db = db
	recs, lerr := db.List()
	var errs []error
	for key, rec := range recs {
		if rec.Boot != n.records.boot {
			if n.opts.Observe {
				rec.SID = 0
			} else {
				rec.SID, rec.Boot = 0, n.records.boot
				errs = append(errs, db.Put(key, rec))
			}
		}
		s.recs[key] = rec
	}
	if len(s.recs) > 0 {
		klog.FromContext(ctx).V(2).Info("iSCSI records taken back", "count", len(s.recs))
	}
	return errors.Join(lerr, errors.Join(errs...))
}

// SetISCSITestHooks makes the node's iSCSI work read sysDir instead of
// /sys and run exec instead of iscsiadm: for tests, of this package and
// of the plugin's iSCSI source, against a fake node. Call it before the
// first login.
func (n *Local) SetISCSITestHooks(sysDir string, exec func(ctx context.Context, name string, args []string) ([]byte, int, error)) {
	n.iscsi.sysDir = sysDir
	n.iscsi.runner = toolrun.Runner{Exec: exec}
}

func iscsiKey(iqn, portal string) string {
	sum := sha256.Sum256([]byte(iqn + "\x00" + portal))
	return hex.EncodeToString(sum[:12])
}

// lock takes the lock of one target and portal.
func (s *iscsiState) lock(ctx context.Context, key string) (func(), error) {
	s.mu.Lock()
	l := s.locks[key]
	if l == nil {
		l = make(chan struct{}, 1)
		s.locks[key] = l
	}
	s.mu.Unlock()
	select {
	case l <- struct{}{}:
		return func() { <-l }, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (s *iscsiState) record(key string) (iscsiRecord, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.recs[key]
	return rec, ok
}

func (s *iscsiState) put(key string, rec iscsiRecord) error {
	if err := s.db.Put(key, rec); err != nil {
		return err
	}
	s.mu.Lock()
	s.recs[key] = rec
	s.mu.Unlock()
	return nil
}

func (s *iscsiState) drop(key string) error {
	s.mu.Lock()
	delete(s.recs, key)
	s.mu.Unlock()
	return s.db.Delete(key)
}

// iqnPattern accepts iqn., eui. and naa. names (RFC 3720 3.2.6.3) in
// iSCSI's character set.
var iqnPattern = regexp.MustCompile(`^(iqn\.\d{4}-\d{2}\.[a-z0-9.\-]+(:[a-z0-9.\-:]+)?|eui\.[0-9A-Fa-f]{16}|naa\.[0-9A-Fa-f]{16,32})$`)

// checkLogin checks a login request: its target, TPGT and LUN in range,
// and its CHAP credentials well formed when it carries any.
func (s *iscsiState) checkLogin(l ISCSILogin) error {
	if err := s.checkTarget(l.IQN, l.Portal); err != nil {
		return err
	}
	if l.TPGT < 0 || l.TPGT > 65535 || l.LUN < 0 || l.LUN > 16383 {
		return fmt.Errorf("iSCSI TPGT %d or LUN %d out of range: %w", l.TPGT, l.LUN, errdefs.ErrInvalidArgument)
	}
	if l.CHAP != nil {
		return checkCHAP(*l.CHAP)
	}
	return nil
}

// checkTarget checks a request's target name and portal: well formed, and
// a portal the mounter's own config allows.
func (s *iscsiState) checkTarget(iqn, portal string) error {
	if len(iqn) > 223 || !iqnPattern.MatchString(iqn) {
		return fmt.Errorf("%q is not an iSCSI target name (iqn., eui. or naa.): %w", iqn, errdefs.ErrInvalidArgument)
	}
	ep, err := config.ParseEndpoint(portal, config.ISCSIDefaultPort)
	if err != nil {
		return err
	}
	if ep.String() != portal {
		return fmt.Errorf("portal %q must be given as HOST:PORT (%s): %w", portal, ep, errdefs.ErrInvalidArgument)
	}
	if s.rulesErr != nil {
		return fmt.Errorf("the mounter's iscsi.allowedPortals: %v: %w", s.rulesErr, errdefs.ErrPermissionDenied)
	}
	if err := config.AllowEndpoint(s.rules, ep, "iscsi.allowedPortals"); err != nil {
		return fmt.Errorf("iSCSI portal %s is not allowed by the mounter's config (iscsi.allowedPortals): %w", portal, errdefs.ErrPermissionDenied)
	}
	return nil
}

// checkCHAP refuses credentials that could not go into a node record as
// they are (a line break would add a field).
func checkCHAP(c CHAP) error {
	if (c.User == "") != (c.Password == "") || (c.UserIn == "") != (c.PasswordIn == "") {
		return fmt.Errorf("iSCSI CHAP needs both a user name and a password: %w", errdefs.ErrInvalidArgument)
	}
	if c.UserIn != "" && c.User == "" {
		return fmt.Errorf("iSCSI mutual CHAP needs one-way CHAP too: %w", errdefs.ErrInvalidArgument)
	}
	for _, v := range []string{c.User, c.Password, c.UserIn, c.PasswordIn} {
		if len(v) > 255 || strings.ContainsAny(v, "\n\r\x00") {
			return fmt.Errorf("an iSCSI CHAP field is longer than 255 bytes or holds a line break or NUL: %w", errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// secrets are the values to blot out of tool output (the passwords; user
// names are not secret and often part of IQNs).
func (c CHAP) secrets() []string {
	var out []string
	for _, s := range []string{c.Password, c.PasswordIn} {
		if s != "" {
			out = append(out, s)
		}
	}
	return out
}

// fingerprint is PBKDF2-SHA256 of c with salt. The fields hold no NUL
// (checkCHAP), so joining them with NULs is unambiguous.
func fingerprint(c CHAP, salt []byte, iterations int) (string, error) {
	key, err := pbkdf2.Key(sha256.New, strings.Join([]string{c.User, c.Password, c.UserIn, c.PasswordIn}, "\x00"), salt, iterations, 32)
	if err != nil {
		return "", err
	}
	return hex.EncodeToString(key), nil
}

// newFingerprint fills rec's salt, cost and hash for c.
func newFingerprint(rec *iscsiRecord, c CHAP) error {
	salt := make([]byte, 16)
	if _, err := rand.Read(salt); err != nil {
		return err
	}
	fp, err := fingerprint(c, salt, fingerprintIterations)
	if err != nil {
		return err
	}
	rec.Salt, rec.Iterations, rec.Fingerprint = hex.EncodeToString(salt), fingerprintIterations, fp
	return nil
}

// sameCredentials reports whether c are the credentials rec was made with.
func (rec iscsiRecord) sameCredentials(c CHAP) bool {
	salt, err := hex.DecodeString(rec.Salt)
	if err != nil || rec.Iterations <= 0 || rec.Fingerprint == "" {
		return false
	}
	fp, err := fingerprint(c, salt, rec.Iterations)
	return err == nil && subtle.ConstantTimeCompare([]byte(fp), []byte(rec.Fingerprint)) == 1
}

// LoginISCSI logs in to l's target at l's portal, or joins the session the
// mounter made there with the same credentials (see the top of this file).
func (n *Local) LoginISCSI(ctx context.Context, l ISCSILogin) (ISCSISession, error) {
	s := &n.iscsi
	if n.opts.Observe || s.db == nil {
		return ISCSISession{}, fmt.Errorf("this mounter only observes; it logs nothing in: %w", errdefs.ErrFailedPrecondition)
	}
	if err := s.checkLogin(l); err != nil {
		return ISCSISession{}, err
	}
	key := iscsiKey(l.IQN, l.Portal)
	unlock, err := s.lock(ctx, key)
	if err != nil {
		return ISCSISession{}, err
	}
	defer unlock()
	log := klog.FromContext(ctx).WithValues("target", l.IQN, "portal", l.Portal)

	rec, recorded := s.record(key)
	if recorded && l.CHAP != nil && !rec.sameCredentials(*l.CHAP) {
		return ISCSISession{}, fmt.Errorf("the mounter's session to %s at %s was made with other CHAP credentials than these: it is shared only with the same ones: %w",
			l.IQN, l.Portal, errdefs.ErrPermissionDenied)
	}
	found, err := s.findSession(l.IQN, l.Portal)
	if err != nil {
		return ISCSISession{}, err
	}
	if found != 0 {
		if !recorded || rec.SID != found || rec.Boot != n.records.boot {
			return ISCSISession{}, fmt.Errorf("iSCSI session %d to %s at %s was not logged in by the mounter, which never shares or ends such a session: "+
				"log it out on the node (iscsiadm -m session -r %d --logout) before staging volumes of this target: %w",
				found, l.IQN, l.Portal, found, errdefs.ErrFailedPrecondition)
		}
		if err := s.scanLUN(ctx, found, l.LUN); err != nil {
			return ISCSISession{}, err
		}
		log.V(2).Info("Joining the mounter's iSCSI session", "sid", found)
		return ISCSISession{SID: found, Joined: true}, nil
	}

	// No session: log in, from the record the mounter (re)writes now with
	// l's credentials, or from the one it wrote before.
	rec, redact, fresh, err := s.prepareLogin(ctx, l, key, rec, recorded, n.records.boot)
	if err != nil {
		return ISCSISession{}, err
	}
	_, err = s.adm(ctx, redact, "-m", "node", "-T", l.IQN, "-p", l.Portal, "--login")
	if err == nil {
		var sid int
		if sid, err = s.findSession(l.IQN, l.Portal); err == nil && sid == 0 {
			err = fmt.Errorf("iscsiadm logged in to %s but no session shows in sysfs: %w", l.IQN, errdefs.ErrUnavailable)
		}
		if err == nil {
			rec.SID, rec.Boot = sid, n.records.boot
			if err = s.put(key, rec); err != nil {
				// A session with no record is one the mounter would not
				// know again: end it.
				_, _ = s.adm(context.WithoutCancel(ctx), nil, "-m", "session", "-r", strconv.Itoa(sid), "--logout")
			}
		}
	} else {
		err = fmt.Errorf("login to %s at %s: %w", l.IQN, l.Portal, err)
	}
	if err != nil {
		return ISCSISession{}, s.undoLogin(ctx, key, rec, fresh, err)
	}
	if err := s.scanLUN(ctx, rec.SID, l.LUN); err != nil {
		return ISCSISession{}, err
	}
	log.Info("Logged in to an iSCSI target", "sid", rec.SID, "createdNodeRecord", rec.CreatedRecord)
	return ISCSISession{SID: rec.SID}, nil
}

// prepareLogin makes ready the node record iscsiadm logs in from: (re)written
// now with l's credentials, recorded first (fresh: by this call, which a
// failure undoes), or the one the mounter wrote before when l carries none.
// It returns the record to log in under and the secrets to redact from
// iscsiadm's output.
func (s *iscsiState) prepareLogin(ctx context.Context, l ISCSILogin, key string, rec iscsiRecord, recorded bool, boot string) (iscsiRecord, []string, bool, error) {
	nodeRec, existed, err := s.recordPath(l.IQN, l.Portal, l.TPGT)
	if err != nil {
		return rec, nil, false, err
	}
	var redact []string
	fresh := !recorded // this call makes the record; a failure removes it again
	switch {
	case l.CHAP == nil && !recorded:
		return rec, nil, false, fmt.Errorf("the mounter has no record of a session to %s at %s or of the credentials in its node record, and logs in from no node record it did not write: unstage the volume and stage it again: %w",
			l.IQN, l.Portal, errdefs.ErrFailedPrecondition)
	case l.CHAP == nil:
		if nodeRec, existed, err = s.recordPath(l.IQN, l.Portal, rec.TPGT); err != nil {
			return rec, nil, false, err
		}
		if !existed {
			return rec, nil, false, fmt.Errorf("the iSCSI session to %s at %s is gone and so is its node record %s, which held the CHAP credentials (nothing else keeps them): unstage the volume and stage it again: %w",
				l.IQN, l.Portal, filepath.Dir(nodeRec), errdefs.ErrFailedPrecondition)
		}
	default:
		redact = l.CHAP.secrets()
		if fresh {
			rec = iscsiRecord{Target: l.IQN, Portal: l.Portal, TPGT: l.TPGT}
			if err := newFingerprint(&rec, *l.CHAP); err != nil {
				return rec, nil, false, err
			}
		}
		rec.CreatedRecord = rec.CreatedRecord || !existed
		rec.SID, rec.Boot = 0, boot
		// Intent first: a crash from here on leaves the record that says
		// which node record to delete.
		if err := s.put(key, rec); err != nil {
			return rec, nil, false, err
		}
		if err := s.writeNodeRecord(ctx, l, nodeRec, existed); err != nil {
			return rec, nil, false, s.undoLogin(ctx, key, rec, fresh, err)
		}
	}
	return rec, redact, fresh, nil
}

// undoLogin, after a failed login, forgets what this call recorded (fresh:
// the record and, when it created it, the node record); a record that was
// there before stays for the volumes that use it.
func (s *iscsiState) undoLogin(ctx context.Context, key string, rec iscsiRecord, fresh bool, cause error) error {
	if !fresh {
		return cause
	}
	ctx = context.WithoutCancel(ctx)
	if rec.CreatedRecord {
		if err := s.deleteNodeRecord(ctx, rec); err != nil {
			klog.FromContext(ctx).Error(err, "Rollback: deleting the iSCSI node record failed; its record is kept", "target", rec.Target, "portal", rec.Portal)
			return cause
		}
	}
	if err := s.drop(key); err != nil {
		klog.FromContext(ctx).Error(err, "Rollback: forgetting the iSCSI record failed", "target", rec.Target)
	}
	return cause
}

// LogoutISCSI ends the session the mounter recorded for l's target and
// portal, deletes the node record it created and forgets both.
func (n *Local) LogoutISCSI(ctx context.Context, l ISCSILogout) error {
	s := &n.iscsi
	if n.opts.Observe || s.db == nil {
		return fmt.Errorf("this mounter only observes; it logs nothing out: %w", errdefs.ErrFailedPrecondition)
	}
	if len(l.IQN) > 223 || !iqnPattern.MatchString(l.IQN) {
		return fmt.Errorf("%q is not an iSCSI target name: %w", l.IQN, errdefs.ErrInvalidArgument)
	}
	key := iscsiKey(l.IQN, l.Portal)
	unlock, err := s.lock(ctx, key)
	if err != nil {
		return err
	}
	defer unlock()
	log := klog.FromContext(ctx).WithValues("target", l.IQN, "portal", l.Portal)
	rec, ok := s.record(key)
	if !ok {
		log.V(2).Info("No iSCSI session of the mounter's to this target and portal; nothing to log out", "sid", l.SID)
		return nil
	}
	if l.SID != 0 && rec.SID != 0 && l.SID != rec.SID {
		log.Info("The caller knows another iSCSI session than the one the mounter recorded; ending the recorded one", "sid", rec.SID, "callerSID", l.SID)
	}
	if rec.SID != 0 && rec.Boot == n.records.boot && s.isSession(rec.SID, rec.Target, rec.Portal) {
		_, err := s.adm(ctx, nil, "-m", "session", "-r", strconv.Itoa(rec.SID), "--logout")
		if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			return fmt.Errorf("logout of iSCSI session %d (%s): %w", rec.SID, rec.Target, err)
		}
		log.Info("Logged out of an iSCSI target", "sid", rec.SID)
	}
	if rec.CreatedRecord {
		if err := s.deleteNodeRecord(ctx, rec); err != nil {
			return err
		}
	}
	return s.drop(key)
}

func (s *iscsiState) deleteNodeRecord(ctx context.Context, rec iscsiRecord) error {
	_, err := s.adm(ctx, nil, "-m", "node", "-o", "delete", "-T", rec.Target, "-p", rec.Portal)
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return fmt.Errorf("deleting the node record of %s at %s: %w", rec.Target, rec.Portal, err)
	}
	return nil
}

// writeNodeRecord creates l's node record at nodeRec unless it exists and
// writes l's CHAP fields into it.
func (s *iscsiState) writeNodeRecord(ctx context.Context, l ISCSILogin, nodeRec string, existed bool) error {
	if !existed {
		if _, err := s.adm(ctx, l.CHAP.secrets(), "-m", "node", "-o", "new", "-T", l.IQN, "-p", fmt.Sprintf("%s,%d", l.Portal, l.TPGT)); err != nil {
			return err
		}
		var err error
		if nodeRec, existed, err = s.recordPath(l.IQN, l.Portal, l.TPGT); err != nil {
			return err
		} else if !existed {
			return fmt.Errorf("iscsiadm created no node record for %s at %s under %s (check iscsi.nodeDBDir): %w", l.IQN, l.Portal, s.nodeDB, errdefs.ErrFailedPrecondition)
		}
	}
	return writeAuth(nodeRec, *l.CHAP)
}

// recordPath returns the node record file of iqn at portal and whether it
// exists.
func (s *iscsiState) recordPath(iqn, portal string, tpgt int) (string, bool, error) {
	host, port, err := net.SplitHostPort(portal)
	if err != nil {
		return "", false, fmt.Errorf("portal %q: %v: %w", portal, err, errdefs.ErrInvalidArgument)
	}
	dir := filepath.Join(s.nodeDB, iqn, fmt.Sprintf("%s,%s,%d", host, port, tpgt))
	fi, err := os.Lstat(dir)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return filepath.Join(dir, "default"), false, nil
	case err != nil:
		return "", false, err
	case fi.Mode().IsRegular():
		return dir, true, nil // the old layout: the record is the file itself
	case !fi.IsDir():
		return "", false, fmt.Errorf("node record %s is neither a file nor a directory: %w", dir, errdefs.ErrFailedPrecondition)
	}
	fi, err = os.Lstat(filepath.Join(dir, "default"))
	if err == nil && !fi.Mode().IsRegular() {
		return "", false, fmt.Errorf("node record %s/default is not a regular file: %w", dir, errdefs.ErrFailedPrecondition)
	}
	return filepath.Join(dir, "default"), err == nil, nil
}

// authKeys are the record fields writeAuth owns.
var authKeys = []string{"node.session.auth.authmethod", "node.session.auth.username", "node.session.auth.password",
	"node.session.auth.username_in", "node.session.auth.password_in"}

// writeAuth replaces the record's CHAP fields with c's, through a 0600
// temp file renamed over the record: the secret exists only in that file
// (and in iscsid's memory), never in argv.
func writeAuth(rec string, c CHAP) error {
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
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading node record: %w", err)
	}
	if c.User == "" {
		b.WriteString("node.session.auth.authmethod = None\n")
	} else {
		fmt.Fprintf(&b, "node.session.auth.authmethod = CHAP\nnode.session.auth.username = %s\nnode.session.auth.password = %s\n", c.User, c.Password)
		if c.UserIn != "" {
			fmt.Fprintf(&b, "node.session.auth.username_in = %s\nnode.session.auth.password_in = %s\n", c.UserIn, c.PasswordIn)
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
// errors with the CHAP passwords blotted out (passwordField), in case an
// iscsiadm echoes a record.
var iscsiadm = toolrun.Tool{Name: "iscsiadm", Package: "open-iscsi", SecretField: passwordField}

// passwordField is a CHAP password field as a node record (or iscsiadm
// printing one) shows it: its value is hidden also when the mounter does
// not know it (a re-login from the record).
var passwordField = regexp.MustCompile(`(?m)(auth\.password(?:_in)?[ \t]*=[ \t]*)[^\n]*`)

// adm runs iscsiadm, blotting secrets out of its output; a non-zero exit
// wraps the sentinel its status means.
func (s *iscsiState) adm(ctx context.Context, secrets []string, args ...string) (string, error) {
	out, err := s.runner.Run(ctx, iscsiadm, args, secrets...)
	if err == nil {
		return out, nil
	}
	if code := toolrun.Status(err); code > 0 {
		return out, fmt.Errorf("iscsiadm %s: %w: %w", args[1], err, iscsiadmSentinel(code))
	}
	return out, fmt.Errorf("iscsiadm %s: %w", args[1], err)
}

// iscsiadmSentinel maps iscsiadm's exit codes (iscsiadm(8), EXIT STATUS).
func iscsiadmSentinel(code int) error {
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

// findSession returns the SID of a session to iqn through portal, or 0.
func (s *iscsiState) findSession(iqn, portal string) (int, error) {
	dirs, err := filepath.Glob(filepath.Join(s.sysDir, "class", "iscsi_session", "session*"))
	if err != nil {
		return 0, err
	}
	for _, d := range dirs {
		sid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), "session"))
		if err == nil && sid > 0 && s.isSession(sid, iqn, portal) {
			return sid, nil
		}
	}
	return 0, nil
}

// isSession reports whether sysfs shows session sid to iqn through portal.
func (s *iscsiState) isSession(sid int, iqn, portal string) bool {
	if readTrim(filepath.Join(s.sysDir, "class", "iscsi_session", fmt.Sprintf("session%d", sid), "targetname")) != iqn {
		return false
	}
	conn := filepath.Join(s.sysDir, "class", "iscsi_connection", fmt.Sprintf("connection%d:0", sid))
	addr := readTrim(filepath.Join(conn, "persistent_address"))
	port := readTrim(filepath.Join(conn, "persistent_port"))
	if addr == "" {
		addr, port = readTrim(filepath.Join(conn, "address")), readTrim(filepath.Join(conn, "port"))
	}
	return addr != "" && net.JoinHostPort(addr, port) == portal
}

func readTrim(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

var sessionHostPattern = regexp.MustCompile(`/host(\d+)/session\d+$`)

// scanLUN makes the session's SCSI host scan for lun when its device does
// not show (a LUN the target gained after the login); the plugin waits for
// the disk. A LUN the target lacks is no error here.
func (s *iscsiState) scanLUN(ctx context.Context, sid, lun int) error {
	sess := filepath.Join(s.sysDir, "class", "iscsi_session", fmt.Sprintf("session%d", sid))
	link, err := filepath.EvalSymlinks(filepath.Join(sess, "device"))
	if err != nil {
		return fmt.Errorf("iSCSI session %d has no SCSI host in sysfs: %w: %w", sid, err, errdefs.ErrUnavailable)
	}
	m := sessionHostPattern.FindStringSubmatch(link)
	if m == nil {
		return fmt.Errorf("iSCSI session %d: cannot tell its SCSI host from %s: %w", sid, link, errdefs.ErrUnavailable)
	}
	host := m[1]
	pattern := filepath.Join(sess, "device", "target"+host+":*", host+":*:*:"+strconv.Itoa(lun))
	for range 5 {
		if matches, _ := filepath.Glob(pattern); len(matches) > 0 {
			return nil
		}
		// A scan of the one LUN; the write returns when the scan is done.
		scan := filepath.Join(s.sysDir, "class", "scsi_host", "host"+host, "scan")
		if err := os.WriteFile(scan, []byte("- - "+strconv.Itoa(lun)), 0); err != nil {
			return fmt.Errorf("scanning SCSI host %s: %w", host, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// diskPattern is a whole SCSI disk's sysfs path below an iSCSI session:
// .../session<SID>/target<H:C:T>/<H:C:T:L>/block/<name>.
var diskPattern = regexp.MustCompile(`/session(\d+)/target\d+:\d+:\d+/\d+:\d+:\d+:\d+/block/[^/]+$`)

// ownsISCSI reports whether major:minor is a whole SCSI disk of a session
// the node logged in during this boot and still shows to the recorded
// target and portal: its sysfs path must run through that session.
func (n *Local) ownsISCSI(major, minor uint32) bool {
	s := &n.iscsi
	link, err := filepath.EvalSymlinks(filepath.Join(s.sysDir, "dev", "block", fmt.Sprintf("%d:%d", major, minor)))
	if err != nil {
		return false
	}
	m := diskPattern.FindStringSubmatch(link)
	if m == nil {
		return false
	}
	sid, err := strconv.Atoi(m[1])
	if err != nil || sid <= 0 {
		return false
	}
	s.mu.Lock()
	var rec iscsiRecord
	found := false
	for _, r := range s.recs {
		if r.SID == sid && r.Boot == n.records.boot {
			rec, found = r, true
			break
		}
	}
	s.mu.Unlock()
	return found && s.isSession(sid, rec.Target, rec.Portal)
}
