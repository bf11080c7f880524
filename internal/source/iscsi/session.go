package iscsi

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/mounter"
	"github.com/mountplan/mountplan/internal/source"
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

// owner is the plugin's record of the session the mounter logged in for
// the plugin's volumes.
type owner struct {
	Target string `json:"target"`
	Portal string `json:"portal"`
	TPGT   int    `json:"tpgt"`
	// SID is 0 between the intent and the login's answer.
	SID int `json:"sid"`
}

func sessionKey(iqn, portal string) string {
	sum := sha256.Sum256([]byte(iqn + "\x00" + portal))
	return hex.EncodeToString(sum[:12])
}

// sharedKind names the driver-kept records of sessions (Host.WithShared).
const sharedKind = "iscsi-session"

// session is what the plugin keeps of a session several volumes (LUNs of
// one target) may share: who uses it, and that the mounter logged it in
// for them.
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

// join marks volume id as a user of the session to t at p and asks the
// mounter for it (LoginISCSI): it logs in when it has no session there,
// or lets the volume join the session it made with the same credentials;
// it refuses other credentials (PermissionDenied) and any session it did
// not make (FailedPrecondition). join returns the state without the disk.
//
// With c (a stage), a refusal or a failure leaves the session as it was
// before. With c nil (Adopt of a staged volume whose session was lost),
// the mounter logs in from the node record the stage wrote, which still
// holds the CHAP fields, so the secrets never pass through the plugin
// again; a failure keeps the volume among the session's users, since the
// volume is still staged, and the next Adopt tries again.
func (s *Source) join(ctx context.Context, id string, t target, p Portal, c *credentials) (State, error) {
	key := sessionKey(t.iqn, p.Address)
	st := State{Target: t.iqn, Portal: p.Address, TPGT: p.TPGT, LUN: t.lun, Session: key}
	err := s.withSession(ctx, key, "login", func(tx *sessionTx) error {
		// Intent first: a crash from here on leaves a user unstage finds,
		// and an owner whose session unstage asks the mounter to end.
		if !tx.uses(id) {
			tx.Users = append(tx.Users, id)
		}
		if tx.Owner == nil {
			tx.Owner = &owner{Target: t.iqn, Portal: p.Address, TPGT: p.TPGT}
		}
		if err := tx.commit(); err != nil {
			return err
		}
		l := mounter.ISCSILogin{IQN: t.iqn, Portal: p.Address, TPGT: p.TPGT, LUN: t.lun}
		if c != nil {
			chap := c.chap()
			l.CHAP = &chap
		}
		var sess mounter.ISCSISession
		err := s.Metrics.Step("iscsi_login", func() error {
			var err error
			sess, err = s.Devices.LoginISCSI(ctx, l)
			return err
		})
		if err == nil {
			tx.Owner.SID = sess.SID
			err = tx.commit()
		}
		if err != nil {
			if c != nil {
				if rerr := s.leave(context.WithoutCancel(ctx), tx, id); rerr != nil {
					klog.FromContext(ctx).Error(rerr, "Rollback: leaving the iSCSI session failed", "target", t.iqn)
				}
			}
			return fmt.Errorf("iSCSI session to %s at %s: %w", t.iqn, p.Address, err)
		}
		st.SID = sess.SID
		if sess.Joined {
			klog.FromContext(ctx).V(2).Info("Volume joins the iSCSI session", "volume", id, "target", t.iqn, "sid", sess.SID)
		}
		return nil
	})
	return st, err
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

// leave, when nobody else uses the session, asks the mounter to end it
// and forgets it, then drops id from its users. The user goes last: if
// the logout fails, the retry still finds the session as id's to
// release. Called with the session's record locked.
func (s *Source) leave(ctx context.Context, tx *sessionTx, id string) error {
	others := slices.ContainsFunc(tx.Users, func(u string) bool { return u != id })
	if !others && tx.Owner != nil {
		own := *tx.Owner
		err := s.Metrics.Step("iscsi_logout", func() error {
			return s.Devices.LogoutISCSI(ctx, mounter.ISCSILogout{IQN: own.Target, Portal: own.Portal, SID: own.SID})
		})
		if err != nil {
			return fmt.Errorf("logout of the iSCSI session to %s at %s: %w", own.Target, own.Portal, err)
		}
		tx.Owner = nil
	}
	tx.Users = slices.DeleteFunc(tx.Users, func(u string) bool { return u == id })
	return tx.commit()
}

func readTrim(p string) string {
	b, err := os.ReadFile(p)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

var hostPattern = regexp.MustCompile(`/host(\d+)/session\d+$`)

// lunGrace is how long waitDisk looks for the LUN on the session after
// the mounter scanned for it, before it says the target has no such LUN;
// it looks every diskPoll, as it does for the LUN's disk.
const (
	lunGrace = time.Second
	diskPoll = 50 * time.Millisecond
)

// waitDisk finds st.LUN on the session (the mounter scanned for it at the
// login) and waits for its disk. A LUN the target does not have is
// ErrNotFound. It only reads sysfs.
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
	err = wait.PollUntilContextTimeout(ctx, diskPoll, lunGrace, true, func(context.Context) (bool, error) {
		if matches, _ := filepath.Glob(pattern); len(matches) > 0 {
			scsiDev = matches[0]
		}
		return scsiDev != "", nil
	})
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("LUN %d does not exist on target %s: %w", st.LUN, st.Target, errdefs.ErrNotFound)
	}
	st.HCTL = filepath.Base(scsiDev)
	err = wait.PollUntilContextCancel(ctx, diskPoll, true, func(context.Context) (bool, error) {
		if blocks, _ := filepath.Glob(filepath.Join(scsiDev, "block", "*")); len(blocks) > 0 {
			name := filepath.Base(blocks[0])
			st.Device = filepath.Join(s.DevDir, name)
			st.DevNum = readTrim(filepath.Join(blocks[0], "dev"))
			if _, err := os.Stat(st.Device); err == nil && st.DevNum != "" {
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("waiting for the disk of LUN %d (%s): %w", st.LUN, st.HCTL, err)
	}
	return nil
}

// check tells whether st's session is logged in and its disk is the same.
func (s *Source) check(st State) source.Health {
	sess := filepath.Join(s.SysDir, "class", "iscsi_session", fmt.Sprintf("session%d", st.SID))
	if readTrim(filepath.Join(sess, "targetname")) != st.Target {
		return source.Health{Abnormal: true, Reason: "SessionGone", Message: fmt.Sprintf("iSCSI session %d to %s at %s is gone; the plugin has the mounter log in again from the node record when it next reconciles", st.SID, st.Target, st.Portal)}
	}
	if state := readTrim(filepath.Join(sess, "state")); state != "" && state != "LOGGED_IN" {
		return source.Health{Abnormal: true, Reason: "SessionFailed", Message: fmt.Sprintf("iSCSI session %d to %s is %s", st.SID, st.Target, state)}
	}
	if readTrim(filepath.Join(s.SysDir, "class", "block", filepath.Base(st.Device), "dev")) != st.DevNum {
		return source.Health{Abnormal: true, Reason: "DeviceGone", Message: fmt.Sprintf("%s is no longer LUN %d of %s", st.Device, st.LUN, st.Target)}
	}
	return source.Health{}
}
