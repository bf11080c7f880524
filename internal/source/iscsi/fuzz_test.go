package iscsi

import (
	"context"
	"encoding/binary"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/source/internal/bytesrvtest"
)

// respPDU builds a target's PDU: opcode, flags, status (login only) and
// key=value data.
func respPDU(opcode, flags byte, status uint16, kv ...string) []byte {
	p := &pdu{data: keys(kv...)}
	p.bhs[0], p.bhs[1] = opcode, flags
	binary.BigEndian.PutUint16(p.bhs[36:], status)
	binary.BigEndian.PutUint32(p.bhs[4:], uint32(len(p.data)))
	b := append(p.bhs[:], p.data...)
	if pad := len(p.data) % 4; pad != 0 {
		b = append(b, make([]byte, 4-pad)...)
	}
	return b
}

func concat(parts ...[]byte) []byte {
	var b []byte
	for _, p := range parts {
		b = append(b, p...)
	}
	return b
}

var (
	loginToOper = respPDU(opLoginResp, flagFinal|stageSecurity<<2|stageOper, 0, "AuthMethod=None")
	loginToFull = respPDU(opLoginResp, flagFinal|stageOper<<2|stageFull, 0, "MaxRecvDataSegmentLength=8192")
	logoutResp  = respPDU(opLogoutResp, flagFinal, 0)
)

// FuzzSendTargets plays a portal that answers the discovery session with
// the fuzzer's bytes. SendTargets may not panic or hang, every error wraps
// a sentinel and stays short (a portal's text is quoted, bounded), and
// what it returns is sane: TPGTs are 16-bit tags.
func FuzzSendTargets(f *testing.F) {
	f.Add(concat(loginToOper, loginToFull,
		respPDU(opTextResp, flagFinal, 0, "TargetName=iqn.2024-01.io.example:disk", "TargetAddress=127.0.0.1:3260,1"), logoutResp))
	f.Add(concat(loginToOper, loginToFull,
		respPDU(opTextResp, flagContinue, 0, "TargetName=iqn.2024-01.io.example:a"),
		respPDU(opTextResp, flagFinal, 0, "TargetAddress=[::1]:3260,70000", "TargetName=", "TargetAddress=x,-3")))
	f.Add(concat(loginToOper, respPDU(opLoginResp, flagFinal, 0x0201)))
	f.Add(concat(respPDU(opLoginResp, 0, 0, "AuthMethod=CHAP\x1b[2J")))
	f.Add(concat(loginToOper, loginToFull, respPDU(opReject, flagFinal, 0)))
	f.Add([]byte{opLoginResp, 0, 0, 0, 0, 0xff, 0xff, 0xff})

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	srv := bytesrvtest.Serve(f, l)
	d := Discoverer{Portal: l.Addr().String(), InitiatorName: "iqn.2024-01.io.mountplan:fuzz", Timeout: 2 * time.Second}
	f.Fuzz(func(t *testing.T, data []byte) {
		srv.Set(data)
		targets, err := d.SendTargets(context.Background())
		if c := errdefs.Code(err); c == codes.Internal || c == codes.DeadlineExceeded {
			t.Fatalf("SendTargets: %v (code %v): every failure must wrap a sentinel and end before the timeout", err, c)
		}
		if err != nil && len(err.Error()) > 1024 {
			t.Fatalf("error of %d bytes: a portal's text must be bounded", len(err.Error()))
		}
		for _, tg := range targets {
			for _, p := range tg.Portals {
				if p.TPGT < 0 || p.TPGT > 0xffff {
					t.Fatalf("target %q: portal %q with TPGT %d", tg.Name, p.Address, p.TPGT)
				}
			}
		}
	})
}

// FuzzParseSendTargets feeds a SendTargets text answer straight to the
// parser: every portal it returns has a 16-bit TPGT and a target listed
// without an address gets the portal it was discovered at.
func FuzzParseSendTargets(f *testing.F) {
	f.Add(keys("TargetName=iqn.2024-01.io.example:disk", "TargetAddress=10.0.0.1:3260,1"), "10.0.0.9:3260")
	f.Add(keys("TargetAddress=orphan:1,2", "TargetName=a", "TargetName=b", "TargetAddress=[fe80::1%eth0]:3260,99999"), "h:1")
	f.Add([]byte("TargetName\x00=\x00=="), "")
	f.Fuzz(func(t *testing.T, data []byte, at string) {
		for _, tg := range parseSendTargets(data, at) {
			if len(tg.Portals) == 0 {
				t.Fatalf("target %q without a portal", tg.Name)
			}
			for _, p := range tg.Portals {
				if p.TPGT < 0 || p.TPGT > 0xffff {
					t.Fatalf("target %q: TPGT %d", tg.Name, p.TPGT)
				}
			}
		}
	})
}
