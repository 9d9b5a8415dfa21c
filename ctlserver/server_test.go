package ctlserver

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/rs/zerolog"
)

// fixedEngine answers every file with one engine.
type fixedEngine struct{ e cufile.Engine }

func (c fixedEngine) Choose(*os.File, string, int64, int64) (cufile.Engine, string) {
	return c.e, "test: fixed engine"
}

// testEnv is a Server over a host pool and a directory of files, driven
// in process (no FUSE): what fs would do, minus the kernel.
type testEnv struct {
	t    testing.TB
	srv  *Server
	pool *gpubuf.Pool
	dir  string
}

type envOptions struct {
	slabBytes, budgetBytes int64
	readOnly               bool
	noIndexes              bool
}

func newEnv(t testing.TB, o envOptions) *testEnv {
	t.Helper()
	be, err := gpubuf.NewHostBackend(gpubuf.HostBackendOptions{Dir: filepath.Join(t.TempDir(), "slabs")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	pool, err := gpubuf.NewPool(gpubuf.Config{Backend: be, SlabBytes: o.slabBytes, BudgetBytes: o.budgetBytes, UIDShareBytes: o.budgetBytes})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pool.Close() })
	opts := Options{Pool: pool, Engines: fixedEngine{cufile.NewHostEngine(cufile.Options{ChunkBytes: 64 << 10, Workers: 4})}, Engine: "host", ReadOnly: o.readOnly, Version: "test"}
	if !o.noIndexes {
		ix, err := cache.NewIndexes(16<<20, zerolog.Nop())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ix.Close)
		opts.Indexes = ix
	}
	srv, err := NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return &testEnv{t: t, srv: srv, pool: pool, dir: t.TempDir()}
}

// le is the wire's byte order, for tests that poke at raw buffers.
var le = binary.LittleEndian

// inproc is a transport that calls the Server directly, copying buffers in
// and out the way the kernel does.
type inproc struct {
	srv    *Server
	sess   fs.Session
	caller fs.Caller
}

func (p *inproc) Control(ctx context.Context, cmd uint32, buf []byte) error {
	in := bytes.Clone(buf)
	out := make([]byte, len(buf))
	if _, errno := p.sess.Ioctl(ctx, p.caller, cmd, in, out); errno != 0 {
		return errno
	}
	copy(buf, out)
	return nil
}

func (p *inproc) File(ctx context.Context, f *os.File, cmd uint32, buf []byte) error {
	in := bytes.Clone(buf)
	out := make([]byte, len(buf))
	if _, errno := p.srv.FileIoctl(ctx, p.caller, f, f.Name(), cmd, in, out); errno != 0 {
		return errno
	}
	copy(buf, out)
	return nil
}

func (p *inproc) Close() error { return p.sess.Close() }

// client opens a session as uid and returns its client; attach != zero
// acts on that session instead.
func (e *testEnv) client(uid uint32, attach ctl.Token) *ctl.Client {
	e.t.Helper()
	c := fs.Caller{UID: uid, GID: uid, PID: 1}
	sess, errno := e.srv.OpenSession(context.Background(), c)
	if errno != 0 {
		e.t.Fatal(errno)
	}
	cl, err := ctl.NewTransportClient(context.Background(), &inproc{srv: e.srv, sess: sess, caller: c}, attach)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { cl.Close() })
	return cl
}

// file writes a file of n random bytes and opens it with flag.
func (e *testEnv) file(name string, n int, flag int) (*os.File, []byte) {
	e.t.Helper()
	data := make([]byte, n)
	r := rand.New(rand.NewPCG(uint64(n), 7))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	p := filepath.Join(e.dir, name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		e.t.Fatal(err)
	}
	f, err := os.OpenFile(p, flag, 0)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { f.Close() })
	return f, data
}

// leased is the pool's count of leased bytes over all devices.
func (e *testEnv) leased() (leases int, bytes int64) {
	for _, d := range e.pool.Stats().Devices {
		leases += d.Leases
		bytes += d.LeasedBytes
	}
	return leases, bytes
}

