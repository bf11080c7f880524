package iscsi

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/source/internal/dial"
)

// The plugin's own SendTargets discovery (RFC 7143): a discovery session
// without authentication, one Text request, a logout. It needs no kernel
// support, unlike iscsiadm's discovery, which insists on the iscsi_tcp
// transport; so a wrong IQN is a clear NotFound on any node, and nothing
// is written to open-iscsi's database for targets the volume does not use.

// iSCSI opcodes and flags used here.
const (
	opLoginReq    = 0x03
	opTextReq     = 0x04
	opLogoutReq   = 0x06
	opLoginResp   = 0x23
	opTextResp    = 0x24
	opLogoutResp  = 0x26
	opReject      = 0x3f
	flagImmediate = 0x40
	flagFinal     = 0x80 // T in login, F in text
	flagContinue  = 0x40
	stageSecurity = 0
	stageOper     = 1
	stageFull     = 3
	bhsLen        = 48
	maxDataLen    = 1 << 20
)

// Portal is a target's network portal as SendTargets reports it.
type Portal struct {
	Address string // HOST:PORT
	TPGT    int
}

// Target is one entry of a SendTargets answer.
type Target struct {
	Name    string
	Portals []Portal
}

// Discoverer runs SendTargets against one portal.
type Discoverer struct {
	// Portal is HOST:PORT.
	Portal string
	// InitiatorName identifies this node to the target.
	InitiatorName string
	// Timeout bounds the whole exchange (default 10s).
	Timeout time.Duration
}

type pdu struct {
	bhs  [bhsLen]byte
	data []byte
}

func (p *pdu) opcode() byte { return p.bhs[0] & 0x3f }

type discoverySession struct {
	conn     net.Conn
	portal   string
	itt      uint32
	cmdSN    uint32
	expStat  uint32
	isid     [6]byte
	tsih     uint16
	maxRecvd int
}

// SendTargets returns the targets the portal offers to this initiator.
func (d Discoverer) SendTargets(ctx context.Context) ([]Target, error) {
	conn, _, err := dial.Conn(ctx, "tcp", d.Portal, d.Timeout, "iSCSI portal "+d.Portal)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	s := &discoverySession{conn: conn, portal: d.Portal}
	if _, err := rand.Read(s.isid[1:]); err != nil {
		return nil, err
	}
	s.isid[0] = 0x80 // random ISID format
	if err := s.login(d.InitiatorName); err != nil {
		return nil, err
	}
	text, err := s.text("SendTargets=All")
	if err != nil {
		return nil, err
	}
	s.logout()
	return parseSendTargets(text, d.Portal), nil
}

func (s *discoverySession) fail(what string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		err = fmt.Errorf("connection closed: %w", err)
	}
	return fmt.Errorf("iSCSI portal %s: %s: %w: %w", s.portal, what, err, errdefs.ErrUnavailable)
}

func (s *discoverySession) write(p *pdu) error {
	binary.BigEndian.PutUint32(p.bhs[4:], uint32(len(p.data))) // TotalAHSLength 0, DataSegmentLength
	buf := append(p.bhs[:], p.data...)
	if pad := len(p.data) % 4; pad != 0 {
		buf = append(buf, make([]byte, 4-pad)...)
	}
	_, err := s.conn.Write(buf)
	return err
}

func (s *discoverySession) read() (*pdu, error) {
	p := &pdu{}
	if _, err := io.ReadFull(s.conn, p.bhs[:]); err != nil {
		return nil, err
	}
	ahs := int(p.bhs[4]) * 4
	dlen := int(binary.BigEndian.Uint32(p.bhs[4:]) & 0xffffff)
	if dlen > maxDataLen {
		return nil, fmt.Errorf("data segment of %d bytes is too long", dlen)
	}
	padded := dlen
	if r := dlen % 4; r != 0 {
		padded += 4 - r
	}
	buf := make([]byte, ahs+padded)
	if _, err := io.ReadFull(s.conn, buf); err != nil {
		return nil, err
	}
	p.data = buf[ahs : ahs+dlen]
	if sn := binary.BigEndian.Uint32(p.bhs[24:]); p.opcode() != opReject {
		s.expStat = sn + 1
	}
	return p, nil
}

