package reader

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
)

// fakeGPU stands in for the daemon's CUDA slabs and this process's CUDA
// driver: slab k's memory lives at a fake device address, reachable only
// through an opened IPC handle, and opening a handle twice fails as it does
// in CUDA.
type fakeGPU struct {
	slabs   map[uint64][]byte // slab id -> its memory (map offset included)
	mapOff  uint64
	kind    uint32
	device  int32
	open    map[uint64]uintptr // slab id -> base address while open
	opens   int
	closes  int
	copyErr error
}

const fakeBase = 1 << 40

func (g *fakeGPU) Slab(_ context.Context, id uint64) (ctl.SlabReply, error) {
	mem, ok := g.slabs[id]
	if !ok {
		return ctl.SlabReply{}, fmt.Errorf("SLAB %d: no such file or directory", id)
	}
	h := make([]byte, 64)
	binary.LittleEndian.PutUint64(h, id)
	return ctl.SlabReply{Slab: id, Size: uint64(len(mem)) - g.mapOff, MapOffset: g.mapOff, Kind: g.kind, Device: g.device, Handle: h}, nil
}

func (g *fakeGPU) IPCOpen(device int, handle []byte) (uintptr, error) {
	if len(handle) != 64 || int32(device) != g.device {
		return 0, errors.New("fake: bad IPCOpen")
	}
	id := binary.LittleEndian.Uint64(handle)
	if _, ok := g.open[id]; ok {
		return 0, errors.New("fake: CUDA_ERROR_ALREADY_MAPPED: handle opened twice in one process")
	}
	g.opens++
	p := uintptr(fakeBase * id)
	g.open[id] = p
	return p, nil
}

func (g *fakeGPU) IPCClose(device int, p uintptr) error {
	for id, q := range g.open {
		if q == p {
			delete(g.open, id)
			g.closes++
			return nil
		}
	}
	return errors.New("fake: IPCClose of an address not opened")
}

func (g *fakeGPU) CopyDtoH(device int, dst []byte, src uintptr) error {
	if g.copyErr != nil {
		return g.copyErr
	}
	id := uint64(src) / fakeBase
	mem, ok := g.slabs[id]
	if _, open := g.open[id]; !ok || !open {
		return fmt.Errorf("fake: copy from %#x: not an opened slab", src)
	}
	off := uint64(src) % fakeBase
	if off+uint64(len(dst)) > uint64(len(mem)) {
		return fmt.Errorf("fake: copy of %d bytes at %d outside slab %d", len(dst), off, id)
	}
	copy(dst, mem[off:])
	return nil
}

func newFakeGPU(mapOff uint64) *fakeGPU {
	g := &fakeGPU{slabs: map[uint64][]byte{}, mapOff: mapOff, kind: ctl.SlabCUDA, device: 0, open: map[uint64]uintptr{}}
	for id := uint64(1); id <= 2; id++ {
		mem := make([]byte, mapOff+1<<16)
		for i := range mem {
			mem[i] = byte(uint64(i)*7 + id)
		}
		g.slabs[id] = mem
	}
	return g
}

func TestCUDASlabsCopyBack(t *testing.T) {
	for _, mapOff := range []uint64{0, 512} {
		t.Run(fmt.Sprint("map offset ", mapOff), func(t *testing.T) {
			g := newFakeGPU(mapOff)
			c := newCUDASlabs(g, g, g, 0)
			ctx := context.Background()
			var buf []byte
			leases := []ctl.Lease{
				{ID: 1, Slab: 1, Offset: 4096 + 100, Length: 5000, Valid: 5000},
				{ID: 2, Slab: 2, Offset: 0, Length: 1 << 16, Valid: 1 << 16},
				{ID: 3, Slab: 1, Offset: 0, Length: 10, Valid: 3},
				{ID: 0, Slab: 0, Length: 10, Valid: 0}, // end of file: no memory
			}
			for _, l := range leases {
				got, err := c.bytes(ctx, l, &buf)
				if err != nil {
					t.Fatalf("lease %d: %v", l.ID, err)
				}
				if l.Valid == 0 {
					if len(got) != 0 {
						t.Errorf("lease without bytes gave %d bytes", len(got))
					}
					continue
				}
				want := g.slabs[l.Slab][mapOff+l.Offset : mapOff+l.Offset+l.Valid]
				if !bytes.Equal(got, want) {
					t.Errorf("lease %d: bytes differ from slab %d at %d", l.ID, l.Slab, l.Offset)
				}
			}
			if g.opens != 2 {
				t.Errorf("%d IPC opens for 2 slabs, want one each", g.opens)
			}
			c.close()
			if g.closes != 2 || len(g.open) != 0 {
				t.Errorf("close: %d handles closed, %d left open", g.closes, len(g.open))
			}
		})
	}
}

func TestCUDASlabsRefusals(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		setup func(g *fakeGPU)
		lease ctl.Lease
		want  string
	}{
		{"host slab", func(g *fakeGPU) { g.kind = ctl.SlabHost }, ctl.Lease{ID: 1, Slab: 1, Valid: 10}, "want CUDA memory"},
		{"other device", func(g *fakeGPU) { g.device = 1 }, ctl.Lease{ID: 1, Slab: 1, Valid: 10}, "on device 1"},
		{"unknown slab", func(*fakeGPU) {}, ctl.Lease{ID: 1, Slab: 9, Valid: 10}, "SLAB 9"},
		{"lease past the slab", func(*fakeGPU) {}, ctl.Lease{ID: 1, Slab: 1, Offset: 1<<16 - 4, Valid: 10}, "outside its"},
		{"copy fails", func(g *fakeGPU) { g.copyErr = errors.New("CUDA_ERROR_ILLEGAL_ADDRESS") }, ctl.Lease{ID: 7, Slab: 1, Valid: 10}, "copy lease 7 from the GPU"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := newFakeGPU(0)
			tc.setup(g)
			c := newCUDASlabs(g, g, g, 0)
			defer c.close()
			var buf []byte
			if _, err := c.bytes(ctx, tc.lease, &buf); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// Read refuses options it cannot run with before it touches the file
// (Parallel 0 would divide by zero when sizing the chunks).
func TestReadRefusesBadOptions(t *testing.T) {
	for _, o := range []Options{
		{Offset: -1, Length: -1, Parallel: 1, Passes: 1},
		{Length: -2, Parallel: 1, Passes: 1},
		{Length: -1, Parallel: 0, Passes: 1, Discard: true},
		{Length: -1, Parallel: 1, Passes: 0, Discard: true},
		{Length: -1, Parallel: 2, Passes: 1},
		{Length: -1, Parallel: 1, Passes: 1, EngineOnly: true},
	} {
		if err := Read(context.Background(), io.Discard, io.Discard, "/nonexistent/gdsfs/file", o); err == nil || !strings.HasPrefix(err.Error(), "reader: ") {
			t.Errorf("Read with %+v: %v, want the options refused", o, err)
		}
	}
}
