package cufile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// canDirect reports whether files of dir accept O_DIRECT writes.
func canDirect(t testing.TB, dir string) bool {
	t.Helper()
	p := filepath.Join(dir, "probe")
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE|syscall.O_DIRECT, 0o600)
	if err != nil {
		return false
	}
	f.Close()
	os.Remove(p)
	return true
}

// TestWriteAtDirect writes slab bytes over a cached file through the host
// and posix engines under each Direct policy, with the backing file as the
// oracle: the bytes are exact (head, body and tail), a reader who had read
// the old bytes through the page cache sees the new ones, and the aligned
// body bypassed the page cache exactly when the policy and the memory allow
// O_DIRECT (its pages are not cached after the write; with buffered writes
// they are).
func TestWriteAtDirect(t *testing.T) {
	const (
		chunk    = 16 * gpubuf.Align
		fileSize = 3 << 20
		memSize  = 2<<20 + 3*gpubuf.Align
	)
	type engCase struct {
		name string
		e    Engine
		mem  func() (gpubuf.Memory, []byte)
		host bool
		// direct: the policy writes aligned bodies of at least writeDirectMin with O_DIRECT.
		direct bool
	}
	hostMemory := func() (gpubuf.Memory, []byte) { b := mmapBytes(memSize); return &hostMem{b}, b }
	devMemory := func() (gpubuf.Memory, []byte) { m := &fakeDevMem{data: make([]byte, memSize)}; return m, m.data }
	engines := []engCase{
		{"host/never", NewHostEngine(Options{ChunkBytes: chunk, Workers: 3, Direct: "never"}), hostMemory, true, false},
		{"host/auto", NewHostEngine(Options{ChunkBytes: chunk, Workers: 3, Direct: "auto"}), hostMemory, true, true},
		{"host/always", NewHostEngine(Options{ChunkBytes: chunk, Workers: 3, Direct: "always"}), hostMemory, true, true},
		{"posix/never", newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 3, Direct: "never"}), devMemory, false, false},
		{"posix/auto", newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 3, Direct: "auto"}), devMemory, false, true},
		{"posix/always/1 slot", newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 2, Slots: 1, Direct: "always"}), devMemory, false, true},
		{"posix/always/3 slots", newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 1, Slots: 3, Direct: "always"}), devMemory, false, true},
	}
	cases := []struct {
		name             string
		srcOff, fileOff  int64
		n                int64
		hostMemOutOfLine bool // memory and file offsets differ mod 4 KiB: host memory cannot go direct
	}{
		{"aligned", 0, 0, 1 << 20, false},
		{"unaligned head and tail", gpubuf.Align + 100, 3*gpubuf.Align + 100, 1<<20 + 5000, false},
		{"length not a multiple of 4 KiB", 0, 8 * gpubuf.Align, 1<<20 + 123, false},
		{"memory out of line with the file", 1, 0, 1 << 20, true},
		{"within one page", 10, 10, 100, false},
		{"extends the file", 0, fileSize - 2*gpubuf.Align, 1 << 20, false},
	}
	ctx := context.Background()
	dir := t.TempDir()
	directOK := canDirect(t, dir)
	if !directOK {
		t.Logf("%s refuses O_DIRECT: every write must fall back to buffered", dir)
	}
	for _, ec := range engines {
		for i, tc := range cases {
			t.Run(ec.name+"/"+tc.name, func(t *testing.T) {
				p := filepath.Join(dir, fmt.Sprintf("%s-%d", filepath.Base(ec.name), i))
				old := bytes.Repeat([]byte("old bytes "), fileSize/10+1)[:fileSize]
				if err := os.WriteFile(p, old, 0o600); err != nil {
					t.Fatal(err)
				}
				f, err := os.OpenFile(p, os.O_RDWR, 0)
				if err != nil {
					t.Fatal(err)
				}
				defer f.Close()
				// A reader who read the old bytes: they are in the page cache.
				if _, err := f.ReadAt(make([]byte, fileSize), 0); err != nil {
					t.Fatal(err)
				}
				mem, src := ec.mem()
				for k := range src {
					src[k] = byte(k*31 + i)
				}
				got, err := ec.e.WriteAt(ctx, f, mem, tc.srcOff, tc.fileOff, tc.n)
				if err != nil || got != tc.n {
					t.Fatalf("WriteAt = %d, %v; want %d", got, err, tc.n)
				}
				head, body, _ := alignedSplit(tc.fileOff, tc.n)
				wantDirect := ec.direct && directOK && body >= writeDirectMin && !(ec.host && tc.hostMemOutOfLine)
				if wantDirect || body > 0 {
					if c, ok := pagecache.Cached(f, tc.fileOff+head, body); ok {
						if wantDirect && c != 0 {
							t.Errorf("%d of the %d body bytes are in the page cache after an O_DIRECT write", c, body)
						}
						if !wantDirect && c < body {
							t.Errorf("only %d of the %d body bytes are in the page cache after a buffered write", c, body)
						}
					}
				}
				want := append([]byte(nil), old...)
				if end := tc.fileOff + tc.n; end > int64(len(want)) {
					want = append(want, make([]byte, end-int64(len(want)))...)
				}
				copy(want[tc.fileOff:], src[tc.srcOff:tc.srcOff+tc.n])
				back := make([]byte, len(want)+1)
				m, err := f.ReadAt(back, 0) // the same reader, through the cache
				if m != len(want) || !bytes.Equal(back[:m], want) {
					t.Fatalf("the file reads %d bytes (want %d), equal %v (%v)", m, len(want), bytes.Equal(back[:min(m, len(want))], want[:min(m, len(want))]), err)
				}
			})
		}
	}
}

