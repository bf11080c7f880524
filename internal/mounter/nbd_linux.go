package mounter

// NBD devices: the plugin makes the TCP (or TLS, or unix) connection and
// the whole handshake unprivileged and hands the connected socket over on
// ConnectNBD; the mounter only gives it to the kernel (internal/nbdnl, generic
// netlink) and keeps a record of the device. A device is the mounter's by
// its backend identifier, which the kernel shows in
// /sys/block/nbdN/backend: the plugin chooses it (NBDBackend's form), the
// mounter records it with the device's number, and every later act, and
// every plan naming the device, checks that the kernel still shows it.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/journal"
	"github.com/mountplan/mountplan/internal/model"
	"github.com/mountplan/mountplan/internal/nbdnl"
)

// nbdRecord is an NBD device the mounter connected.
type nbdRecord struct {
	Backend string `json:"backend"`
	// Index is N of /dev/nbdN; -1 while the connect is under way (a
	// mounter that died then finds the device by its backend at start).
	Index           int           `json:"index"`
	Major           uint32        `json:"major,omitempty"`
	Minor           uint32        `json:"minor,omitempty"`
	SizeBytes       uint64        `json:"sizeBytes"`
	ReadOnly        bool          `json:"readOnly,omitempty"`
	DeadConnTimeout time.Duration `json:"deadConnTimeout,omitempty"`
	Connected       time.Time     `json:"connected"`
	Boot            string        `json:"boot"`
}

func (r nbdRecord) device() Device {
	return Device{Path: fmt.Sprintf("/dev/nbd%d", r.Index), Major: r.Major, Minor: r.Minor}
}

// nbdState is what the node keeps of the NBD devices it connected.
type nbdState struct {
	kernel nbdKernel
	db     *journal.Records[nbdRecord] // nil: observing, with no records yet

	// op serializes connects, reconnects and disconnects: a disconnect by
	// backend waits for a connect of that backend still under way.
	op sync.Mutex
	mu sync.Mutex // guards devs
	// devs are the records by backend.
	devs map[string]nbdRecord
}

// nbdKernel is what the node asks of the kernel's NBD driver: internal/nbdnl,
// replaced in tests on a kernel without one.
type nbdKernel interface {
	Connect(cfg nbdnl.Config, socks []*os.File) (int, error)
	ReconfigureBackend(index int, backend string, socks []*os.File, deadConnTimeout time.Duration) error
	Disconnect(index int) error
	Backend(index int) string
	FindBackend(backend string) int
	DeviceNumber(index int) (major, minor uint32, err error)
}

type netlinkNBD struct{}

func (netlinkNBD) Connect(cfg nbdnl.Config, socks []*os.File) (int, error) {
	return nbdnl.Connect(cfg, socks)
}
func (netlinkNBD) ReconfigureBackend(index int, backend string, socks []*os.File, d time.Duration) error {
	return nbdnl.ReconfigureBackend(index, backend, socks, d)
}
func (netlinkNBD) Disconnect(index int) error     { return nbdnl.Disconnect(index) }
func (netlinkNBD) Backend(index int) string       { return nbdnl.Backend(index) }
func (netlinkNBD) FindBackend(backend string) int { return nbdnl.FindBackend(backend) }
func (netlinkNBD) DeviceNumber(index int) (uint32, uint32, error) {
	return nbdnl.DeviceNumber(index)
}

// newNBDKernel is how a node reaches the kernel's NBD driver (tests
// replace it before NewNode).
var newNBDKernel = func() nbdKernel { return netlinkNBD{} }

// Bounds of what the plugin may ask for.
const (
	maxNBDTimeout      = time.Hour
	nbdDisconnectWait  = 5 * time.Second
	nbdBackendRandHex  = 32 // the random part: 16 bytes in hex
	nbdBackendMaxBytes = len(NBDBackendPrefix) + 128 + 1 + nbdBackendRandHex
)