func keys(kv ...string) []byte {
	var b bytes.Buffer
	for _, k := range kv {
		b.WriteString(k)
		b.WriteByte(0)
	}
	return b.Bytes()
}

func parseKeys(data []byte) map[string]string {
	m := map[string]string{}
	for _, kv := range bytes.Split(data, []byte{0}) {
		if k, v, ok := strings.Cut(string(kv), "="); ok {
			m[k] = v
		}
	}
	return m
}

// login runs the security and operational stages of a discovery session.
func (s *discoverySession) login(initiator string) error {
	csg, nsg := byte(stageSecurity), byte(stageOper)
	data := keys("InitiatorName="+initiator, "SessionType=Discovery", "AuthMethod=None")
	for range 8 {
		req := &pdu{data: data}
		req.bhs[0] = flagImmediate | opLoginReq
		req.bhs[1] = flagFinal | csg<<2 | nsg
		copy(req.bhs[8:14], s.isid[:])
		binary.BigEndian.PutUint16(req.bhs[14:], s.tsih)
		s.itt++
		binary.BigEndian.PutUint32(req.bhs[16:], s.itt)
		binary.BigEndian.PutUint32(req.bhs[24:], s.cmdSN)
		binary.BigEndian.PutUint32(req.bhs[28:], s.expStat)
		if err := s.write(req); err != nil {
			return s.fail("sending login", err)
		}
		resp, err := s.read()
		if err != nil {
			return s.fail("reading login response", err)
		}
		if resp.opcode() != opLoginResp {
			return s.fail("login", fmt.Errorf("unexpected opcode %#x", resp.opcode()))
		}
		if err := loginStatus(s.portal, resp.bhs[36], resp.bhs[37]); err != nil {
			return err
		}
		s.tsih = binary.BigEndian.Uint16(resp.bhs[14:])
		transit, rcsg, rnsg := resp.bhs[1]&flagFinal != 0, (resp.bhs[1]>>2)&3, resp.bhs[1]&3
		got := parseKeys(resp.data)
		if m, ok := got["AuthMethod"]; ok && m != "None" {
			return fmt.Errorf("iSCSI portal %s wants %.64q authentication for discovery, which the plugin does not do: %w", s.portal, m, errdefs.ErrPermissionDenied)
		}
		if v, ok := got["MaxRecvDataSegmentLength"]; ok {
			s.maxRecvd, _ = strconv.Atoi(v)
		}
		switch {
		case transit && rnsg == stageFull:
			return nil
		case transit && rcsg == stageSecurity && rnsg == stageOper:
			csg, nsg = stageOper, stageFull
			data = keys("HeaderDigest=None", "DataDigest=None", "MaxRecvDataSegmentLength=262144")
		default: // the target wants another round in this stage
			csg = rcsg
			data = nil
		}
	}
	return s.fail("login", errors.New("the target never moved to the full feature phase"))
}

// loginStatus maps a login response's status to an error (RFC 7143 11.13.5).
func loginStatus(portal string, class, detail byte) error {
	switch class {
	case 0:
		return nil
	case 1:
		return fmt.Errorf("iSCSI portal %s redirects discovery (status %d/%d), which the plugin does not follow: %w", portal, class, detail, errdefs.ErrFailedPrecondition)
	case 2:
		switch detail {
		case 1, 2:
			return fmt.Errorf("iSCSI portal %s refused the initiator (authentication or authorization failure, %d/%d): %w", portal, class, detail, errdefs.ErrPermissionDenied)
		case 3, 4:
			return fmt.Errorf("iSCSI portal %s: target not found (%d/%d): %w", portal, class, detail, errdefs.ErrNotFound)
		}
		return fmt.Errorf("iSCSI portal %s rejected the login (initiator error %d/%d): %w", portal, class, detail, errdefs.ErrFailedPrecondition)
	}
	return fmt.Errorf("iSCSI portal %s failed the login (target error %d/%d): %w", portal, class, detail, errdefs.ErrUnavailable)
}

