package ctlserver

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"hash/fnv"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/fileid"
)

// tarOf is a tar of members of the given sizes (bytes i*7+size).
func tarOf(t testing.TB, sizes ...int) []byte {
	t.Helper()
	var b bytes.Buffer
	w := tar.NewWriter(&b)
	for i, n := range sizes {
		body := make([]byte, n)
		for j := range body {
			body[j] = byte(j*7 + n + i)
		}
		if err := w.WriteHeader(&tar.Header{Name: "k" + string(rune('a'+i)) + ".bin", Mode: 0o644, Size: int64(n)}); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(body); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// rewriteInPlace writes data over path (same inode) and sets an mtime of
// its own, so that the change shows whatever the timestamp granularity.
func rewriteInPlace(t *testing.T, path string, data []byte, mtime time.Time) {
	t.Helper()
	g, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if _, err := g.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := g.Truncate(int64(len(data))); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(path, mtime, mtime); err != nil {
		t.Fatal(err)
	}
}

// A READ that names INDEX's version is served while the file is at that
// version and refused with ESTALE (no lease left) once it was rewritten
// in place: same size, another size, cut to half (ESTALE, not EINVAL for
// the ranges past the new end). Without a version READ serves the new
// bytes as before.
func TestReadVersionRefusesAnotherVersion(t *testing.T) {
	t0 := time.Now().Add(-time.Hour)
	for _, tc := range []struct {
		name string
		next func(old []byte) []byte
	}{
		{"same size, other layout", func(old []byte) []byte { return tarOf(t, 3000, 1000) }},
		{"other size", func(old []byte) []byte { return tarOf(t, 1000, 3000, 500) }},
		{"cut to half", func(old []byte) []byte { return old[:len(old)/2] }},
		{"same bytes, touched", func(old []byte) []byte { return old }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 4 << 20})
			cl := e.client(1000, ctl.Token{})
			if cl.Hello().Caps&ctl.CapReadVersion == 0 {
				t.Fatal("no CapReadVersion with indexes")
			}
			ctx := context.Background()
			p := filepath.Join(e.dir, "s.tar")
			old := tarOf(t, 1000, 3000)
			if err := os.WriteFile(p, old, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Chtimes(p, t0, t0); err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			_, version, err := cl.IndexVersion(ctx, f)
			if err != nil || version == 0 {
				t.Fatalf("IndexVersion: version %d, %v", version, err)
			}
			ranges := []ctl.Range{{Offset: 512, Length: 1000}, {Offset: 2048, Length: 3000}}
			ls, err := cl.ReadVersion(ctx, f, ctl.HostDevice, version, ranges)
			if err != nil {
				t.Fatalf("READ at the index's version: %v", err)
			}
			checkLeases(t, cl, ranges, ls, old)
			if err := cl.Release(ctx, ls[0].ID, ls[1].ID); err != nil {
				t.Fatal(err)
			}
			rewriteInPlace(t, p, tc.next(old), t0.Add(time.Minute))
			if _, err := cl.ReadVersion(ctx, f, ctl.HostDevice, version, ranges); !errors.Is(err, syscall.ESTALE) {
				t.Fatalf("READ of the old version after a rewrite: %v, want ESTALE", err)
			}
			e.checkIdle()
			_, v2, err := cl.IndexVersion(ctx, f)
			if errors.Is(err, syscall.ENODATA) && tc.name == "cut to half" {
				return // no longer a tar: nothing to plan from
			}
			if err != nil || v2 == version || v2 == 0 {
				t.Fatalf("IndexVersion after the rewrite: %d (was %d), %v", v2, version, err)
			}
		})
	}
}

// rewritingEngine rewrites the file once while the first READ is being
// read: the daemon's check after the read sees it.
type rewritingEngine struct {
	cufile.Engine
	rewrite func()
}

