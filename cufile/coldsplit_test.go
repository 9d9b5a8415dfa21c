package cufile

import (
	"bytes"
	"context"
	"errors"
	"os"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// coldFile writes a file of n random bytes, syncs it and drops its pages,
// skipping the test where the kernel cannot tell or keeps them.
func coldFile(t *testing.T, n int) (*os.File, []byte) {
	t.Helper()
	f, data := writeRandomFile(t, n)
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	dropPages(t, f)
	if c, ok := pagecache.Cached(f, 0, int64(n)); !ok {
		t.Skip("kernel without cachestat(2)")
	} else if c > int64(n)/2 {
		t.Skipf("the page cache kept %d of %d dropped bytes (filesystem ignores FADV_DONTNEED)", c, n)
	}
	return f, data
}

// TestReadTaskBytes checks the one rule for a read's task size: small
// tasks, evenly sized, only for a buffered read of a cold range of at
// least two cold tasks.
func TestReadTaskBytes(t *testing.T) {
	const chunk, cold = 16 * gpubuf.Align, 4 * gpubuf.Align
	f, _ := coldFile(t, 64*gpubuf.Align)
	opts := Options{ChunkBytes: chunk, ColdTaskBytes: cold}.withDefaults()
	off := Options{ChunkBytes: chunk, ColdTaskBytes: chunk}.withDefaults()
	for _, tc := range []struct {
		name    string
		opts    Options
		off, n  int64
		direct  bool
		warmFst bool // read the range first (into the page cache)
		want    int64
	}{
		{"cold range of four cold tasks", opts, 0, 16 * gpubuf.Align, false, false, cold},
		{"cold, two cold tasks", opts, 0, 2 * cold, false, false, cold},
		{"cold, split evenly, no sliver", opts, 0, 2*cold + 100, false, false, cold + gpubuf.Align},
		{"cold, unaligned, above a chunk", opts, 4095, 40*gpubuf.Align + 3, false, false, 5 * gpubuf.Align},
		{"cold range of one cold task", opts, 0, cold, false, false, chunk},
		{"cold range under two cold tasks", opts, 0, 2*cold - 1, false, false, chunk},
		{"cold, O_DIRECT", opts, 0, 16 * gpubuf.Align, true, false, chunk},
		{"cold, split off", off, 0, 16 * gpubuf.Align, false, false, chunk},
		{"warm range", opts, 32 * gpubuf.Align, 16 * gpubuf.Align, false, true, chunk},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.warmFst {
				if _, err := preadFull(f, make([]byte, tc.n), tc.off); err != nil {
					t.Fatal(err)
				}
			}
			if got := tc.opts.readTaskBytes(f, tc.off, tc.n, tc.direct); got != tc.want {
				t.Errorf("readTaskBytes(%d+%d, direct %v) = %d, want %d", tc.off, tc.n, tc.direct, got, tc.want)
			}
		})
	}
	if got := (Options{ColdTaskBytes: 100}).withDefaults().ColdTaskBytes; got != gpubuf.Align {
		t.Errorf("ColdTaskBytes 100 became %d, want %d (4 KiB-aligned)", got, gpubuf.Align)
	}
}