func (e *testEnv) checkIdle() {
	e.t.Helper()
	if n, b := e.leased(); n != 0 || b != 0 {
		e.t.Errorf("pool holds %d leases (%d bytes), want none", n, b)
	}
}

// checkLeases compares every lease's bytes with data.
func checkLeases(t *testing.T, cl *ctl.Client, ranges []ctl.Range, ls []ctl.Lease, data []byte) {
	t.Helper()
	if len(ls) != len(ranges) {
		t.Fatalf("%d leases for %d ranges", len(ls), len(ranges))
	}
	for i, r := range ranges {
		l := ls[i]
		end := min(r.Offset+r.Length, uint64(len(data)))
		want := data[r.Offset:end]
		if l.Length != r.Length || l.Valid != uint64(len(want)) {
			t.Errorf("range %d %+v: lease length %d valid %d, want %d, %d", i, r, l.Length, l.Valid, r.Length, len(want))
			continue
		}
		if l.Valid == 0 {
			if l.ID != 0 {
				t.Errorf("range %d %+v: empty range holds lease %d", i, r, l.ID)
			}
			continue
		}
		if l.Engine != ctl.EngineHost {
			t.Errorf("range %d: engine %v, want host", i, l.Engine)
		}
		got, err := cl.Bytes(context.Background(), l)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("range %d %+v: bytes differ from pread", i, r)
		}
	}
}

func TestReadByteExact(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 64 << 20})
	cl := e.client(1000, ctl.Token{})
	for _, size := range []int{0, 1, 4095, 4096, 4097, 3<<20 + 123} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			f, data := e.file(fmt.Sprintf("f%d", size), size, os.O_RDONLY)
			ranges := []ctl.Range{{Offset: 0, Length: uint64(size)}, {Offset: 0, Length: 1}, {Offset: uint64(size), Length: 10}, {Offset: 0, Length: uint64(size) + 4096}}
			r := rand.New(rand.NewPCG(uint64(size), 1))
			for range 40 {
				off := r.Uint64N(uint64(size) + 1)
				ranges = append(ranges, ctl.Range{Offset: off, Length: r.Uint64N(uint64(size)-off+5000) + 0})
			}
			ls, err := cl.Read(context.Background(), f, ctl.HostDevice, ranges)
			if err != nil {
				t.Fatal(err)
			}
			checkLeases(t, cl, ranges, ls, data)
			var ids []uint64
			for _, l := range ls {
				if l.ID != 0 {
					ids = append(ids, l.ID)
				}
			}
			if err := cl.Release(context.Background(), ids...); err != nil {
				t.Fatal(err)
			}
			e.checkIdle()
		})
	}
}

// More ranges than one request carries: the client splits them.
func TestReadManyRanges(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 4 << 20, budgetBytes: 64 << 20})
	cl := e.client(1000, ctl.Token{})
	f, data := e.file("many", 1<<20, os.O_RDONLY)
	var ranges []ctl.Range
	for i := range 3*ctl.MaxRanges + 7 {
		ranges = append(ranges, ctl.Range{Offset: uint64(i * 997 % (1 << 20)), Length: uint64(i%300 + 1)})
	}
	ls, err := cl.Read(context.Background(), f, ctl.HostDevice, ranges)
	if err != nil {
		t.Fatal(err)
	}
	checkLeases(t, cl, ranges, ls, data)
}

// rawFile issues one data-file command with a hand-built buffer.
func (e *testEnv) rawFile(uid uint32, f *os.File, cmd uint32, buf []byte) syscall.Errno {
	out := make([]byte, len(buf))
	_, errno := e.srv.FileIoctl(context.Background(), fs.Caller{UID: uid}, f, f.Name(), cmd, buf, out)
	copy(buf, out)
	return errno
}

