package cufile

import (
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/internal/fileid"
	"github.com/gdsfs/gdsfs/internal/openflags"
)

// fileKey identifies a backing file and an access mode independently of
// the descriptor that names it: a cuFile handle registered for one open
// serves every open of the same file with the same access mode (and no
// other: a handle never reads or writes for a descriptor without that
// right).
type fileKey struct {
	fileid.Inode
	mode int // O_RDONLY, O_WRONLY or O_RDWR
}

// keyOf returns f's key, with f's own access mode.
func keyOf(f *os.File) (fileKey, error) {
	id, err := fileid.OfFile(f)
	if err != nil {
		return fileKey{}, err
	}
	mode, err := accessMode(f)
	if err != nil {
		return fileKey{}, err
	}
	return fileKey{Inode: id.Inode, mode: mode}, nil
}

// isWritable reports whether f was opened for writing: the kernel checked the
// client's permission for exactly that at open.
func isWritable(f *os.File) bool { return openflags.Writable(f) }

// handleCacheMax bounds the registered handles (each holds a descriptor).
const handleCacheMax = 1024

// handleLib is what the handle cache calls of libcufile: *Lib in
// production, a fake in the CPU tests of the cache's lifetime rule.
type handleLib interface {
	HandleRegister(fd int) (uintptr, error)
	HandleDeregister(h uintptr)
}

// gdsIO is what a transfer calls of libcufile to move bytes: *Lib in
// production, a fake in the CPU tests.
type gdsIO interface {
	Read(h, base uintptr, size, fileOff, bufOff int64) (int64, error)
	Write(h, base uintptr, size, fileOff, bufOff int64) (int64, error)
}

// gdsDevice is what a transfer calls of the CUDA driver: *Driver in
// production, a fake in the CPU tests.
type gdsDevice interface {
	SetCurrent(device int) error
	Memset(device int, p uintptr, v byte, n int64) error
}

// gdsEngine moves bytes with cuFileRead/cuFileWrite in parallel chunks from
// OS-thread-locked workers with the device context current: the threads of
// its pool (threadpool.go), or without it each transfer's own.
type gdsEngine struct {
	name string // EngineGDS, or EngineGDSCompat without nvidia-fs
	d    gdsDevice
	lib  *Lib      // what slabs are registered with (registerBufs)
	io   gdsIO     // lib's cuFileRead/cuFileWrite (a fake in tests)
	reg  handleLib // lib's handle calls (handles.go's rule; a fake in tests)
	// registerBufs: slabs are registered with cuFile (cuFileBufRegister)
	// on their first transfer; only with nvidia-fs (bufregister.go).
	registerBufs bool
	chunkBytes   int64
	workers      int
	// pool runs every transfer's chunks on its fixed threads; nil with
	// GDSFS_CUFILE_POOL=0: each transfer locks workers threads of its own.
	pool *threadPool

	mu      sync.Mutex
	handles map[fileKey]*fileHandle // GUARDED_BY(mu)
}

// fileHandle is a cuFile registration of the engine's own descriptor of a
// backing file (so the handle outlives the caller's descriptor). A handle
// of a file that lost its last name is taken out of the cache at once and
// closed when its last user releases it (gone), so that the file's blocks
// go back to its filesystem (handles.go).
type fileHandle struct {
	f    *os.File
	h    uintptr
	refs int  // GUARDED_BY(gdsEngine.mu)
	gone bool // GUARDED_BY(gdsEngine.mu): out of the cache; the last unref closes it
}

func newGDSEngine(d *Driver, lib *Lib, chunkBytes int64, workers int, compat bool) *gdsEngine {
	if chunkBytes <= 0 {
		chunkBytes = DefaultChunkBytes
	}
	if workers <= 0 {
		workers = DefaultWorkers()
	}
	name := EngineGDS
	if compat {
		name = EngineGDSCompat
	}
	e := &gdsEngine{name: name, d: d, lib: lib, io: lib, reg: lib, registerBufs: !compat,
		chunkBytes: chunkBytes, workers: workers, handles: map[fileKey]*fileHandle{}}
	if poolEnabled(os.Getenv(poolEnv)) {
		e.pool = newThreadPool(poolThreads(workers), e.bind)
	}
	return e
}

// prime starts the pool's threads now, each making the context of every
// one of devices devices current once, so that a first READ finds them
// ready; without the pool it does nothing.
func (e *gdsEngine) prime(devices int) {
	if e.pool == nil {
		return
	}
	prime := make([]int, devices)
	for i := range prime {
		prime[i] = i
	}
	e.pool.start(prime)
}

// bind makes device's context current on the calling OS thread (a pool
// thread, locked).
func (e *gdsEngine) bind(device int) error { return e.d.SetCurrent(device) }

func (e *gdsEngine) Name() string { return e.name }

// acquire returns the registered handle for f, registering it on first use.
// The handle's descriptor is a reopen of f with f's own access mode.
func (e *gdsEngine) acquire(f *os.File) (*fileHandle, func(), error) {
	k, err := keyOf(f)
	if err != nil {
		return nil, nil, err
	}
	e.mu.Lock()
	fh := e.handles[k]
	if fh != nil {
		fh.refs++
		e.mu.Unlock()
		return fh, func() { e.unref(fh) }, nil
	}
	e.mu.Unlock()
	own, err := openflags.Reopen(f, k.mode)
	if err != nil {
		return nil, nil, fmt.Errorf("reopen %q for cuFile: %w", f.Name(), err)
	}
	h, err := e.reg.HandleRegister(int(own.Fd()))
	if err != nil {
		_ = own.Close()
		return nil, nil, err
	}
	fh = &fileHandle{f: own, h: h, refs: 1}
	e.mu.Lock()
	if old := e.handles[k]; old != nil {
		// Registered concurrently: keep the first, drop ours.
		old.refs++
		e.mu.Unlock()
		e.reg.HandleDeregister(h)
		_ = own.Close()
		return old, func() { e.unref(old) }, nil
	}
	if len(e.handles) >= handleCacheMax {
		e.evictLocked()
	}
	e.handles[k] = fh
	e.mu.Unlock()
	return fh, func() { e.unref(fh) }, nil
}