// checkNBDBackend accepts only mountplan's own form of backend
// identifier (see NBDBackendPrefix): a name another driver's devices
// cannot carry by accident, which ties a device to one connect.
func checkNBDBackend(b string) error {
	rest, ok := strings.CutPrefix(b, NBDBackendPrefix)
	i := strings.LastIndexByte(rest, ':')
	if !ok || len(b) > nbdBackendMaxBytes || i < 0 {
		return fmt.Errorf("NBD backend %q is not of the form %s<volume-id>:<%d hex digits>: %w", b, NBDBackendPrefix, nbdBackendRandHex, errdefs.ErrInvalidArgument)
	}
	id, random := rest[:i], rest[i+1:]
	if err := model.ValidID(id); err != nil {
		return fmt.Errorf("NBD backend %q: %w", b, err)
	}
	if len(random) != nbdBackendRandHex || strings.IndexFunc(random, func(r rune) bool { return !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f') }) >= 0 {
		return fmt.Errorf("NBD backend %q does not end in %d lower-case hex digits: %w", b, nbdBackendRandHex, errdefs.ErrInvalidArgument)
	}
	return nil
}

func nbdKey(backend string) string {
	sum := sha256.Sum256([]byte(backend))
	return hex.EncodeToString(sum[:16])
}

// checkNBDRequest bounds what reaches the kernel.
func checkNBDRequest(req NBDRequest) error {
	if err := checkNBDBackend(req.Backend); err != nil {
		return err
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("NBD request: "+format+": %w", append(args, errdefs.ErrInvalidArgument)...)
	}
	switch {
	case req.SizeBytes == 0 || req.SizeBytes > 1<<62:
		return bad("size %d", req.SizeBytes)
	case req.BlockSize != 0 && (req.BlockSize < 512 || req.BlockSize > uint64(os.Getpagesize()) || bits.OnesCount64(req.BlockSize) != 1):
		return bad("block size %d is not a power of two from 512 to the page size (%d)", req.BlockSize, os.Getpagesize())
	case req.ServerFlags > 0xffff:
		return bad("server flags %#x are more than the protocol's 16 bits", req.ServerFlags)
	case req.Timeout < 0 || req.Timeout > maxNBDTimeout, req.DeadConnTimeout < 0 || req.DeadConnTimeout > maxNBDTimeout:
		return bad("timeouts %v and %v must lie within 0 and %v", req.Timeout, req.DeadConnTimeout, maxNBDTimeout)
	}
	return nil
}

// checkNBDSocket accepts a connected stream socket: what the kernel can
// speak NBD over. Anything else (a file, a listening socket, a datagram
// socket) is refused before the kernel sees it.
func checkNBDSocket(sock *os.File) error {
	if sock == nil {
		return fmt.Errorf("NBD: no socket came with the request: %w", errdefs.ErrInvalidArgument)
	}
	rc, err := sock.SyscallConn()
	if err != nil {
		return fmt.Errorf("NBD socket: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		var st unix.Stat_t
		if cerr = unix.Fstat(int(fd), &st); cerr != nil {
			return
		}
		if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
			cerr = fmt.Errorf("not a socket (mode %#o)", st.Mode)
			return
		}
		typ, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TYPE)
		if err != nil || typ != unix.SOCK_STREAM {
			cerr = fmt.Errorf("not a stream socket (type %d, %v)", typ, err)
			return
		}
		if listening, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ACCEPTCONN); err != nil || listening != 0 {
			cerr = fmt.Errorf("a listening socket (%v)", err)
			return
		}
		if _, err := unix.Getpeername(int(fd)); err != nil {
			cerr = fmt.Errorf("not connected: %w", err)
		}
	}); err != nil {
		cerr = err
	}
	if cerr != nil {
		return fmt.Errorf("NBD socket: %w: %w", cerr, errdefs.ErrInvalidArgument)
	}
	return nil
}