func (r *rewritingEngine) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	got, err := r.Engine.ReadAt(ctx, f, dst, dstOff, fileOff, n)
	if r.rewrite != nil {
		r.rewrite()
		r.rewrite = nil
	}
	return got, err
}

// A file changed while a versioned READ reads it: ESTALE, and every
// lease the READ took is back in the pool.
func TestReadVersionChangedDuringTheRead(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 4 << 20})
	p := filepath.Join(e.dir, "s.tar")
	old := tarOf(t, 1000, 3000)
	if err := os.WriteFile(p, old, 0o644); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now().Add(-time.Hour)
	if err := os.Chtimes(p, t0, t0); err != nil {
		t.Fatal(err)
	}
	re := &rewritingEngine{Engine: cufile.NewHostEngine(cufile.Options{}), rewrite: func() { rewriteInPlace(t, p, tarOf(t, 3000, 1000), t0.Add(time.Minute)) }}
	e.srv.opts.Engines = fixedEngine{re}
	cl := e.client(1000, ctl.Token{})
	ctx := context.Background()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, version, err := cl.IndexVersion(ctx, f)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.ReadVersion(ctx, f, ctl.HostDevice, version, []ctl.Range{{Offset: 512, Length: 1000}}); !errors.Is(err, syscall.ESTALE) {
		t.Fatalf("READ while the file was rewritten: %v, want ESTALE", err)
	}
	e.checkIdle()
}

// The version field's encoding: the flag without a version, a version
// without the flag, and unknown flags are EINVAL.
func TestReadVersionEncoding(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 2 << 20})
	cl := e.client(1000, ctl.Token{})
	f, _ := e.file("data", 10000, os.O_RDONLY)
	for _, tc := range []struct {
		name    string
		flags   uint32
		version uint64
	}{
		{"flag without a version", ctl.ReadFlagVersion, 0},
		{"version without the flag", 0, 42},
		{"unknown flag", 2, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := readBuf(cl.Token(), ctl.HostDevice, ctl.Range{Offset: 0, Length: 10})
			le.PutUint32(b[36:], tc.flags)
			le.PutUint64(b[48:], tc.version)
			if errno := e.rawFile(1000, f, ctl.CmdRead, b); errno != syscall.EINVAL {
				t.Fatalf("errno %v, want EINVAL", errno)
			}
		})
	}
	e.checkIdle()
}

// BenchmarkServerRead4KiBVersion is BenchmarkServerRead4KiB with the
// file's version named: the two fstat calls of the check on top.
func BenchmarkServerRead4KiBVersion(b *testing.B) {
	e := newEnv(b, envOptions{slabBytes: 1 << 20, budgetBytes: 64 << 20, noIndexes: true})
	cl := e.client(1000, ctl.Token{})
	f, _ := e.file("a.bin", 1<<20, os.O_RDONLY)
	version, errno := fileVersion(f)
	if errno != 0 {
		b.Fatal(errno)
	}
	ctx := context.Background()
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		off := uint64(i%256) * 4096
		ls, err := cl.ReadVersion(ctx, f, ctl.HostDevice, version, []ctl.Range{{Offset: off, Length: 4096}})
		if err != nil {
			b.Fatal(err)
		}
		if err := cl.Release(ctx, ls[0].ID); err != nil {
			b.Fatal(err)
		}
	}
}

// fileVersion is FNV-1a 64 of the identity's key bytes (the documented
// hash, docs/protocol.md 3.5).
func TestFileVersionIsFNVOfTheIdentity(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 2 << 20, noIndexes: true})
	f, _ := e.file("a.bin", 5000, os.O_RDONLY)
	id, err := fileid.OfFile(f)
	if err != nil {
		t.Fatal(err)
	}
	h := fnv.New64a()
	h.Write([]byte(id.Key()))
	if v, errno := fileVersion(f); errno != 0 || v != h.Sum64() {
		t.Fatalf("fileVersion %#x (%v), FNV-1a of the identity %#x", v, errno, h.Sum64())
	}
}