func (e *gdsEngine) unref(fh *fileHandle) {
	e.mu.Lock()
	fh.refs--
	last := fh.refs == 0 && fh.gone
	e.mu.Unlock()
	if last {
		e.closeHandle(fh)
	}
}

// closeHandle deregisters fh and closes its descriptor; fh is out of the
// cache and unused.
func (e *gdsEngine) closeHandle(fh *fileHandle) {
	e.reg.HandleDeregister(fh.h)
	_ = fh.f.Close()
}

// evictLocked drops idle handles. LOCKS_REQUIRED(e.mu)
func (e *gdsEngine) evictLocked() {
	for k, fh := range e.handles {
		if fh.refs == 0 {
			delete(e.handles, k)
			e.closeHandle(fh)
		}
	}
}

// probe registers f (the per-file step of the auto chooser).
func (e *gdsEngine) probe(f *os.File) error {
	_, done, err := e.acquire(f)
	if err != nil {
		return err
	}
	done()
	return nil
}

// Close stops the pool, waiting for the chunks in flight, then deregisters
// every handle. Transfers after it fail with errEngineClosed.
func (e *gdsEngine) Close() {
	if e.pool != nil {
		e.pool.close()
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for k, fh := range e.handles {
		delete(e.handles, k)
		e.closeHandle(fh)
	}
}

func (e *gdsEngine) ReadAt(ctx context.Context, f *os.File, dst gpubuf.Memory, dstOff, fileOff, n int64) (int64, error) {
	return e.transfer(ctx, f, dst, dstOff, fileOff, n, false)
}

func (e *gdsEngine) WriteAt(ctx context.Context, f *os.File, src gpubuf.Memory, srcOff, fileOff, n int64) (int64, error) {
	if !isWritable(f) {
		return 0, fmt.Errorf("gds write %q: %w", f.Name(), syscall.EBADF)
	}
	return e.transfer(ctx, f, src, srcOff, fileOff, n, true)
}

func (e *gdsEngine) transfer(ctx context.Context, f *os.File, mem gpubuf.Memory, memOff, fileOff, n int64, write bool) (int64, error) {
	op := "gds read"
	if write {
		op = "gds write"
	}
	if err := checkRange(mem, memOff, fileOff, n); err != nil {
		return 0, err
	}
	var err error
	dm, ok := mem.(gpubuf.DeviceMemory)
	if !ok {
		return 0, fmt.Errorf("%s: needs device memory, got %T", op, mem)
	}
	e.registerBuf(mem)
	if mode, err := accessMode(f); err != nil {
		return 0, fmt.Errorf("%s: %w", op, err)
	} else if (mode == unix.O_WRONLY && !write) || (mode == unix.O_RDONLY && write) {
		return 0, fmt.Errorf("%s %q: descriptor not open for it: %w", op, f.Name(), syscall.EBADF)
	}
	if !write {
		if n, _, err = clampToEOF(f, fileOff, n); err != nil {
			return 0, fmt.Errorf("%s: %w", op, err)
		}
		if n == 0 {
			return 0, nil
		}
	}
	if e.pool != nil && e.pool.closed() {
		return 0, fmt.Errorf("%s %q: %w", op, f.Name(), errEngineClosed)
	}
	fh, done, err := e.acquire(f)
	if err != nil {
		return 0, fmt.Errorf("%s %q: %w", op, f.Name(), err)
	}
	defer done()
	base, device := dm.DevicePtr(), dm.Device()
	// move moves chunk c on a thread with device's context current.
	move := func(c chunk) (int64, error) {
		var done int64
		for done < c.n {
			var m int64
			var err error
			if write {
				m, err = e.io.Write(fh.h, base, c.n-done, fileOff+c.off+done, memOff+c.off+done)
			} else {
				m, err = e.io.Read(fh.h, base, c.n-done, fileOff+c.off+done, memOff+c.off+done)
			}
			if err != nil {
				return done, err
			}
			if m == 0 {
				if write {
					return done, errors.New("cuFileWrite wrote 0 bytes")
				}
				// The file shrank since clampToEOF: cuFile may have
				// written bytes that are not the file's past done.
				if err := e.d.Memset(device, base+uintptr(memOff+c.off+done), 0, c.n-done); err != nil {
					return done, err
				}
				break
			}
			done += m
		}
		return done, nil
	}
	var got int64
	if e.pool != nil {
		got, err = e.pool.run(newChunkRun(ctx, n, e.chunkBytes), device, e.workers, move)
	} else {
		got, err = runChunks(ctx, n, e.chunkBytes, e.workers, func(context.Context) (worker, error) {
			runtime.LockOSThread()
			if err := e.d.SetCurrent(device); err != nil {
				runtime.UnlockOSThread()
				return nil, err
			}
			return funcWorker{doFn: move, finishFn: func() error { runtime.UnlockOSThread(); return nil }}, nil
		})
	}
	if err != nil {
		return 0, fmt.Errorf("%s %q: %w", op, f.Name(), err)
	}
	return got, nil
}