func readBuf(tok ctl.Token, dev int32, ranges ...ctl.Range) []byte {
	b := make([]byte, ctl.SizeRead)
	(&ctl.ReadRequest{Token: tok, Device: dev, Ranges: ranges}).Encode(b)
	return b
}

// Every refusal docs/protocol.md lists, and the daemon still right after.
func TestRefusals(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 2 << 20})
	cl := e.client(1000, ctl.Token{})
	tok := cl.Token()
	f, data := e.file("data", 100000, os.O_RDONLY)
	dir, err := os.Open(e.dir)
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	ctx := context.Background()

	for _, tc := range []struct {
		name string
		uid  uint32
		f    *os.File
		cmd  uint32
		buf  []byte
		want syscall.Errno
	}{
		{"other uid's token", 1001, f, ctl.CmdRead, readBuf(tok, -1, ctl.Range{Offset: 0, Length: 1}), syscall.EPERM},
		{"root with another uid's token", 0, f, ctl.CmdRead, readBuf(tok, -1, ctl.Range{Offset: 0, Length: 1}), syscall.EPERM},
		{"wrong secret", 1000, f, ctl.CmdRead, readBuf(ctl.Token{Session: tok.Session, Secret: tok.Secret + 1}, -1, ctl.Range{Offset: 0, Length: 1}), syscall.EPERM},
		{"unknown session", 1000, f, ctl.CmdRead, readBuf(ctl.Token{Session: tok.Session + 100, Secret: tok.Secret}, -1, ctl.Range{Offset: 0, Length: 1}), syscall.EPERM},
		{"no token", 1000, f, ctl.CmdRead, readBuf(ctl.Token{}, -1, ctl.Range{Offset: 0, Length: 1}), syscall.EPERM},
		{"offset past EOF", 1000, f, ctl.CmdRead, readBuf(tok, -1, ctl.Range{Offset: 100001, Length: 1}), syscall.EINVAL},
		{"offset overflows", 1000, f, ctl.CmdRead, readBuf(tok, -1, ctl.Range{Offset: 1<<63 - 1, Length: 2}), syscall.ERANGE},
		{"offset >= 2^63", 1000, f, ctl.CmdRead, readBuf(tok, -1, ctl.Range{Offset: 1 << 63, Length: 0}), syscall.ERANGE},
		{"length >= 2^63", 1000, f, ctl.CmdRead, readBuf(tok, -1, ctl.Range{Offset: 0, Length: 1 << 63}), syscall.ERANGE},
		{"GPU device in host mode", 1000, f, ctl.CmdRead, readBuf(tok, 0, ctl.Range{Offset: 0, Length: 1}), syscall.ENODEV},
		{"unknown command", 1000, f, ctl.CmdRead + 0x20, readBuf(tok, -1, ctl.Range{Offset: 0, Length: 1}), syscall.ENOTTY},
		{"control command on data file", 1000, f, ctl.CmdRelease, make([]byte, ctl.SizeRelease), syscall.ENOTTY},
		{"read on a directory", 1000, dir, ctl.CmdRead, readBuf(tok, -1, ctl.Range{Offset: 0, Length: 1}), syscall.ENOTTY},
		{"bad magic", 1000, f, ctl.CmdRead, func() []byte { b := readBuf(tok, -1, ctl.Range{Offset: 0, Length: 1}); b[0] = 0; return b }(), syscall.EINVAL},
		{"version 9", 1000, f, ctl.CmdRead, func() []byte { b := readBuf(tok, -1, ctl.Range{Offset: 0, Length: 1}); b[4] = 9; return b }(), syscall.EPROTO},
		{"257 ranges", 1000, f, ctl.CmdRead, func() []byte {
			b := readBuf(tok, -1, ctl.Range{Offset: 0, Length: 1})
			le.PutUint32(b[40:], 257)
			return b
		}(), syscall.E2BIG},
		{"range larger than the pool", 1000, f, ctl.CmdRead, readBuf(tok, -1, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}, ctl.Range{Offset: 0, Length: 100000}), syscall.E2BIG},
		{"write on a read-only descriptor", 1000, f, ctl.CmdWrite, func() []byte {
			b := make([]byte, ctl.SizeWrite)
			(&ctl.WriteRequest{Token: tok, Lease: 1, Length: 1}).Encode(b)
			return b
		}(), syscall.EBADF},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := e.rawFile(tc.uid, tc.f, tc.cmd, tc.buf); got != tc.want {
				t.Errorf("got %v, want %v", got, tc.want)
			}
		})
	}

	// Control-file refusals.
	ctlRaw := func(uid uint32, cmd uint32, buf []byte) syscall.Errno {
		sess, _ := e.srv.OpenSession(ctx, fs.Caller{UID: 1000})
		defer sess.Close()
		out := make([]byte, len(buf))
		_, errno := sess.Ioctl(ctx, fs.Caller{UID: uid}, cmd, buf, out)
		return errno
	}
	hello := make([]byte, ctl.SizeHello)
	ctl.EncodeHello(hello)
	if got := ctlRaw(1000, ctl.CmdRead, readBuf(tok, -1, ctl.Range{Offset: 0, Length: 1})); got != syscall.ENOTTY {
		t.Errorf("READ on control file: %v, want ENOTTY", got)
	}
	if got := ctlRaw(1001, ctl.CmdHello, hello); got != syscall.EPERM {
		t.Errorf("HELLO by another uid on a passed descriptor: %v, want EPERM", got)
	}
	if got := ctlRaw(1000, 0x5401, nil); got != syscall.ENOTTY {
		t.Errorf("TCGETS on control file: %v, want ENOTTY", got)
	}
	slab := make([]byte, ctl.SizeSlab)
	(&ctl.SlabRequest{Slab: 999}).Encode(slab)
	if got := ctlRaw(1000, ctl.CmdSlab, slab); got != syscall.ENOENT {
		t.Errorf("SLAB of unknown slab: %v, want ENOENT", got)
	}

	// Pool exhaustion: EAGAIN, at once; release makes room again.
	var held []ctl.Lease
	for {
		ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 100000}})
		if errors.Is(err, syscall.EAGAIN) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, ls...)
		if len(held) > 100 {
			t.Fatal("pool never ran out")
		}
	}
	// A session of the same uid must not map another session's slab.
	other := e.client(1000, ctl.Token{})
	if _, err := other.Slab(ctx, held[0].Slab); !errors.Is(err, syscall.EPERM) {
		t.Errorf("SLAB of another session's slab: %v, want EPERM", err)
	}
	for _, l := range held {
		if err := cl.Release(ctx, l.ID); err != nil {
			t.Fatal(err)
		}
	}
	if err := cl.Release(ctx, held[0].ID); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("double release: %v, want ENOENT", err)
	}
	e.checkIdle()
	ls, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 5, Length: 70000}})
	if err != nil {
		t.Fatalf("read after refusals: %v", err)
	}
	checkLeases(t, cl, []ctl.Range{{Offset: 5, Length: 70000}}, ls, data)
}

