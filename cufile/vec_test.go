package cufile

import (
	"bytes"
	"context"
	"math/rand/v2"
	"testing"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// TestPosixReadVec checks the vectored read of many small ranges (issue 15)
// against the file, with the fake stager's asynchrony: segments are packed
// into one lane's staging buffers, a buffer is reused only after its
// stream is synced, and every copy is done when ReadVec returns. Segments
// larger than a chunk go through ReadAt; one past the end of the file is
// short.
func TestPosixReadVec(t *testing.T) {
	const chunk = 2 * gpubuf.Align // buffers of 4 pages: a few segments fill one
	size := 64 * gpubuf.Align
	f, data := writeRandomFile(t, size)
	cases := []struct {
		name string
		segs [][2]int64 // file offset, length
	}{
		{"one", [][2]int64{{100, 5000}}},
		{"many small, buffers reused", [][2]int64{{0, 4096}, {4096 + 512, 6000}, {20000, 8192}, {30000, 3}, {40000, 8000}, {50000, 7000}, {60000, 8192}, {70000, 100}, {80000, 8192}, {90000, 8192}}},
		{"mixed with a range above a chunk", [][2]int64{{0, 1000}, {10000, 5 * gpubuf.Align}, {40000, 2000}}},
		{"short at the end of the file", [][2]int64{{int64(size) - 1000, 4096}, {0, 10}}},
		{"empty", [][2]int64{{500, 0}, {600, 10}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			st := &fakeStager{failH2DAt: -1}
			e := newPosixEngine(st, Options{ChunkBytes: chunk, Workers: 2, Slots: 2, Direct: "never"})
			mem := &fakeDevMem{data: make([]byte, 64*gpubuf.Align)}
			var segs []Segment
			var at int64
			for _, s := range c.segs {
				segs = append(segs, Segment{Dst: mem, DstOff: at, FileOff: s[0], N: s[1]})
				at += gpubuf.AlignUp(s[1] + 1)
			}
			got, err := e.ReadVec(context.Background(), f, segs)
			if err != nil {
				t.Fatal(err)
			}
			for i, s := range segs {
				want := data[min(int64(size), s.FileOff):min(int64(size), s.FileOff+s.N)]
				if got[i] != int64(len(want)) {
					t.Fatalf("segment %d: %d bytes read, want %d", i, got[i], len(want))
				}
				if !bytes.Equal(mem.data[s.DstOff:s.DstOff+got[i]], want) {
					t.Fatalf("segment %d (file %d+%d): the bytes in memory are not the file's", i, s.FileOff, s.N)
				}
			}
			// The lane went back to the pool: nothing leaks per call.
			if p := e.pool(0); len(p.free) != p.created {
				t.Errorf("%d lanes created, %d back in the pool", p.created, len(p.free))
			}
		})
	}
}

func TestPosixReadVecErrors(t *testing.T) {
	const chunk = 2 * gpubuf.Align
	f, _ := writeRandomFile(t, 16*gpubuf.Align)
	mem := &fakeDevMem{data: make([]byte, 16*gpubuf.Align)}
	segs := []Segment{{Dst: mem, DstOff: 0, FileOff: 0, N: 4096}, {Dst: mem, DstOff: 4096, FileOff: 8192, N: 4096}, {Dst: mem, DstOff: 8192, FileOff: 16384, N: 4096}}
	t.Run("copy error", func(t *testing.T) {
		st := &fakeStager{failH2DAt: 4096}
		e := newPosixEngine(st, Options{ChunkBytes: chunk, Workers: 1, Direct: "never"})
		if _, err := e.ReadVec(context.Background(), f, segs); err == nil {
			t.Fatal("ReadVec succeeded despite a failed copy")
		}
		if p := e.pool(0); len(p.free) != 1 {
			t.Errorf("the lane did not go back after a failed copy (%d free)", len(p.free))
		}
	})
	t.Run("out of the memory", func(t *testing.T) {
		e := newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 1, Direct: "never"})
		bad := append([]Segment{}, segs...)
		bad[1].DstOff = mem.Size() - 10
		if _, err := e.ReadVec(context.Background(), f, bad); err == nil {
			t.Fatal("ReadVec accepted a segment past its memory")
		}
	})
	t.Run("two devices", func(t *testing.T) {
		e := newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 1, Direct: "never"})
		other := &fakeDevMem{data: make([]byte, 16*gpubuf.Align), device: 1}
		mixed := append([]Segment{}, segs...)
		mixed[2].Dst = other
		if _, err := e.ReadVec(context.Background(), f, mixed); err == nil {
			t.Fatal("ReadVec accepted segments on two devices")
		}
	})
	t.Run("cancelled", func(t *testing.T) {
		e := newPosixEngine(&fakeStager{failH2DAt: -1}, Options{ChunkBytes: chunk, Workers: 1, Direct: "never"})
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := e.ReadVec(ctx, f, segs); err == nil {
			t.Fatal("ReadVec succeeded with its context cancelled")
		}
	})
}

// TestGPUReadVec is TestPosixReadVec on a GPU (skipped without one): 300
// small ranges of 1 B to 300 KiB, some across buffers, one across the end
// of the file, into device memory through the real lanes, compared with
// the file.
func TestGPUReadVec(t *testing.T) {
	e := gpuEngines(t)
	const fileSize = 64<<20 + 777
	f, data := gpuTestFile(t, fileSize)
	ctx := context.Background()
	memSize := int64(128 << 20)
	mem, err := e.Backend().Alloc(ctx, 0, memSize, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	dm := mem.(gpubuf.DeviceMemory)
	eng := newPosixEngine(cudaStager{d: e.drv}, Options{Direct: "never"})
	defer eng.Close()
	r := rand.New(rand.NewPCG(15, 15))
	var segs []Segment
	var at int64
	for range 300 {
		n := 1 + r.Int64N(300<<10)
		off := r.Int64N(fileSize - n)
		segs = append(segs, Segment{Dst: mem, DstOff: at, FileOff: off, N: n})
		at = gpubuf.AlignUp(at + n)
	}
	segs = append(segs, Segment{Dst: mem, DstOff: at, FileOff: fileSize - 100, N: 4096})
	got, err := eng.ReadVec(ctx, f, segs)
	if err != nil {
		t.Fatal(err)
	}
	back := make([]byte, memSize)
	if err := e.drv.CopyDtoH(0, back, dm.DevicePtr()); err != nil {
		t.Fatal(err)
	}
	for i, s := range segs {
		want := data[s.FileOff:min(fileSize, s.FileOff+s.N)]
		if got[i] != int64(len(want)) || !bytes.Equal(back[s.DstOff:s.DstOff+got[i]], want) {
			t.Fatalf("segment %d (file %d+%d): %d bytes, or bytes that differ from the file", i, s.FileOff, s.N, got[i])
		}
	}
}