// TestWritePieceFallsBackOnEINVAL hands a direct write memory the kernel
// refuses (not aligned): the piece is written buffered, byte-exact.
func TestWritePieceFallsBackOnEINVAL(t *testing.T) {
	dir := t.TempDir()
	if !canDirect(t, dir) {
		t.Skipf("%s refuses O_DIRECT", dir)
	}
	p := filepath.Join(dir, "f")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	direct := openDirectWrite(f)
	if direct == nil {
		t.Fatal("openDirectWrite refused a writable file on a filesystem that takes O_DIRECT")
	}
	defer direct.Close()
	b := mmapBytes(3 * gpubuf.Align)[1 : 1+2*gpubuf.Align]
	for k := range b {
		b[k] = byte(k * 7)
	}
	if err := pwriteFull(direct, b, 0); !errors.Is(err, syscall.EINVAL) {
		t.Skipf("this filesystem takes unaligned O_DIRECT writes (%v): no EINVAL to fall back from", err)
	}
	if err := writePiece(f, direct, b, 0); err != nil {
		t.Fatalf("writePiece = %v, want the buffered fallback", err)
	}
	back, err := os.ReadFile(p)
	if err != nil || !bytes.Equal(back, b) {
		t.Fatalf("file holds %d bytes, equal %v (%v)", len(back), bytes.Equal(back, b), err)
	}
}

// TestOpenDirectWriteRefuses: no O_DIRECT twin for a descriptor that cannot
// write at offsets: read-only, or appending.
func TestOpenDirectWriteRefuses(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, flag := range []int{os.O_RDONLY, os.O_WRONLY | os.O_APPEND, os.O_RDWR | os.O_APPEND} {
		f, err := os.OpenFile(p, flag, 0)
		if err != nil {
			t.Fatal(err)
		}
		if d := openDirectWrite(f); d != nil {
			d.Close()
			t.Errorf("openDirectWrite of a descriptor opened %#x = a twin, want nil", flag)
		}
		f.Close()
	}
}

func TestAlignedSplit(t *testing.T) {
	const a = gpubuf.Align
	for _, tc := range []struct{ off, n, head, body, tail int64 }{
		{0, 0, 0, 0, 0},
		{0, a, 0, a, 0},
		{0, a + 1, 0, a, 1},
		{1, a, a - 1, 0, 1},
		{10, 100, 100, 0, 0},
		{a - 1, 2*a + 2, 1, 2 * a, 1},
		{5 * a, 3*a - 1, 0, 2 * a, a - 1},
	} {
		h, b, tl := alignedSplit(tc.off, tc.n)
		if h != tc.head || b != tc.body || tl != tc.tail {
			t.Errorf("alignedSplit(%d, %d) = %d, %d, %d; want %d, %d, %d", tc.off, tc.n, h, b, tl, tc.head, tc.body, tc.tail)
		}
	}
}

// BenchmarkWriteAtFsync compares the host engine's buffered and O_DIRECT
// WriteAt of 256 MiB followed by fsync (what a checkpoint save waits for),
// to a new file of the test's temporary directory each time; "preallocated"
// fallocates the file first (ext4 then runs the direct writes of the file in
// parallel; gdsfs.dcp did until its staged saves went to several files).
func BenchmarkWriteAtFsync(b *testing.B) {
	const n = 256 << 20
	src := mmapBytes(n)
	for k := range src {
		src[k] = byte(k*131 + k>>12)
	}
	mem := &hostMem{src}
	for _, mode := range []string{"never", "always", "always/preallocated"} {
		direct, prealloc := strings.CutSuffix(mode, "/preallocated")
		b.Run(mode, func(b *testing.B) {
			e := NewHostEngine(Options{Direct: direct})
			dir := b.TempDir()
			b.SetBytes(n)
			for i := 0; b.Loop(); i++ {
				p := filepath.Join(dir, fmt.Sprintf("f%d", i))
				f, err := os.Create(p)
				if err != nil {
					b.Fatal(err)
				}
				if prealloc {
					if err := unix.Fallocate(int(f.Fd()), 0, 0, n); err != nil {
						b.Fatal(err)
					}
				}
				if _, err := e.WriteAt(context.Background(), f, mem, 0, 0, n); err != nil {
					b.Fatal(err)
				}
				if err := f.Sync(); err != nil {
					b.Fatal(err)
				}
				f.Close()
				os.Remove(p)
			}
		})
	}
}
