package nbd

import (
	"context"
	"encoding/binary"
	"net"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/mountplan/mountplan/internal/errdefs"
	"github.com/mountplan/mountplan/internal/source/internal/bytesrvtest"
)

// serverBytes builds what a server sends: the greeting, then replies.
func serverBytes(flags uint16, replies ...[]byte) []byte {
	b := binary.BigEndian.AppendUint64(nil, magicInit)
	b = binary.BigEndian.AppendUint64(b, magicOpt)
	b = binary.BigEndian.AppendUint16(b, flags)
	for _, r := range replies {
		b = append(b, r...)
	}
	return b
}

func replyBytes(opt, typ uint32, data []byte) []byte {
	b := binary.BigEndian.AppendUint64(nil, magicReply)
	b = binary.BigEndian.AppendUint32(b, opt)
	b = binary.BigEndian.AppendUint32(b, typ)
	b = binary.BigEndian.AppendUint32(b, uint32(len(data)))
	return append(b, data...)
}

func infoBytes(size uint64, txFlags uint16) []byte {
	d := binary.BigEndian.AppendUint16(nil, infoExport)
	d = binary.BigEndian.AppendUint64(d, size)
	return binary.BigEndian.AppendUint16(d, txFlags)
}

// FuzzHandshake plays a server that sends the fuzzer's bytes, whatever the
// client says, to Probe and List. Neither may panic, hang past its
// timeout or report what a server cannot mean (a negative size); every
// error wraps a sentinel, so it reaches the CO with a real code.
func FuzzHandshake(f *testing.F) {
	name := binary.BigEndian.AppendUint32(nil, 4)
	f.Add(serverBytes(flagFixedNew|flagNoZeroes, replyBytes(optInfo, repInfo, infoBytes(1<<30, 0)), replyBytes(optInfo, repAck, nil)))
	f.Add(serverBytes(flagFixedNew, replyBytes(optInfo, repInfo, infoBytes(1<<63, txFlagReadOnly)), replyBytes(optInfo, repAck, nil)))
	f.Add(serverBytes(flagFixedNew, replyBytes(optInfo, repErrUnknown, []byte("no such export\x00\x1b[31m"))))
	f.Add(serverBytes(flagFixedNew, replyBytes(optInfo, repErrTLSReqd, nil)))
	f.Add(serverBytes(flagFixedNew, replyBytes(optList, repServer, append(name, "disk"...)), replyBytes(optList, repAck, nil)))
	f.Add(serverBytes(flagFixedNew, replyBytes(optList, repServer, binary.BigEndian.AppendUint32(nil, 1<<31))))
	f.Add(serverBytes(0))
	f.Add([]byte("NBDMAGIC"))

	sock := filepath.Join(f.TempDir(), "nbd.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		f.Fatal(err)
	}
	srv := bytesrvtest.Serve(f, l)
	d := Dialer{Network: "unix", Address: sock, Timeout: 2 * time.Second}
	f.Fuzz(func(t *testing.T, data []byte) {
		srv.Set(data)
		exp, err := d.Probe(context.Background(), "disk")
		checkErr(t, "Probe", err)
		if exp.Size < 0 {
			t.Fatalf("Probe reports a negative size %d", exp.Size)
		}
		names, err := d.List(context.Background())
		checkErr(t, "List", err)
		for _, n := range names {
			if len(n) > maxReplyLength {
				t.Fatalf("List returned a name of %d bytes", len(n))
			}
		}
	})
}

func checkErr(t *testing.T, what string, err error) {
	t.Helper()
	if c := errdefs.Code(err); c == codes.Internal || c == codes.DeadlineExceeded {
		t.Fatalf("%s: %v (code %v): every failure must wrap a sentinel and end before the timeout", what, err, c)
	}
}