func TestReadOnlyMount(t *testing.T) {
	e := newEnv(t, envOptions{readOnly: true})
	cl := e.client(1000, ctl.Token{})
	if cl.Hello().Caps&ctl.CapWrite != 0 {
		t.Error("read-only server advertises CapWrite")
	}
	if _, err := cl.Alloc(context.Background(), ctl.HostDevice, 4096); !errors.Is(err, syscall.EROFS) {
		t.Errorf("ALLOC: %v, want EROFS", err)
	}
	f, _ := e.file("w", 10, os.O_RDWR)
	err := cl.Write(context.Background(), f, ctl.Lease{ID: 1}, 0, 0, 1, false)
	if !errors.Is(err, syscall.EROFS) {
		t.Errorf("WRITE: %v, want EROFS", err)
	}
}

func TestAllocWrite(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20})
	cl := e.client(1000, ctl.Token{})
	ctx := context.Background()
	f, _ := e.file("ckpt", 0, os.O_RDWR)
	const n = 3<<20 + 17 // larger than a slab: a dedicated one
	l, err := cl.Alloc(ctx, ctl.HostDevice, n)
	if err != nil {
		t.Fatal(err)
	}
	if l.Length != n || l.Valid != n {
		t.Fatalf("ALLOC lease %+v", l)
	}
	b, err := cl.Bytes(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	for i := range b {
		b[i] = byte(i * 31)
	}
	if err := cl.Write(ctx, f, l, 0, 0, n, true); err != nil {
		t.Fatal(err)
	}
	// A piece of the lease at an unaligned file offset.
	if err := cl.Write(ctx, f, l, 5, n+3, 1000, false); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	want := append(bytes.Clone(b), 0, 0, 0)
	want = append(want, b[5:1005]...)
	if !bytes.Equal(got, want) {
		t.Errorf("file holds %d bytes, not the lease's", len(got))
	}
	for _, tc := range []struct {
		name              string
		lease             ctl.Lease
		leaseOff, fileOff int64
		length            int64
		want              syscall.Errno
	}{
		{"beyond the lease", l, 1, 0, n, syscall.EINVAL},
		{"unknown lease", ctl.Lease{ID: l.ID + 1000}, 0, 0, 1, syscall.ENOENT},
		{"file offset overflows", l, 0, 1<<63 - 1, 2, syscall.ERANGE},
	} {
		if err := cl.Write(ctx, f, tc.lease, tc.leaseOff, tc.fileOff, tc.length, false); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	// Another session cannot write from this one's lease.
	other := e.client(1000, ctl.Token{})
	if err := other.Write(ctx, f, l, 0, 0, 1, false); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("write from another session's lease: %v, want ENOENT", err)
	}
}

