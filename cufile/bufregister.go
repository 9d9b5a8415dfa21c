package cufile

import "github.com/gdsfs/gdsfs/gpubuf"

// cuFile compat mode never registers slabs.
//
// Without nvidia-fs cuFile runs in compat mode: it does no peer-to-peer
// DMA, it reads with POSIX preads into its own bounce buffers and copies
// them to the destination, registered with cuFileBufRegister or not.
// Measured on an H200 without nvidia-fs (libcufile 1.15,
// TestGPUCompatFirstTouch, 2026-12-02 02:20 UTC, 64 MiB slabs): one
// cuFileBufRegister of a fresh slab took 28.4 ms, and the first compat
// read into a fresh slab 27.9 ms with it inside (0.15 ms once the slab
// was registered); a cuFileRead into a fresh slab never registered took
// 0.20 ms (0.02 ms again), posix 0.08 ms. Registrations running beside
// compat reads stalled them too (a 512 MiB load into registered slabs:
// 95.7 ms alone, 277.8 ms with 8 registrations beside). So a fresh
// daemon's first warm load, whose READs land in new slabs, ran at 1.7-2.5
// GB/s instead of ~30, and registering buys compat mode nothing.
//
// The gds engine therefore registers a slab only with nvidia-fs
// (registerBufs, set from the same probe that names the engine gds or
// gds-compat): true GDS DMAs into registered memory and bounces the
// rest. The rule lives in the engine, so --engine auto, --engine gds,
// WRITEs, gdsfs read, doctor and gdsfs bench engines all follow it.

// bufRegistrar is device memory that can be registered with cuFile
// (*cudaMemory and *vmmMemory).
type bufRegistrar interface {
	register(lib *Lib) error
}

// registerBuf registers mem with cuFile, once per allocation, where that
// pays: with nvidia-fs. A registration that fails (BAR1 space, 5016) is
// no reason to fail the transfer: unregistered memory still works,
// bounced through cuFile's own buffers, only slower.
func (e *gdsEngine) registerBuf(mem gpubuf.Memory) {
	if !e.registerBufs {
		return
	}
	if r, ok := mem.(bufRegistrar); ok {
		_ = r.register(e.lib)
	}
}
