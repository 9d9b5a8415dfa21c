package tier

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/engname"
)

// EngineName is the name (and protocol engine code name) of reads the
// tier served.
const EngineName = engname.Tier

// Copier copies tier bytes into slab memory: a memcpy into host slabs, a
// DMA host-to-device copy into CUDA slabs (cufile's). src is extent memory
// (pinned on a GPU machine). Called concurrently.
type Copier interface {
	CopyIn(ctx context.Context, dst gpubuf.Memory, dstOff int64, src []byte) error
}

// HostCopier copies into host slabs (gpubuf.HostMemory) with memcpy.
type HostCopier struct{}

// CopyIn implements Copier.
func (HostCopier) CopyIn(ctx context.Context, dst gpubuf.Memory, dstOff int64, src []byte) error {
	hm, ok := dst.(gpubuf.HostMemory)
	if !ok {
		return fmt.Errorf("tier: host copier needs host memory, got %T", dst)
	}
	b := hm.HostBytes()
	if dstOff < 0 || dstOff+int64(len(src)) > int64(len(b)) {
		return fmt.Errorf("tier: copy of %d bytes at %d into a %d-byte slab", len(src), dstOff, len(b))
	}
	copy(b[dstOff:], src)
	return ctx.Err()
}

// Engine serves one READ from a View: it has the shape of cufile.Engine
// (ReadAt, WriteAt, Name), so the control path moves the bytes of a hit
// exactly as it moves an engine's. f is not read.
type Engine struct {
	View   *View
	Copier Copier
	// UID is the reading uid: the device tier's copies a READ makes are
	// charged to it.
	UID uint32
}

// Name is EngineName.
func (e Engine) Name() string { return EngineName }

// ReadAt copies [fileOff, fileOff+n) of the file from the tier into dst at
// dstOff; short only at end of file.
func (e Engine) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	if fileOff < 0 || n < 0 || dstOff < 0 || dstOff+n > dst.Size() {
		return 0, fmt.Errorf("tier: read of %d bytes at %d into %d of a %d-byte slab: bad range", n, fileOff, dstOff, dst.Size())
	}
	// A copy on the slab's GPU (the device tier): device to device.
	if dm, ok := dst.(gpubuf.DeviceMemory); ok {
		if dc, ok := e.Copier.(DeviceCopier); ok {
			if c := e.View.deviceOn(ctx, dm.Device(), dc, e.UID); c != nil {
				return e.View.pieces(fileOff, n, func(pos int64, i int, within, m int64) error {
					return dc.DeviceToSlab(ctx, dst, dstOff+pos, c.ext[i].Ptr()+uintptr(within), m)
				})
			}
		}
	}
	return e.View.Each(fileOff, n, func(pos int64, b []byte) error {
		return e.Copier.CopyIn(ctx, dst, dstOff+pos, b)
	})
}

// ErrReadOnly: the tier serves reads only.
var ErrReadOnly = errors.New("tier: the tier serves reads only")

// WriteAt fails: writes go to the backing file through an engine.
func (e Engine) WriteAt(context.Context, *os.File, gpubuf.Memory, int64, int64, int64) (int64, error) {
	return 0, ErrReadOnly
}