// initNBD takes back the records of the NBD devices after a restart: a
// device the kernel still shows with its backend is held again (a connect
// a crash interrupted is found by its backend); records of another boot,
// and of devices no longer connected with their backend, are dropped. An
// observing node reads the records of this boot and writes nothing.
func (n *Local) initNBD(ctx context.Context) error {
	n.nbd.kernel = newNBDKernel()
	n.nbd.devs = map[string]nbdRecord{}
	dir := filepath.Join(n.opts.RecordsDir, "nbd")
	if n.opts.Observe {
		if _, err := os.Stat(dir); err != nil {
			return nil // nothing connected yet: nothing is trusted
		}
	}
	db, err := journal.OpenRecords[nbdRecord](dir, false)
	if err != nil {
		return err
	}
	n.nbd.db = db
	recs, err := db.List()
	var errs []error
	if err != nil {
		errs = append(errs, err)
	}
	for key, rec := range recs {
		if n.opts.Observe {
			if rec.Boot == n.records.boot && rec.Index >= 0 {
				n.nbd.devs[rec.Backend] = rec
			}
			continue
		}
		if key != nbdKey(rec.Backend) || rec.Boot != n.records.boot {
			errs = append(errs, db.Delete(key))
			continue
		}
		if rec.Index < 0 {
			// A connect under way when the last mounter died: the kernel
			// may have the device.
			rec.Index = n.nbd.kernel.FindBackend(rec.Backend)
			if rec.Index >= 0 {
				rec.Major, rec.Minor, err = n.nbd.kernel.DeviceNumber(rec.Index)
				if err == nil {
					errs = append(errs, db.Put(key, rec))
				}
			}
		}
		if rec.Index < 0 || !n.nbd.shows(rec) {
			klog.FromContext(ctx).Info("Dropping the record of an NBD device no longer connected with its backend", "index", rec.Index, "backend", rec.Backend)
			errs = append(errs, db.Delete(key))
			continue
		}
		n.nbd.devs[rec.Backend] = rec
	}
	return errors.Join(errs...)
}

// shows reports whether the kernel shows rec's device connected with
// rec's backend, at rec's device number.
func (s *nbdState) shows(rec nbdRecord) bool {
	if rec.Index < 0 || s.kernel.Backend(rec.Index) != rec.Backend {
		return false
	}
	major, minor, err := s.kernel.DeviceNumber(rec.Index)
	return err == nil && major == rec.Major && minor == rec.Minor
}

// ownsNBD reports whether major:minor is an NBD device the node connected
// and the kernel still shows connected with the backend it recorded: not
// any /dev/nbdN (another driver's rbd-nbd disk is one too), not a
// partition of one.
func (n *Local) ownsNBD(major, minor uint32) bool {
	if major != nbdMajor || n.nbd.kernel == nil {
		return false
	}
	n.nbd.mu.Lock()
	var rec *nbdRecord
	for _, r := range n.nbd.devs {
		if r.Index >= 0 && r.Major == major && r.Minor == minor {
			rec = &r
			break
		}
	}
	n.nbd.mu.Unlock()
	return rec != nil && n.nbd.shows(*rec)
}

func (s *nbdState) record(backend string) (nbdRecord, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.devs[backend]
	return r, ok
}

func (s *nbdState) put(rec nbdRecord) error {
	if err := s.db.Put(nbdKey(rec.Backend), rec); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.devs[rec.Backend] = rec
	return nil
}

func (s *nbdState) drop(backend string) error {
	s.mu.Lock()
	delete(s.devs, backend)
	s.mu.Unlock()
	return s.db.Delete(nbdKey(backend))
}

// prune drops the records of devices the kernel no longer shows with
// their backend (disconnected behind the mounter's back, or by the
// server's end with no dead-connection timeout).
func (s *nbdState) prune(ctx context.Context) {
	s.mu.Lock()
	recs := make([]nbdRecord, 0, len(s.devs))
	for _, r := range s.devs {
		recs = append(recs, r)
	}
	s.mu.Unlock()
	for _, r := range recs {
		if r.Index >= 0 && !s.shows(r) {
			klog.FromContext(ctx).Info("Forgetting an NBD device no longer connected with its backend", "index", r.Index, "backend", r.Backend)
			if err := s.drop(r.Backend); err != nil {
				klog.FromContext(ctx).Error(err, "Dropping the record of an NBD device")
			}
		}
	}
}

