package cufile

import (
	"context"
	"fmt"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// The daemon's memory tier (package tier) keeps file extents in memory
// this file allocates, and has hits copied into slabs by CopyIn: on a GPU
// machine the extents are pinned host memory (cuMemHostAlloc, portable to
// every device's context) and a hit is one DMA host-to-device copy per
// extent, no CPU copy; with the host backend the extents are plain memory
// (the tier's own) and a hit is a memcpy. Tier memory is not
// cuFileBufRegister'ed: no cuFile call reads or writes it (pins fill it with
// pread from the page cache, hits drain it with cuMemcpyHtoD), and a
// registration would only pin it a second time.

// TierPinned reports whether the tier's memory should be pinned host
// memory from TierAlloc: the slab backend is CUDA.
func (e *Engines) TierPinned() bool {
	return e.drv != nil && e.backend != nil && e.backend.Name() == "cuda"
}

// TierAlloc allocates n bytes of pinned host memory for the tier.
func (e *Engines) TierAlloc(n int64) ([]byte, error) {
	if e.drv == nil {
		return nil, fmt.Errorf("cufile: pinned tier memory needs a GPU")
	}
	return e.drv.HostAlloc(0, n)
}

// TierFree frees memory from TierAlloc.
func (e *Engines) TierFree(b []byte) error {
	if e.drv == nil {
		return fmt.Errorf("cufile: pinned tier memory needs a GPU")
	}
	return e.drv.HostFree(0, b)
}

// CopyIn copies src (host memory; pinned for a DMA) into slab memory dst
// at dstOff: cuMemcpyHtoD into CUDA slabs, memcpy into host slabs. It
// implements the tier's Copier.
func (e *Engines) CopyIn(ctx context.Context, dst gpubuf.Memory, dstOff int64, src []byte) error {
	if dstOff < 0 || dstOff+int64(len(src)) > dst.Size() {
		return fmt.Errorf("cufile: copy of %d bytes at %d into a %d-byte slab: %w", len(src), dstOff, dst.Size(), ErrRange)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if hm, ok := dst.(gpubuf.HostMemory); ok {
		copy(hm.HostBytes()[dstOff:], src)
		return nil
	}
	dm, ok := dst.(gpubuf.DeviceMemory)
	if !ok || e.drv == nil {
		return fmt.Errorf("cufile: tier copy into %T: neither host nor CUDA memory", dst)
	}
	if err := e.drv.CopyHtoD(dm.Device(), dm.DevicePtr()+uintptr(dstOff), src); err != nil {
		return fmt.Errorf("cufile: tier copy to device %d: %w", dm.Device(), err)
	}
	return nil
}