// TestColdSplitKeepsBytes reads cold ranges, split into cold tasks, with
// the host and posix engines (ReadAt and ReadVec) and checks every byte
// against the backing file: odd offsets and lengths, ranges ending at or
// past end of file, a file shorter than one cold task.
func TestColdSplitKeepsBytes(t *testing.T) {
	const chunk, cold = 8 * gpubuf.Align, 2 * gpubuf.Align
	opts := Options{ChunkBytes: chunk, ColdTaskBytes: cold, Workers: 3}
	const size = 40*gpubuf.Align + 777
	type engineUnder struct {
		name  string
		e     Engine
		mem   func(n int) gpubuf.Memory
		bytes func(m gpubuf.Memory) []byte
	}
	engines := func() []engineUnder {
		host := func(n int) gpubuf.Memory { return &hostMem{mmapBytes(n)} }
		hostBytes := func(m gpubuf.Memory) []byte { return m.(*hostMem).b }
		dev := func(n int) gpubuf.Memory { return &fakeDevMem{data: make([]byte, n)} }
		devBytes := func(m gpubuf.Memory) []byte { return m.(*fakeDevMem).data }
		never, auto := opts, opts
		never.Direct, auto.Direct = "never", "auto"
		return []engineUnder{
			{"host", NewHostEngine(never), host, hostBytes},
			{"host-auto", NewHostEngine(auto), host, hostBytes},
			{"posix", newPosixEngine(&fakeStager{failH2DAt: -1}, never), dev, devBytes},
			{"posix-auto", newPosixEngine(&fakeStager{failH2DAt: -1}, auto), dev, devBytes},
		}
	}
	cases := []struct {
		name            string
		fileSize        int
		memOff, fileOff int64
		n, want         int64
	}{
		{"aligned, several tasks", size, 0, 0, 12 * gpubuf.Align, 12 * gpubuf.Align},
		{"odd offsets and length", size, 17, 4095, 9*gpubuf.Align + 13, 9*gpubuf.Align + 13},
		{"tasks across chunks", size, gpubuf.Align, 3, 30*gpubuf.Align + 1, 30*gpubuf.Align + 1},
		{"ends at EOF", size, 5, size - 11*gpubuf.Align - 1, 11*gpubuf.Align + 1, 11*gpubuf.Align + 1},
		{"across EOF", size, 0, size - 5*gpubuf.Align - 300, 9 * gpubuf.Align, 5*gpubuf.Align + 300},
		{"whole file", size, 0, 0, size, size},
		{"file shorter than a cold task", gpubuf.Align + 9, 3, 1, 8 * gpubuf.Align, gpubuf.Align + 8},
	}
	for _, ec := range engines() {
		t.Run(ec.name, func(t *testing.T) {
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					f, data := coldFile(t, tc.fileSize)
					mem := ec.mem(48 * gpubuf.Align)
					got, err := ec.e.ReadAt(context.Background(), f, mem, tc.memOff, tc.fileOff, tc.n)
					if err != nil || got != tc.want {
						t.Fatalf("ReadAt = %d, %v; want %d", got, err, tc.want)
					}
					b := ec.bytes(mem)
					if !bytes.Equal(b[tc.memOff:tc.memOff+got], data[tc.fileOff:tc.fileOff+got]) {
						t.Fatal("bytes differ from the file")
					}
					if bytes.ContainsFunc(b[:tc.memOff], func(r rune) bool { return r != 0 }) || bytes.ContainsFunc(b[tc.memOff+got:], func(r rune) bool { return r != 0 }) {
						t.Error("bytes outside the destination range were written")
					}
				})
			}
			vr, ok := ec.e.(VecReader)
			if !ok {
				return
			}
			t.Run("ReadVec, cold segments above a cold task", func(t *testing.T) {
				f, data := coldFile(t, size)
				mem := ec.mem(64 * gpubuf.Align)
				want := [][2]int64{{100, 1000}, {3 * gpubuf.Align, 5*gpubuf.Align + 7}, {size - 3*gpubuf.Align, 4 * gpubuf.Align}, {20 * gpubuf.Align, 11 * gpubuf.Align}}
				var segs []Segment
				var at int64
				for _, s := range want {
					segs = append(segs, Segment{Dst: mem, DstOff: at, FileOff: s[0], N: s[1]})
					at += gpubuf.AlignUp(s[1] + 1)
				}
				got, err := vr.ReadVec(context.Background(), f, segs)
				if err != nil {
					t.Fatal(err)
				}
				for i, s := range segs {
					w := data[min(size, s.FileOff):min(size, s.FileOff+s.N)]
					if got[i] != int64(len(w)) || !bytes.Equal(ec.bytes(mem)[s.DstOff:s.DstOff+got[i]], w) {
						t.Fatalf("segment %d (file %d+%d): %d bytes, not the file's %d", i, s.FileOff, s.N, got[i], len(w))
					}
				}
			})
		})
	}
}