func (n *Local) nbdWritable() error {
	if n.opts.Observe || n.nbd.db == nil {
		return fmt.Errorf("NBD: this mounter only observes the records of another: %w", errdefs.ErrFailedPrecondition)
	}
	return nil
}

// ConnectNBD hands sock, in the transmission phase of an export the
// plugin negotiated, to the kernel as the one connection of a free NBD
// device, and records the device with req.Backend before and after.
func (n *Local) ConnectNBD(ctx context.Context, req NBDRequest, sock *os.File) (Device, error) {
	if err := n.nbdWritable(); err != nil {
		return Device{}, err
	}
	if err := checkNBDRequest(req); err != nil {
		return Device{}, err
	}
	if err := checkNBDSocket(sock); err != nil {
		return Device{}, err
	}
	s := &n.nbd
	s.op.Lock()
	defer s.op.Unlock()
	s.prune(ctx)
	if _, ok := s.record(req.Backend); ok {
		return Device{}, fmt.Errorf("NBD backend %s is connected already: %w", req.Backend, errdefs.ErrAlreadyExists)
	}
	if i := s.kernel.FindBackend(req.Backend); i >= 0 {
		return Device{}, fmt.Errorf("nbd%d shows backend %s, which the mounter did not connect: %w", i, req.Backend, errdefs.ErrAlreadyExists)
	}
	if err := n.nbdRoom(); err != nil {
		return Device{}, err
	}
	rec := nbdRecord{Backend: req.Backend, Index: -1, SizeBytes: req.SizeBytes, ReadOnly: req.ServerFlags&nbdnl.FlagReadOnly != 0,
		DeadConnTimeout: req.DeadConnTimeout, Connected: time.Now(), Boot: n.records.boot}
	// The intent: a mounter that dies during the connect finds the device
	// by its backend when it starts again.
	if err := s.put(rec); err != nil {
		return Device{}, err
	}
	index, err := s.kernel.Connect(nbdnl.Config{Index: -1, SizeBytes: req.SizeBytes, BlockSize: req.BlockSize, ServerFlags: req.ServerFlags,
		Timeout: req.Timeout, DeadConnTimeout: req.DeadConnTimeout, Backend: req.Backend}, []*os.File{sock})
	if err != nil {
		return Device{}, errors.Join(err, s.drop(req.Backend))
	}
	rec.Index = index
	rec.Major, rec.Minor, err = s.kernel.DeviceNumber(index)
	if err == nil && s.kernel.Backend(index) != req.Backend {
		err = fmt.Errorf("the kernel connected nbd%d but shows no backend identifier (Linux 5.13 or later is needed): %w", index, errdefs.ErrFailedPrecondition)
	}
	if err == nil {
		err = s.put(rec)
	}
	if err != nil {
		return Device{}, errors.Join(err, s.kernel.Disconnect(index), s.drop(req.Backend))
	}
	klog.FromContext(ctx).V(2).Info("NBD device connected", "device", rec.device().Path, "backend", rec.Backend, "size", rec.SizeBytes)
	return rec.device(), nil
}

// defaultNBDs is the nbd module's own default of nbds_max.
const defaultNBDs = 16

// nbdRoom is ResourceExhausted when the mounter has as many NBD devices
// connected as it may: Options.MaxNBD, else the devices the nbd module
// was loaded to offer (nbds_max: a connect over netlink would add devices
// past them on demand, so the kernel bounds nothing), else the module's
// default. The caller holds s.op, so no connect is under way meanwhile.
func (n *Local) nbdRoom() error {
	limit := n.opts.MaxNBD
	if limit <= 0 {
		limit = defaultNBDs
		b, err := os.ReadFile("/sys/module/nbd/parameters/nbds_max")
		if v, perr := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && perr == nil && v > 0 {
			limit = v
		}
	}
	n.nbd.mu.Lock()
	held := len(n.nbd.devs)
	n.nbd.mu.Unlock()
	if held >= limit {
		return fmt.Errorf("the mounter has %d NBD devices connected, its limit of %d (mountplan-sidecar serve --max-nbd-devices raises it): %w",
			held, limit, errdefs.ErrResourceExhausted)
	}
	return nil
}

