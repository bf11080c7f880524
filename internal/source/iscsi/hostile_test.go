package iscsi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/mountplan/mountplan/internal/errdefs"
)

// TestHostile_4_JoinsOnlyWithTheSessionsCredentials (review finding 4,
// ported from hostile-old's TestHostileOld_4_JoinsSessionWithoutCredentials):
// a second PV naming the target of a session, with no CHAP secret or with
// wrong ones, must not reach that session's LUNs, whether another PV made
// the session with CHAP or the node's admin logged it in outside
// mountplan. The mounter decides (LoginISCSI): it joins only a session it
// made, and only with the credentials it was made with (compared by a
// salted hash). Refused: PermissionDenied (other credentials) or
// FailedPrecondition (a session it did not make); nothing runs (no login,
// no node record written), the PV is not among the session's users, and
// the session and the first PV are as they were.
func TestHostile_4_JoinsOnlyWithTheSessionsCredentials(t *testing.T) {
	tests := []struct {
		name string
		// existing makes the session already there and returns its SID.
		existing func(n *fakeNode) int
		creds    credentials
		want     error // nil: joins the session
	}{
		{"no credentials, a CHAP session another PV made", stagePVA, credentials{}, errdefs.ErrPermissionDenied},
		{"wrong credentials, a CHAP session another PV made", stagePVA,
			credentials{user: "mallory", password: "not-the-password"}, errdefs.ErrPermissionDenied},
		{"the right user, a wrong password", stagePVA, credentials{user: fakeCreds.user, password: "canary-pw2"}, errdefs.ErrPermissionDenied},
		{"extra mutual CHAP, a CHAP session another PV made", stagePVA,
			credentials{user: fakeCreds.user, password: fakeCreds.password, userIn: "tgt", passwordIn: "back"}, errdefs.ErrPermissionDenied},
		{"no credentials, a session mountplan did not make", func(n *fakeNode) int { return n.addSession() }, credentials{}, errdefs.ErrFailedPrecondition},
		{"credentials, a session mountplan did not make", func(n *fakeNode) int { return n.addSession() }, fakeCreds, errdefs.ErrFailedPrecondition},
		{"the same credentials, a session another PV made", stagePVA, fakeCreds, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := newFakeNode(t)
			sid := tt.existing(n)
			key := sessionKey(fakeIQN, fakePortal)
			before := n.session(key)
			nodeRecord := n.Record()
			v, err := n.s.NewVolume("pv-b", map[string]string{"portals": fakePortal, "iqn": fakeIQN, "lun": strconv.Itoa(fakeLUN)})
			if err != nil {
				t.Fatal(err)
			}
			n.Calls()
			c := tt.creds
			st, err := n.s.join(context.Background(), "pv-b", targetOf(v), Portal{Address: fakePortal, TPGT: 1}, &c)
			if err == nil {
				err = n.s.waitDisk(context.Background(), &st)
			}
			calls := n.Calls()
			after := n.session(key)
			if tt.want == nil {
				if err != nil || st.SID != sid || len(calls) != 0 || !slices.Contains(after.Users, "pv-b") {
					t.Fatalf("stage of pv-b with the session's credentials = %v: SID %d (want %d), iscsiadm calls %q, users %q", err, st.SID, sid, calls, after.Users)
				}
				return
			}
			if !errors.Is(err, tt.want) {
				t.Fatalf("stage of pv-b = %v (SID %d, disk %s, iscsiadm calls %q, users %q); want %v",
					err, st.SID, st.Device, calls, after.Users, tt.want)
			}
			if strings.Contains(err.Error(), "not-the-password") || strings.Contains(err.Error(), fakeCreds.password) {
				t.Fatalf("the error shows a password: %v", err)
			}
			if len(calls) != 0 {
				t.Fatalf("a refused join ran iscsiadm: %q", calls)
			}
			if slices.Contains(after.Users, "pv-b") || !slices.Equal(after.Users, before.Users) {
				t.Fatalf("refused stage of pv-b left the session's users %q (before %q)", after.Users, before.Users)
			}
			if (after.Owner == nil) != (before.Owner == nil) || (after.Owner != nil && *after.Owner != *before.Owner) {
				t.Fatalf("refused stage of pv-b changed the session's owner: %+v (before %+v)", after.Owner, before.Owner)
			}
			if n.Record() != nodeRecord {
				t.Fatalf("refused stage of pv-b changed the node record:\n%s", n.Record())
			}
			if !slices.Equal(n.Sessions(), []int{sid}) {
				t.Fatalf("sessions %v after the refusal, want %d still there", n.Sessions(), sid)
			}
			// The mounter's records hold a hash, never a password.
			recs, _ := filepath.Glob(filepath.Join(n.records, "iscsi", "*"))
			for _, r := range recs {
				if b, _ := os.ReadFile(r); strings.Contains(string(b), fakeCreds.password) || strings.Contains(string(b), "not-the-password") {
					t.Fatalf("the mounter's record %s holds a password: %s", r, b)
				}
			}
		})
	}
}

// stagePVA stages pv-a with fakeCreds and returns its session's SID.
func stagePVA(n *fakeNode) int { return stateOf(n.t, n.stage("pv-a").State).SID }