// text sends a Text request and gathers the (possibly continued) answer.
func (s *discoverySession) text(query string) ([]byte, error) {
	var all []byte
	ttt := uint32(0xffffffff)
	data := keys(query)
	s.itt++
	for range 64 {
		req := &pdu{data: data}
		req.bhs[0] = flagImmediate | opTextReq
		req.bhs[1] = flagFinal
		binary.BigEndian.PutUint32(req.bhs[16:], s.itt)
		binary.BigEndian.PutUint32(req.bhs[20:], ttt)
		binary.BigEndian.PutUint32(req.bhs[24:], s.cmdSN)
		binary.BigEndian.PutUint32(req.bhs[28:], s.expStat)
		if err := s.write(req); err != nil {
			return nil, s.fail("sending SendTargets", err)
		}
		resp, err := s.read()
		if err != nil {
			return nil, s.fail("reading SendTargets", err)
		}
		switch resp.opcode() {
		case opTextResp:
		case opReject:
			return nil, fmt.Errorf("iSCSI portal %s rejected SendTargets: %w", s.portal, errdefs.ErrFailedPrecondition)
		default:
			return nil, s.fail("SendTargets", fmt.Errorf("unexpected opcode %#x", resp.opcode()))
		}
		if len(all)+len(resp.data) > maxDataLen {
			return nil, s.fail("SendTargets", errors.New("answer too long"))
		}
		all = append(all, resp.data...)
		if resp.bhs[1]&flagContinue == 0 && resp.bhs[1]&flagFinal != 0 {
			return all, nil
		}
		ttt = binary.BigEndian.Uint32(resp.bhs[20:])
		data = nil
	}
	return nil, s.fail("SendTargets", errors.New("answer too long"))
}

// logout closes the session politely; its errors do not matter.
func (s *discoverySession) logout() {
	req := &pdu{}
	req.bhs[0] = flagImmediate | opLogoutReq
	req.bhs[1] = flagFinal // reason 0: close the session
	s.itt++
	binary.BigEndian.PutUint32(req.bhs[16:], s.itt)
	binary.BigEndian.PutUint32(req.bhs[24:], s.cmdSN)
	binary.BigEndian.PutUint32(req.bhs[28:], s.expStat)
	if s.write(req) == nil {
		_, _ = s.read()
	}
}

// parseSendTargets reads TargetName/TargetAddress pairs; a target listed
// without an address is reachable where it was discovered.
func parseSendTargets(data []byte, discoveredAt string) []Target {
	var out []Target
	for _, kv := range bytes.Split(data, []byte{0}) {
		k, v, ok := strings.Cut(string(kv), "=")
		if !ok {
			continue
		}
		switch k {
		case "TargetName":
			out = append(out, Target{Name: v})
		case "TargetAddress":
			if len(out) == 0 {
				continue
			}
			addr, tag, _ := strings.Cut(v, ",")
			tpgt, err := strconv.Atoi(tag)
			if err != nil || tpgt < 0 || tpgt > 0xffff {
				tpgt = 1 // a portal group tag is 16 bits (RFC 7143 13.9)
			}
			last := &out[len(out)-1]
			last.Portals = append(last.Portals, Portal{Address: addr, TPGT: tpgt})
		}
	}
	for i := range out {
		if len(out[i].Portals) == 0 {
			out[i].Portals = []Portal{{Address: discoveredAt, TPGT: 1}}
		}
	}
	return out
}