// connected returns the record of backend if the kernel still shows its
// device with it, and dev (when not zero) names that device.
func (s *nbdState) connected(dev Device, backend string) (nbdRecord, error) {
	rec, ok := s.record(backend)
	if !ok || rec.Index < 0 {
		return rec, fmt.Errorf("NBD backend %q is not a device the mounter connected: %w", backend, errdefs.ErrNotFound)
	}
	if dev != (Device{}) && (dev.Major != rec.Major || dev.Minor != rec.Minor) {
		return rec, fmt.Errorf("%s (%d:%d) is not the device the mounter connected with backend %s (%s): %w",
			dev.Path, dev.Major, dev.Minor, backend, rec.device().Path, errdefs.ErrPermissionDenied)
	}
	if !s.shows(rec) {
		return rec, fmt.Errorf("%s is no longer connected with backend %s: %w", rec.device().Path, backend, errdefs.ErrNotFound)
	}
	return rec, nil
}

// ReconnectNBD gives the device connected with backend sock in place of
// its dead connection. The kernel compares the backend itself, and drops
// a socket while the old connection lives.
func (n *Local) ReconnectNBD(ctx context.Context, dev Device, backend string, sock *os.File) error {
	if err := n.nbdWritable(); err != nil {
		return err
	}
	if err := checkNBDBackend(backend); err != nil {
		return err
	}
	if err := checkNBDSocket(sock); err != nil {
		return err
	}
	s := &n.nbd
	s.op.Lock()
	defer s.op.Unlock()
	rec, err := s.connected(dev, backend)
	if err != nil {
		return err
	}
	if err := s.kernel.ReconfigureBackend(rec.Index, backend, []*os.File{sock}, rec.DeadConnTimeout); err != nil {
		return err
	}
	klog.FromContext(ctx).V(2).Info("NBD device given a new connection", "device", rec.device().Path, "backend", backend)
	return nil
}

// DisconnectNBD disconnects the device connected with backend (dev, when
// not zero, must be it) and forgets it. A backend the mounter has no
// record of is no error: it disconnected it already, or never connected
// it, and touches nothing then.
func (n *Local) DisconnectNBD(ctx context.Context, dev Device, backend string) error {
	if err := n.nbdWritable(); err != nil {
		return err
	}
	if err := checkNBDBackend(backend); err != nil {
		return err
	}
	s := &n.nbd
	s.op.Lock()
	defer s.op.Unlock()
	log := klog.FromContext(ctx)
	rec, err := s.connected(dev, backend)
	switch {
	case errors.Is(err, errdefs.ErrPermissionDenied):
		return err
	case err != nil && rec.Backend == "":
		log.V(2).Info("No NBD device of this backend; nothing to disconnect", "backend", backend)
		return nil
	case err != nil:
		log.V(2).Info("NBD device no longer connected with its backend; forgetting it", "device", rec.device().Path, "backend", backend)
		return s.drop(backend)
	}
	if err := s.kernel.Disconnect(rec.Index); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	// The kernel lets the device go once nothing has it open; wait a
	// little so that the caller sees it gone.
	gone := func(context.Context) (bool, error) { return s.kernel.Backend(rec.Index) != backend, nil }
	if wait.PollUntilContextTimeout(ctx, 10*time.Millisecond, nbdDisconnectWait, true, gone) != nil {
		log.Info("NBD device disconnected, but something still holds it open; the kernel lets it go when that closes it", "device", rec.device().Path)
		return s.drop(backend)
	}
	log.V(2).Info("NBD device disconnected", "device", rec.device().Path, "backend", backend)
	return s.drop(backend)
}