// Leases die with the session; an attached client's leases belong to the
// session it attached to.
func TestSessionLifetime(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20})
	ctx := context.Background()
	owner := e.client(1000, ctl.Token{})
	f, data := e.file("d", 50000, os.O_RDONLY)

	worker := e.client(1000, owner.Token())
	ls, err := worker.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 10, Length: 40000}})
	if err != nil {
		t.Fatal(err)
	}
	worker.Close() // the worker exits; its lease lives on in owner's session
	owner.Adopt(ls...)
	checkLeases(t, owner, []ctl.Range{{Offset: 10, Length: 40000}}, ls, data)

	if _, err := (e.client(1001, owner.Token())).Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 1}}); !errors.Is(err, syscall.EPERM) {
		t.Errorf("attach as another uid: %v, want EPERM", err)
	}
	if n, _ := e.leased(); n != 1 {
		t.Fatalf("pool holds %d leases, want 1", n)
	}
	owner.Close()
	e.checkIdle()
	// The ended session's token is worthless now.
	again := e.client(1000, owner.Token())
	if _, err := again.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 1}}); !errors.Is(err, syscall.EPERM) {
		t.Errorf("token of an ended session: %v, want EPERM", err)
	}
}

// tarFile writes a tar of n members and returns its path.
func tarFile(t *testing.T, dir string, n int) (string, map[string][]byte) {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	members := map[string][]byte{}
	for i := range n {
		name := fmt.Sprintf("sample%06d.bin", i)
		body := bytes.Repeat([]byte{byte(i)}, i%700+1)
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body))}); err != nil {
			t.Fatal(err)
		}
		tw.Write(body)
		members[name] = body
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, fmt.Sprintf("shard%d.tar", n))
	if err := os.WriteFile(p, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return p, members
}

