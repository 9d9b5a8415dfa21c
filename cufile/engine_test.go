package cufile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// fakeDevMem is "device memory" for the fake stager: a byte slice reachable
// only through copies, like GPU memory.
type fakeDevMem struct {
	data   []byte
	device int
}

func (m *fakeDevMem) Size() int64                 { return int64(len(m.data)) }
func (m *fakeDevMem) Scrub(context.Context) error { clear(m.data); return nil }
func (m *fakeDevMem) Export() ([]byte, error)     { return nil, errors.New("fake: no export") }
func (m *fakeDevMem) Close() error                { return nil }
func (m *fakeDevMem) DevicePtr() uintptr          { return 0 }
func (m *fakeDevMem) Device() int                 { return m.device }

// fakeStager models CUDA's asynchrony: copies are queued per slot and only
// happen at sync, reading the staging buffer at that moment. An engine that
// reuses a buffer before syncing, or returns before syncing, loses data.
type fakeStager struct {
	mu        sync.Mutex
	lanes     int
	bound     atomic.Int32
	failH2DAt int64 // fail the copy into this device offset (-1: never)
	syncErr   error
}

type pendingCopy struct {
	toDev bool
	mem   *fakeDevMem
	off   int64
	host  []byte
}

type fakeLane struct {
	s       *fakeStager
	bufs    [][]byte
	pending [][]pendingCopy
	closed  bool
}

func (s *fakeStager) bind(int) error { s.bound.Add(1); return nil }
func (s *fakeStager) newLane(device, slots int, bufBytes int64) (lane, error) {
	s.mu.Lock()
	s.lanes++
	s.mu.Unlock()
	l := &fakeLane{s: s, pending: make([][]pendingCopy, slots)}
	for range slots {
		l.bufs = append(l.bufs, mmapBytes(int(bufBytes))) // page-aligned, as cuMemHostAlloc's
	}
	return l, nil
}

func (l *fakeLane) buf(slot int) []byte { return l.bufs[slot] }
func (l *fakeLane) h2d(slot int, dst gpubuf.Memory, off int64, src []byte) error {
	if l.s.failH2DAt >= 0 && off <= l.s.failH2DAt && l.s.failH2DAt < off+int64(len(src)) {
		return errors.New("fake: copy failed")
	}
	l.pending[slot] = append(l.pending[slot], pendingCopy{true, dst.(*fakeDevMem), off, src})
	return nil
}
func (l *fakeLane) d2h(slot int, dst []byte, src gpubuf.Memory, off int64) error {
	l.pending[slot] = append(l.pending[slot], pendingCopy{false, src.(*fakeDevMem), off, dst})
	return nil
}
func (l *fakeLane) sync(slot int) error {
	for _, c := range l.pending[slot] {
		if c.toDev {
			copy(c.mem.data[c.off:], c.host)
		} else {
			copy(c.host, c.mem.data[c.off:])
		}
	}
	l.pending[slot] = nil
	return l.s.syncErr
}
func (l *fakeLane) close() error { l.closed = true; return nil }

func writeRandomFile(t testing.TB, n int) (*os.File, []byte) {
	t.Helper()
	data := make([]byte, n)
	r := rand.New(rand.NewPCG(uint64(n), 7))
	for i := range data {
		data[i] = byte(r.Uint32())
	}
	p := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f, data
}

// hostMem is host memory for the host engine without a shm backend.
type hostMem struct{ b []byte }

func (m *hostMem) Size() int64                 { return int64(len(m.b)) }
func (m *hostMem) HostBytes() []byte           { return m.b }
func (m *hostMem) Scrub(context.Context) error { clear(m.b); return nil }
func (m *hostMem) Export() ([]byte, error)     { return nil, nil }
func (m *hostMem) Close() error                { return nil }

// mmapBytes returns page-aligned memory (O_DIRECT needs aligned buffers).
func mmapBytes(n int) []byte {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		panic(err)
	}
	return b
}

// engineCase is one engine under the shared conformance suite.
type engineCase struct {
	name   string
	engine Engine
	mem    func(n int) gpubuf.Memory
	bytes  func(m gpubuf.Memory) []byte
}

