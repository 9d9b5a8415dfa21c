package ctlserver

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/tier"
)

// rangesEnv is a server with a memory tier (64 KiB extents, no settle
// wait) and an engine that writes every aligned body with O_DIRECT, so
// that hostile PIN, READ and WRITE ranges reach the tier, its hits and the
// direct write path.
func rangesEnv(tb testing.TB) (*testEnv, *tier.Tier) {
	tb.Helper()
	be, err := gpubuf.NewHostBackend(gpubuf.HostBackendOptions{Dir: filepath.Join(tb.TempDir(), "slabs")})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { be.Close() })
	pool, err := gpubuf.NewPool(gpubuf.Config{Backend: be, SlabBytes: 1 << 20, BudgetBytes: 8 << 20, UIDShareBytes: 8 << 20})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { pool.Close() })
	tr, err := tier.New(tier.Config{BudgetBytes: 1 << 20, UIDShareBytes: 512 << 10, ChunkBytes: 64 << 10, SettleTime: -1})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { tr.Close() })
	eng := cufile.NewHostEngine(cufile.Options{ChunkBytes: 64 << 10, Workers: 2, Direct: "always"})
	srv, err := NewServer(Options{Pool: pool, Engines: fixedEngine{eng}, Engine: "host", Version: "test", Tier: tr, TierCopier: tier.HostCopier{}})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { srv.Close() })
	return &testEnv{t: tb, srv: srv, pool: pool, dir: tb.TempDir()}, tr
}