func TestIndexAndReadNames(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 4 << 20})
	ctx := context.Background()
	cl := e.client(1000, ctl.Token{})
	p, members := tarFile(t, e.dir, 2000) // index JSON > 64 KiB
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	doc, err := cl.Index(ctx, f)
	if err != nil {
		t.Fatal(err)
	}
	if len(doc) <= xattrMax {
		t.Fatalf("index of %d bytes; the test needs more than %d", len(doc), xattrMax)
	}
	var parsed map[string]any
	if err := json.Unmarshal(doc, &parsed); err != nil || parsed["format"] != "tar" {
		t.Fatalf("INDEX document: format %v, %v", parsed["format"], err)
	}
	if _, errno := e.srv.Xattr(ctx, fs.Caller{UID: 1000}, pathTarget(p, false), "user.gdsfs.index"); errno != syscall.E2BIG {
		t.Errorf("user.gdsfs.index over 64 KiB: %v, want E2BIG", errno)
	}

	names := []string{"sample000000.bin", "sample001999.bin", "sample000700.bin", "sample000000.bin"}
	ls, err := cl.ReadNames(ctx, f, ctl.HostDevice, names)
	if err != nil {
		t.Fatal(err)
	}
	for i, name := range names {
		got, err := cl.Bytes(ctx, ls[i])
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, members[name]) {
			t.Errorf("%s: %d bytes, want %d equal to the member", name, len(got), len(members[name]))
		}
	}
	if _, err := cl.ReadNames(ctx, f, ctl.HostDevice, []string{"nope"}); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("unknown name: %v, want ENOENT", err)
	}
	plain, _ := e.file("plain.bin", 100, os.O_RDONLY)
	if _, err := cl.ReadNames(ctx, plain, ctl.HostDevice, []string{"x"}); !errors.Is(err, syscall.ENODATA) {
		t.Errorf("READ_NAMES on unindexed file: %v, want ENODATA", err)
	}
	if _, err := cl.Index(ctx, plain); !errors.Is(err, syscall.ENODATA) {
		t.Errorf("INDEX on unindexed file: %v, want ENODATA", err)
	}
}

func TestXattrsAndStatus(t *testing.T) {
	e := newEnv(t, envOptions{})
	ctx := context.Background()
	c := fs.Caller{UID: 1000}
	f, _ := e.file("x.bin", 12345, os.O_RDONLY)
	v, errno := e.srv.Xattr(ctx, c, pathTarget(f.Name(), false), "user.gdsfs.info")
	if errno != 0 {
		t.Fatal(errno)
	}
	var fi fileInfo
	if err := json.Unmarshal(v, &fi); err != nil {
		t.Fatal(err)
	}
	if fi.Path != f.Name() || fi.Size != 12345 || fi.Type != "file" || fi.Engine != "host" || fi.Reason == "" || fi.Align != 4096 || fi.Ino == 0 {
		t.Errorf("info %+v", fi)
	}
	if v, errno := e.srv.Xattr(ctx, c, pathTarget(e.dir, true), "user.gdsfs.info"); errno != 0 || !bytes.Contains(v, []byte(`"type":"dir"`)) {
		t.Errorf("dir info %s, %v", v, errno)
	}
	if v, errno := e.srv.Xattr(ctx, c, pathTarget(f.Name(), false), "user.gdsfs.backing"); errno != 0 || string(v) != f.Name() {
		t.Errorf("backing %q, %v", v, errno)
	}
	if _, errno := e.srv.Xattr(ctx, c, pathTarget(f.Name(), false), "user.gdsfs.stats"); errno != syscall.ENODATA {
		t.Errorf("stats off the root: %v, want ENODATA", errno)
	}
	if _, errno := e.srv.Xattr(ctx, c, pathTarget(f.Name(), false), "user.gdsfs.nope"); errno != syscall.ENODATA {
		t.Errorf("unknown name: %v, want ENODATA", errno)
	}
	if _, errno := e.srv.Xattr(ctx, c, pathTarget(f.Name(), false), "user.gdsfs.index"); errno != syscall.ENODATA {
		t.Errorf("index of unindexed file: %v, want ENODATA", errno)
	}

	cl := e.client(1000, ctl.Token{})
	if _, err := cl.Read(ctx, f, ctl.HostDevice, []ctl.Range{{Offset: 0, Length: 100}}); err != nil {
		t.Fatal(err)
	}
	doc, err := cl.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var st Stats
	if err := json.Unmarshal(doc, &st); err != nil {
		t.Fatal(err)
	}
	if st.Sessions != 1 || st.Leases != 1 || st.Counters.Reads != 1 || st.Counters.ReadBytes != 100 || st.Pool.Backend != "host" {
		t.Errorf("status %s", doc)
	}
	root, errno := e.srv.Xattr(ctx, c, pathTarget(e.dir, true), "user.gdsfs.stats")
	if errno != 0 || !json.Valid(root) {
		t.Errorf("root stats %s, %v", root, errno)
	}
}