func engineCases() []engineCase {
	const chunk = 3 * gpubuf.Align
	return []engineCase{
		{"host", NewHostEngine(Options{ChunkBytes: chunk, Workers: 4, Direct: "never"}),
			func(n int) gpubuf.Memory { return &hostMem{make([]byte, n)} },
			func(m gpubuf.Memory) []byte { return m.(*hostMem).b }},
		{"host-direct", NewHostEngine(Options{ChunkBytes: chunk, Workers: 4, Direct: "always"}),
			func(n int) gpubuf.Memory { return &hostMem{mmapBytes(n)} },
			func(m gpubuf.Memory) []byte { return m.(*hostMem).b }},
		{"posix-buffered", newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 3, Direct: "never"}),
			func(n int) gpubuf.Memory { return &fakeDevMem{data: make([]byte, n)} },
			func(m gpubuf.Memory) []byte { return m.(*fakeDevMem).data }},
		{"posix-direct", newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 3, Slots: 3, Direct: "always"}),
			func(n int) gpubuf.Memory { return &fakeDevMem{data: make([]byte, n)} },
			func(m gpubuf.Memory) []byte { return m.(*fakeDevMem).data }},
	}
}

// TestEngineConformance runs the same reads and writes through every engine:
// byte-exact results, short counts only at end of file, errors for bad ranges.
func TestEngineConformance(t *testing.T) {
	const fileSize = 50*gpubuf.Align + 123
	for _, ec := range engineCases() {
		t.Run(ec.name, func(t *testing.T) {
			f, data := writeRandomFile(t, fileSize)
			ctx := context.Background()
			for _, tc := range []struct {
				name            string
				memOff, fileOff int64
				n, want         int64
			}{
				{"empty", 0, 0, 0, 0},
				{"one byte", 0, 5, 1, 1},
				{"unaligned both", 17, 4095, 3*gpubuf.Align + 9, 3*gpubuf.Align + 9},
				{"many chunks", 0, 0, 40 * gpubuf.Align, 40 * gpubuf.Align},
				{"whole file", gpubuf.Align, 0, fileSize, fileSize},
				{"across EOF", 0, fileSize - 5000, 20000, 5000},
				{"at EOF", 0, fileSize, 100, 0},
				{"past EOF", 0, fileSize + 1<<20, 100, 0},
			} {
				t.Run(tc.name, func(t *testing.T) {
					mem := ec.mem(60 * gpubuf.Align)
					got, err := ec.engine.ReadAt(ctx, f, mem, tc.memOff, tc.fileOff, tc.n)
					if err != nil || got != tc.want {
						t.Fatalf("ReadAt = %d, %v; want %d", got, err, tc.want)
					}
					b := ec.bytes(mem)
					if tc.want > 0 && !bytes.Equal(b[tc.memOff:tc.memOff+got], data[tc.fileOff:tc.fileOff+got]) {
						t.Fatal("bytes differ from the file")
					}
					if bytes.ContainsFunc(b[:tc.memOff], func(r rune) bool { return r != 0 }) {
						t.Error("bytes before the destination offset were written")
					}
				})
			}
			t.Run("bad ranges", func(t *testing.T) {
				mem := ec.mem(8 * gpubuf.Align)
				for _, r := range [][3]int64{{-1, 0, 10}, {0, -1, 10}, {0, 0, -1}, {8*gpubuf.Align - 1, 0, 2}, {9 * gpubuf.Align, 0, 0}} {
					if _, err := ec.engine.ReadAt(ctx, f, mem, r[0], r[1], r[2]); !errors.Is(err, ErrRange) {
						t.Errorf("ReadAt(memOff %d, fileOff %d, n %d) = %v, want ErrRange", r[0], r[1], r[2], err)
					}
					if _, err := ec.engine.WriteAt(ctx, f, mem, r[0], r[1], r[2]); !errors.Is(err, ErrRange) {
						t.Errorf("WriteAt(memOff %d, fileOff %d, n %d) = %v, want ErrRange", r[0], r[1], r[2], err)
					}
				}
			})
			t.Run("write round trip", func(t *testing.T) {
				mem := ec.mem(30 * gpubuf.Align)
				src := ec.bytes(mem)
				for i := range src {
					src[i] = byte(i * 7)
				}
				const off, fileOff, n = 100, 2*gpubuf.Align + 1, 25*gpubuf.Align + 3
				got, err := ec.engine.WriteAt(ctx, f, mem, off, fileOff, n)
				if err != nil || got != n {
					t.Fatalf("WriteAt = %d, %v", got, err)
				}
				back := make([]byte, fileSize)
				if _, err := f.ReadAt(back, 0); err != nil {
					t.Fatal(err)
				}
				want := append([]byte(nil), data...)
				copy(want[fileOff:], src[off:off+n])
				if !bytes.Equal(back, want) {
					t.Fatal("file differs after WriteAt")
				}
				copy(data, back) // later cases compare against the new content
			})
		})
	}
}