// FuzzRanges sends PIN, UNPIN, READ and WRITE with arbitrary offsets,
// lengths and flags, as uid 1000 or 1001, against a file the tier may hold
// and a file to write (the backing file is the oracle). The server must
// not panic, a WRITE it accepts must leave exactly the lease's bytes at the
// offset, a READ it accepts must return the file's bytes (from the tier or
// the engine), and afterwards the pool holds no lease and the tier no more
// than its budget and each uid's share.
func FuzzRanges(f *testing.F) {
	const dataBytes, leaseBytes = 300 << 10, 192 << 10
	for _, s := range []struct {
		op               uint8
		off, n, leaseOff uint64
		flags            uint32
		other            bool
	}{
		{0, 0, 1 << 62, 0, 0, false},         // pin the whole file
		{0, 64 << 10, 64 << 10, 0, 0, true},  // pin one extent as another uid
		{0, 1 << 63, 1, 0, 0, false},         // offset past int64
		{0, dataBytes + 1, 1, 0, 0, false},   // past the end
		{1, 0, 0, 0, ctl.PinUnpin, true},     // unpin
		{2, 5, 200 << 10, 0, 0, false},       // read across extents
		{2, 1<<64 - 10, 20, 0, 0, false},     // overflowing range
		{3, 4096, 128 << 10, 4096, 0, false}, // aligned direct write
		{3, 100, 100 << 10, 7, ctl.WriteSync, false},
		{3, 1<<63 - 1, 2, 0, 0, false},                  // write past the largest offset
		{3, 0, leaseBytes + 1, 0, 0, false},             // longer than the lease
		{3, 0, 1, 1<<64 - 1, 0, false},                  // lease offset overflowing
		{3, 1 << 40, 4096, 0, 0, false},                 // far past the end: a sparse file
		{2, 5, 9000, 0, ctl.ReadFlagVersion, false},     // a READ at the file's version
		{2, 5, 9000, 77, ctl.ReadFlagVersion | 2, true}, // at another version: ESTALE
	} {
		f.Add(s.op, s.off, s.n, s.leaseOff, s.flags, s.other)
	}
	e, tr := rangesEnv(f)
	data, content := e.file("data", dataBytes, os.O_RDONLY)
	version, errno := fileVersion(data)
	if errno != 0 {
		f.Fatal(errno)
	}
	out, _ := e.file("out", 64<<10, os.O_RDWR)
	fill := make([]byte, leaseBytes)
	for i := range fill {
		fill[i] = byte(i*13 + 5)
	}
	f.Fuzz(func(t *testing.T, op uint8, off, n, leaseOff uint64, flags uint32, other bool) {
		ctx := context.Background()
		uid := uint32(1000)
		if other {
			uid = 1001
		}
		c := fs.Caller{UID: uid, GID: uid, PID: 1}
		sess, errno := e.srv.OpenSession(ctx, c)
		if errno != 0 {
			t.Fatal(errno)
		}
		cl, err := ctl.NewTransportClient(ctx, &inproc{srv: e.srv, sess: sess, caller: c}, ctl.Token{})
		if err != nil {
			t.Fatal(err)
		}
		tok := cl.Token()
		var (
			cmd  uint32
			file = data
			in   []byte
			l    ctl.Lease
		)
		switch op % 4 {
		case 0, 1:
			cmd, in = ctl.CmdPin, make([]byte, ctl.SizePin)
			if op%4 == 1 {
				flags |= ctl.PinUnpin
			}
			(&ctl.PinRequest{Offset: off, Length: n, Flags: flags}).Encode(in)
		case 2:
			cmd, in = ctl.CmdRead, make([]byte, ctl.SizeRead)
			req := ctl.ReadRequest{Token: tok, Device: ctl.HostDevice, Ranges: []ctl.Range{{Offset: off, Length: n}}}
			if flags&1 != 0 { // a versioned READ: the file's version, or leaseOff's (ESTALE unless equal)
				if req.Version = leaseOff; flags&2 == 0 {
					req.Version = version
				}
			}
			req.Encode(in)
		case 3:
			if l, err = cl.Alloc(ctx, ctl.HostDevice, leaseBytes); err != nil {
				t.Fatal(err)
			}
			b, err := cl.Bytes(ctx, l)
			if err != nil {
				t.Fatal(err)
			}
			copy(b, fill)
			cmd, file, in = ctl.CmdWrite, out, make([]byte, ctl.SizeWrite)
			(&ctl.WriteRequest{Token: tok, Lease: l.ID, LeaseOffset: leaseOff, FileOffset: off, Length: n, Flags: flags}).Encode(in)
		}
		reply := make([]byte, len(in))
		_, errno = e.srv.FileIoctl(ctx, c, file, file.Name(), cmd, in, reply)
		switch {
		case errno != 0:
		case cmd == ctl.CmdPin:
			r, err := ctl.DecodePinReply(reply)
			if err != nil || r.Size != dataBytes || r.Cached > dataBytes || r.Filled > r.Cached {
				t.Fatalf("PIN %d+%d flags %#x: %+v, %v", off, n, flags, r, err)
			}
		case cmd == ctl.CmdRead:
			if v := le.Uint64(in[48:]); v != 0 && v != version {
				t.Fatalf("READ at version %#x of a file at %#x accepted", v, version)
			}
			r, err := ctl.DecodeReadReply(reply)
			if err != nil || len(r.Leases) != 1 {
				t.Fatalf("READ %d+%d: %+v, %v", off, n, r, err)
			}
			cl.Adopt(r.Leases...)
			got, err := cl.Bytes(ctx, r.Leases[0])
			end := min(off+n, dataBytes)
			if r.Leases[0].Valid == 0 {
				got, err = nil, nil
			}
			if err != nil || !bytes.Equal(got, content[off:end]) {
				t.Fatalf("READ %d+%d (engine %v): %d bytes, equal to the file %v, %v", off, n, r.Leases[0].Engine, len(got), bytes.Equal(got, content[off:end]), err)
			}
		case cmd == ctl.CmdWrite:
			if leaseOff+n > leaseBytes {
				t.Fatalf("WRITE of %d bytes at lease offset %d of a %d-byte lease accepted", n, leaseOff, leaseBytes)
			}
			got := make([]byte, n)
			if _, err := out.ReadAt(got, int64(off)); err != nil || !bytes.Equal(got, fill[leaseOff:leaseOff+n]) {
				t.Fatalf("WRITE %d+%d from lease offset %d: the file does not hold the lease's bytes (%v)", off, n, leaseOff, err)
			}
		}
		if err := out.Truncate(64 << 10); err != nil {
			t.Fatal(err)
		}
		cl.Close()
		if n, b := e.leased(); n != 0 || b != 0 {
			t.Fatalf("op %d: pool holds %d leases (%d bytes) after the session closed", op, n, b)
		}
		st := tr.Stats()
		if st.UsedBytes > st.BudgetBytes || st.CachedBytes > st.UsedBytes {
			t.Fatalf("tier: %d used of %d, %d cached", st.UsedBytes, st.BudgetBytes, st.CachedBytes)
		}
		for _, u := range st.UIDs {
			if u.Bytes > st.UIDShareBytes || u.Bytes <= 0 {
				t.Fatalf("tier: uid %d holds %d of its %d share", u.UID, u.Bytes, st.UIDShareBytes)
			}
		}
	})
}