// TestRunChunksCancelAndBound checks what splitting relies on: a cancelled
// context stops the tasks not yet started, and no more tasks run at once
// than the workers bound.
func TestRunChunksCancelAndBound(t *testing.T) {
	t.Run("cancel mid-read stops the rest", func(t *testing.T) {
		const workers, cancelAt = 3, 5
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var cancelled atomic.Bool
		var late atomic.Int32 // chunks that began after the cancel
		_, err := runChunks(ctx, 1000, 1, workers, func(context.Context) (worker, error) {
			return funcWorker{doFn: func(c chunk) (int64, error) {
				if cancelled.Load() {
					late.Add(1)
				}
				if c.index == cancelAt {
					cancel()
					cancelled.Store(true)
				}
				return c.n, nil
			}}, nil
		})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("runChunks = %v, want context.Canceled", err)
		}
		// Chunk indices are claimed by whichever worker is free, so chunks
		// after cancelAt may run before it; what the cancel bounds is what
		// begins after it: at most one chunk by each other worker that had
		// checked the context just before.
		if n := late.Load(); n > workers-1 {
			t.Errorf("%d chunks began after a cancel at chunk %d with %d workers", n, cancelAt, workers)
		}
	})
	t.Run("cancel through the host engine", func(t *testing.T) {
		f, _ := coldFile(t, 16*gpubuf.Align)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		e := NewHostEngine(Options{ChunkBytes: 8 * gpubuf.Align, ColdTaskBytes: gpubuf.Align, Workers: 2})
		if _, err := e.ReadAt(ctx, f, &hostMem{make([]byte, 16*gpubuf.Align)}, 0, 0, 16*gpubuf.Align); !errors.Is(err, context.Canceled) {
			t.Fatalf("ReadAt = %v, want context.Canceled", err)
		}
	})
	t.Run("in flight bound", func(t *testing.T) {
		for _, workers := range []int{1, 2, 5} {
			var inFlight, most atomic.Int32
			got, err := runChunks(context.Background(), 200, 1, workers, func(context.Context) (worker, error) {
				return funcWorker{doFn: func(c chunk) (int64, error) {
					n := inFlight.Add(1)
					for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
					}
					runtime.Gosched() // let the other workers overlap this one
					inFlight.Add(-1)
					return c.n, nil
				}}, nil
			})
			if err != nil || got != 200 {
				t.Fatalf("runChunks = %d, %v", got, err)
			}
			if m := most.Load(); m > int32(workers) {
				t.Errorf("%d tasks in flight with %d workers", m, workers)
			}
		}
	})
	t.Run("posix lanes bound", func(t *testing.T) {
		f, data := coldFile(t, 32*gpubuf.Align)
		st := &countingStager{fakeStager: &fakeStager{failH2DAt: -1}}
		e := newPosixEngine(st, Options{ChunkBytes: 16 * gpubuf.Align, ColdTaskBytes: gpubuf.Align, Workers: 2, Direct: "never"})
		mem := &fakeDevMem{data: make([]byte, 32*gpubuf.Align)}
		got, err := e.ReadAt(context.Background(), f, mem, 0, 0, 32*gpubuf.Align)
		if err != nil || got != 32*gpubuf.Align || !bytes.Equal(mem.data, data) {
			t.Fatalf("ReadAt = %d, %v (bytes equal %v)", got, err, bytes.Equal(mem.data, data))
		}
		if st.lanes > 2 {
			t.Errorf("%d lanes for 32 cold tasks, bound 2", st.lanes)
		}
		if n := st.copies.Load(); n != 32 {
			t.Errorf("a cold range of 32 pages in 1-page tasks took %d copies, want 32", n)
		}
	})
}

// countingStager counts the host-to-device copies of its lanes: one per
// task of a posix read.
type countingStager struct {
	*fakeStager
	copies atomic.Int32
}

func (s *countingStager) newLane(device, slots int, bufBytes int64) (lane, error) {
	l, err := s.fakeStager.newLane(device, slots, bufBytes)
	return countingLane{l, &s.copies}, err
}

type countingLane struct {
	lane
	copies *atomic.Int32
}

func (l countingLane) h2d(slot int, dst gpubuf.Memory, off int64, src []byte) error {
	l.copies.Add(1)
	return l.lane.h2d(slot, dst, off, src)
}
