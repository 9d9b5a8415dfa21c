// Package cufile moves file bytes into GPU (or shared host) memory as fast as
// the host allows, and binds the libraries that takes: the CUDA driver API
// (libcuda.so.1) and GPUDirect Storage (libcufile.so.0), both loaded at run
// time with purego so that a CGO_ENABLED=0 binary runs on any glibc Linux
// host, with or without a GPU.
//
// # Engines
//
//   - gds: cuFileRead/cuFileWrite in parallel chunks from OS-thread-locked
//     workers with the device's primary context current. Each backing file is
//     registered once (cuFileHandleRegister on the engine's own descriptor,
//     cached by device and inode); with nvidia-fs each slab once
//     (cuFileBufRegister). In compat mode (no nvidia-fs) slabs are never
//     registered: compat mode bounces through libcufile's own buffers
//     either way, and a registration costs ~28 ms per slab and stalls
//     other CUDA work (bufregister.go).
//   - posix: parallel chunked pread (buffered, or O_DIRECT when cachestat(2)
//     says the range is mostly not cached) into pinned host staging
//     (cuMemHostAlloc), cuMemcpyHtoDAsync on one stream per staging buffer;
//     a worker reads chunk k+1 while chunk k is being copied. Writes go the
//     other way (D2H, then pwrite).
//   - host: no GPU. Slabs are shared host memory; parallel preads land in
//     them directly.
//
// Every engine validates ranges the same way (checkRange), returns a short
// count only at end of file, and honours context cancellation between chunks.
//
// # Choosing
//
// Open probes once (libcuda, devices, libcufile, cuFileDriverOpen,
// /dev/nvidia-fs*, /run/udev) and picks a default; Engines.Choose, the one
// engine chooser, decides per file and range and says why. With auto, GDS
// P2P is used with nvidia-fs present; without it, cuFile compat mode serves
// ranges mostly in the page cache and the posix pipeline the others (each
// where it measured faster; residency sampled, so no answer is cached).
// A file cuFile refuses, or fails on, is served by posix from then on,
// logged once; clients never see the cuFile error.
//
// # Slab memory
//
// With a GPU, slabs are CUDA virtual memory (vmm.go, memory.go): cuMemCreate
// with POSIX file descriptor handles, mapped in the daemon and zeroed whole.
// Clients never get bytes that open it: ctl's slab socket (package handoff)
// sends cuMemExportToShareableHandle's descriptor to a process of the
// session's uid only, and the physical memory lives until the last importer
// unmaps it, so a kept mapping never shows memory that serves another uid.
// cuFile (compat mode) and cuMemcpy*Async work on it as on cuMemAlloc
// memory. Only where a device or driver cannot (the probe "cuda slab
// handles" says why) slabs are cuMemAlloc memory exported as legacy IPC
// handles, which are bearer capabilities.
//
// # Pitfalls
//
//   - CUDA contexts are per OS thread: every driver call runs on a locked
//     thread with the context current (Driver.Do, or the workers' own
//     SetCurrent).
//   - libcufile is never unloaded (thread_local state crashes on dlclose),
//     and cuFileDriverOpen is skipped when nvidia-fs is loaded without its
//     /dev nodes (libcufile then closes fd 0).
//   - CUfileError_t is returned by value (8 bytes): it arrives whole in the
//     first return register and is decoded from there.
package cufile