// Sessions read, release and close concurrently (run with -race).
func TestConcurrentSessions(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 256 << 20})
	f, data := e.file("c", 2<<20, os.O_RDONLY)
	var wg sync.WaitGroup
	for w := range 8 {
		cl := e.client(uint32(1000+w%2), ctl.Token{})
		wg.Go(func() {
			defer cl.Close()
			r := rand.New(rand.NewPCG(uint64(w), 3))
			for range 30 {
				var ranges []ctl.Range
				for range r.IntN(5) + 1 {
					off := r.Uint64N(uint64(len(data)))
					ranges = append(ranges, ctl.Range{Offset: off, Length: r.Uint64N(200000)})
				}
				ls, err := cl.Read(context.Background(), f, ctl.HostDevice, ranges)
				if err != nil {
					t.Error(err)
					return
				}
				checkLeases(t, cl, ranges, ls, data)
				if r.IntN(2) == 0 {
					for _, l := range ls {
						if l.ID != 0 {
							if err := cl.Release(context.Background(), l.ID); err != nil {
								t.Error(err)
							}
						}
					}
				}
			}
		})
	}
	wg.Wait()
	e.checkIdle()
}

// FuzzServer fires arbitrary commands and buffers at a live Server, on the
// control file and on a data file; afterwards the server must still read
// correctly, and closing every session must return the pool to idle.
func FuzzServer(f *testing.F) {
	for _, cmd := range []uint32{ctl.CmdHello, ctl.CmdSlab, ctl.CmdAlloc, ctl.CmdRelease, ctl.CmdStatus, ctl.CmdRead, ctl.CmdReadNames, ctl.CmdWrite, ctl.CmdIndex} {
		b := make([]byte, ctl.CmdSize(cmd))
		ctl.PutHeader(b, ctl.Token{Session: 1, Secret: 0})
		f.Add(cmd, b[:64], true)
		f.Add(cmd, b[:64], false)
	}
	r := readBuf(ctl.Token{Session: 1, Secret: 0}, -1, ctl.Range{Offset: 0, Length: 5000})
	f.Add(ctl.CmdRead, r[:96], false)
	rv := make([]byte, ctl.SizeRead)
	(&ctl.ReadRequest{Token: ctl.Token{Session: 1}, Device: -1, Version: 1, Ranges: []ctl.Range{{Offset: 0, Length: 5000}}}).Encode(rv)
	f.Add(ctl.CmdRead, rv[:96], false) // versioned: ESTALE (the fuzzer may find the version)

	// One server for every input of this process: building one costs far
	// more than an input.
	e := newEnv(f, envOptions{slabBytes: 1 << 20, budgetBytes: 8 << 20})
	data, content := e.file("data", 20000, os.O_RDWR)
	f.Fuzz(func(t *testing.T, cmd uint32, prefix []byte, onControl bool) {
		ctx := context.Background()
		c := fs.Caller{UID: 1000}
		sess0, errno := e.srv.OpenSession(ctx, c)
		if errno != 0 {
			t.Fatal(errno)
		}
		cl, err := ctl.NewTransportClient(ctx, &inproc{srv: e.srv, sess: sess0, caller: c}, ctl.Token{})
		if err != nil {
			t.Fatal(err)
		}
		sess, errno := e.srv.OpenSession(ctx, c)
		if errno != 0 {
			t.Fatal(errno)
		}
		// Session id 1 in the input stands for the live session (with its
		// secret), so that the fuzzer reaches the deep paths.
		tok := cl.Token()
		size := ctl.CmdSize(cmd)
		in := make([]byte, size)
		copy(in, prefix)
		if len(in) >= 24 && le.Uint64(in[8:]) == 1 {
			le.PutUint64(in[8:], tok.Session)
			le.PutUint64(in[16:], tok.Secret)
		}
		out := make([]byte, size)
		if onControl {
			sess.Ioctl(ctx, c, cmd, in, out)
		} else {
			e.srv.FileIoctl(ctx, c, data, data.Name(), cmd, in, out)
		}
		sess.Close()
		ls, err := cl.Read(ctx, data, ctl.HostDevice, []ctl.Range{{Offset: 3, Length: 9000}})
		if err != nil {
			t.Fatalf("read after cmd %#x: %v", cmd, err)
		}
		checkLeases(t, cl, []ctl.Range{{Offset: 3, Length: 9000}}, ls, content)
		cl.Close()
		if n, b := e.leased(); n != 0 || b != 0 {
			t.Fatalf("cmd %#x: pool holds %d leases (%d bytes) after every session closed", cmd, n, b)
		}
	})
}