func TestPosixErrorsAndCancellation(t *testing.T) {
	const chunk = 2 * gpubuf.Align
	f, _ := writeRandomFile(t, 64*gpubuf.Align)
	mem := &fakeDevMem{data: make([]byte, 64*gpubuf.Align)}
	t.Run("copy error mid-transfer", func(t *testing.T) {
		st := &fakeStager{failH2DAt: 30 * gpubuf.Align}
		e := newPosixEngine(st, Options{ChunkBytes: chunk, Workers: 4, Direct: "never"})
		if _, err := e.ReadAt(context.Background(), f, mem, 0, 0, 64*gpubuf.Align); err == nil {
			t.Fatal("ReadAt succeeded despite a failed copy")
		}
	})
	t.Run("stream error", func(t *testing.T) {
		st := &fakeStager{failH2DAt: -1, syncErr: errors.New("fake: illegal address")}
		e := newPosixEngine(st, Options{ChunkBytes: chunk, Workers: 2, Direct: "never"})
		if _, err := e.ReadAt(context.Background(), f, mem, 0, 0, 8*gpubuf.Align); err == nil {
			t.Fatal("ReadAt succeeded despite a stream error")
		}
		// Broken lanes are closed and dropped, never handed out again.
		for len(e.pool(0).free) > 0 {
			if l, ok := (<-e.pool(0).free).(*fakeLane); ok && l.closed {
				t.Error("a closed lane was returned to the pool")
			}
		}
		if p := e.pool(0); p.created != 0 && st.lanes == 0 {
			t.Errorf("lane accounting: created %d", p.created)
		}
	})
	t.Run("cancelled", func(t *testing.T) {
		e := newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 2, Direct: "never"})
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := e.ReadAt(ctx, f, mem, 0, 0, 64*gpubuf.Align); !errors.Is(err, context.Canceled) {
			t.Fatalf("ReadAt = %v, want context.Canceled", err)
		}
	})
	t.Run("not device memory", func(t *testing.T) {
		st := &fakeStager{failH2DAt: -1}
		e := newPosixEngine(cudaStagerAdapter{st}, Options{ChunkBytes: chunk, Workers: 1, Direct: "never"})
		if _, err := e.ReadAt(context.Background(), f, &hostMem{make([]byte, chunk)}, 0, 0, chunk); err == nil {
			t.Fatal("posix engine accepted host memory")
		}
	})
}

// cudaStagerAdapter gives the fake's buffers with the real lane's device
// pointer check, to test the type check in cudaLane.
type cudaStagerAdapter struct{ *fakeStager }

func (a cudaStagerAdapter) newLane(device, slots int, bufBytes int64) (lane, error) {
	l, err := a.fakeStager.newLane(device, slots, bufBytes)
	return checkingLane{l}, err
}

type checkingLane struct{ lane }

func (c checkingLane) h2d(slot int, dst gpubuf.Memory, off int64, src []byte) error {
	if _, err := devicePtr(dst); err != nil {
		return err
	}
	return c.lane.h2d(slot, dst, off, src)
}