// blockingEngine blocks every ReadAt until release is closed.
type blockingEngine struct {
	cufile.Engine
	entered chan struct{}
	release chan struct{}
}

func (b *blockingEngine) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	b.entered <- struct{}{}
	<-b.release
	return b.Engine.ReadAt(ctx, f, dst, dstOff, fileOff, n)
}

// S5: closing a session waits for its reads in flight before their memory
// goes back to the pool (where another uid could get it).
func TestCloseWaitsForReads(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20})
	be := &blockingEngine{Engine: cufile.NewHostEngine(cufile.Options{}), entered: make(chan struct{}, 1), release: make(chan struct{})}
	e.srv.opts.Engines = fixedEngine{be}
	ctx := context.Background()
	owner := fs.Caller{UID: 1000}
	sess, _ := e.srv.OpenSession(ctx, owner)
	hello := make([]byte, ctl.SizeHello)
	ctl.EncodeHello(hello)
	out := make([]byte, ctl.SizeHello)
	if _, errno := sess.Ioctl(ctx, owner, ctl.CmdHello, hello, out); errno != 0 {
		t.Fatal(errno)
	}
	h, _ := ctl.DecodeHelloReply(out)
	f, _ := e.file("d", 10000, os.O_RDONLY)
	readDone := make(chan syscall.Errno, 1)
	go func() {
		readDone <- e.rawFile(1000, f, ctl.CmdRead, readBuf(h.Token, -1, ctl.Range{Offset: 0, Length: 5000}))
	}()
	<-be.entered
	closeDone := make(chan struct{})
	go func() { sess.Close(); close(closeDone) }()
	for range 1000 {
		runtime.Gosched() // give Close every chance to run ahead
	}
	select {
	case <-closeDone:
		t.Fatal("Close returned while a read of the session was in flight")
	default:
	}
	if n, _ := e.leased(); n != 1 {
		t.Errorf("the in-flight read's lease was released under it (pool holds %d leases)", n)
	}
	close(be.release)
	if errno := <-readDone; errno != 0 {
		t.Errorf("read in flight at close: %v", errno)
	}
	<-closeDone
	e.checkIdle()
	if errno := e.rawFile(1000, f, ctl.CmdRead, readBuf(h.Token, -1, ctl.Range{Offset: 0, Length: 5000})); errno != syscall.EPERM {
		t.Errorf("read on a closed session: %v, want EPERM", errno)
	}
}