// TestPosixBoundsStaging checks that concurrent transfers share at most
// Workers lanes (pinned memory is bounded) and all finish.
func TestPosixBoundsStaging(t *testing.T) {
	st := &fakeStager{failH2DAt: -1}
	e := newPosixEngine(st, Options{ChunkBytes: gpubuf.Align, Workers: 3, Direct: "never"})
	f, data := writeRandomFile(t, 32*gpubuf.Align)
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			mem := &fakeDevMem{data: make([]byte, 32*gpubuf.Align)}
			got, err := e.ReadAt(context.Background(), f, mem, 0, int64(i)*gpubuf.Align, 16*gpubuf.Align)
			if err != nil || got != 16*gpubuf.Align || !bytes.Equal(mem.data[:got], data[int64(i)*gpubuf.Align:][:got]) {
				t.Errorf("transfer %d: %d %v", i, got, err)
			}
		})
	}
	wg.Wait()
	if st.lanes > 3 {
		t.Errorf("%d lanes allocated, limit 3", st.lanes)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestRunChunks(t *testing.T) {
	for _, tc := range []struct {
		name           string
		n, chunk       int64
		workers        int
		short          map[int]int64 // chunk index -> bytes it returns
		wantN          int64
		wantChunkCalls int
	}{
		{"exact", 12, 4, 2, nil, 12, 3},
		{"ragged tail", 10, 4, 8, nil, 10, 3},
		{"one worker", 10, 3, 1, nil, 10, 4},
		{"short in middle stops the count", 16, 4, 2, map[int]int64{1: 2}, 6, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int32
			var seen sync.Map
			got, err := runChunks(context.Background(), tc.n, tc.chunk, tc.workers, func(context.Context) (worker, error) {
				return funcWorker{doFn: func(c chunk) (int64, error) {
					calls.Add(1)
					if _, dup := seen.LoadOrStore(c.index, true); dup {
						return 0, fmt.Errorf("chunk %d done twice", c.index)
					}
					if c.off != int64(c.index)*tc.chunk || c.n != min(tc.chunk, tc.n-c.off) {
						return 0, fmt.Errorf("chunk %+v mis-sized", c)
					}
					if m, ok := tc.short[c.index]; ok {
						return m, nil
					}
					return c.n, nil
				}}, nil
			})
			if err != nil || got != tc.wantN || int(calls.Load()) != tc.wantChunkCalls {
				t.Errorf("runChunks = %d, %v after %d chunks; want %d after %d", got, err, calls.Load(), tc.wantN, tc.wantChunkCalls)
			}
		})
	}
	t.Run("start error", func(t *testing.T) {
		_, err := runChunks(context.Background(), 10, 2, 3, func(context.Context) (worker, error) {
			return nil, errors.New("no staging")
		})
		if err == nil {
			t.Fatal("want error")
		}
	})
	t.Run("chunk error stops the rest", func(t *testing.T) {
		var calls atomic.Int32
		_, err := runChunks(context.Background(), 1000, 1, 1, func(context.Context) (worker, error) {
			return funcWorker{doFn: func(c chunk) (int64, error) {
				calls.Add(1)
				if c.index == 3 {
					return 0, errors.New("EIO")
				}
				return 1, nil
			}}, nil
		})
		if err == nil || calls.Load() != 4 {
			t.Fatalf("err %v after %d chunks, want an error after 4", err, calls.Load())
		}
	})
}

func TestHostEngineNeedsHostMemory(t *testing.T) {
	f, _ := writeRandomFile(t, gpubuf.Align)
	if _, err := NewHostEngine(Options{}).ReadAt(context.Background(), f, &fakeDevMem{data: make([]byte, gpubuf.Align)}, 0, 0, 10); err == nil {
		t.Fatal("host engine accepted device memory")
	}
}

func TestMostlyCached(t *testing.T) {
	f, _ := writeRandomFile(t, 256*gpubuf.Align)
	if _, ok := pagecache.Cached(f, 0, 1); !ok {
		t.Skip("kernel without cachestat(2)")
	}
	if !rangeMostlyCached(f, 0, -1) {
		t.Fatal("a file just written is reported not cached")
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	if rangeMostlyCached(f, 0, -1) {
		t.Error("a file dropped from the page cache is reported cached")
	}
	empty, err := os.Create(filepath.Join(t.TempDir(), "empty"))
	if err != nil {
		t.Fatal(err)
	}
	defer empty.Close()
	if rangeMostlyCached(empty, 0, -1) {
		t.Error("an empty file is reported cached")
	}
}
