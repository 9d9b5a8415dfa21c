package cufile

import (
	"context"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/fileid"
)

// The lifetime rule of cuFile's registered handles. A registration holds
// the engine's own descriptor of the file (gdsEngine.acquire), cached so
// that the next READ of the file pays no cuFileHandleRegister. A cached
// descriptor of a file that was deleted, or renamed over, holds the file's
// blocks: on the GPU machine (2026-12-01) a deleted 8 GiB and a deleted
// 2 GiB checkpoint stayed allocated for as long as the daemon ran, and
// checkpoint rotation (save N+1, delete N) ran the disk full. So a cached
// registration does not outlive its file's last name:
//
//   - a name removed through the mount (unlink, or a rename over it) is
//     reported by the fs layer (fs.Options.Removed, wired to
//     Engines.Forget): if the file has no name left, its handles leave
//     the cache at once, before the unlink returns to the caller;
//   - a file deleted outside the mount (in the backing directory, or by
//     another mount of it) is found by the sweeper, which checks each
//     cached handle's descriptor every handleSweepEvery (fstat, nlink 0);
//   - a handle in use by a transfer when its file goes stays valid until
//     the transfer releases it, and is then closed (fileHandle.gone).
//
// The READ path is unchanged: no lock or system call is added to acquire.

// handleSweepEvery is how often the sweeper checks the cached handles for
// files deleted outside the mount: one fstat per cached handle (at most
// handleCacheMax, outside the cache's lock), so a deleted file's blocks
// stay allocated at most this long after its deletion.
const handleSweepEvery = time.Second

// unlinked reports whether f's file has no name left (fstat says nlink 0).
// An error (a descriptor closed meanwhile) is not proof of it: false.
func unlinked(f *os.File) bool {
	fi, err := f.Stat()
	if err != nil {
		return false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return ok && st.Nlink == 0
}

// accessModes are the modes a fileKey can have.
var accessModes = [...]int{unix.O_RDONLY, unix.O_WRONLY, unix.O_RDWR}

// forget takes the handles of inode id (in every access mode) whose file
// has no name left out of the cache: idle ones are closed now, busy ones at
// their last release. It returns the keys taken out.
func (e *gdsEngine) forget(id fileid.Inode) []fileKey {
	var cands []cachedHandle
	e.mu.Lock()
	for _, mode := range accessModes {
		k := fileKey{Inode: id, mode: mode}
		if fh := e.handles[k]; fh != nil {
			cands = append(cands, cachedHandle{k, fh})
		}
	}
	e.mu.Unlock()
	return e.dropUnlinked(cands)
}

// dropLocked takes fh (cached under k) out of the cache and reports
// whether it is idle, to be closed by the caller; a busy one is closed by
// its last unref. LOCKS_REQUIRED(e.mu)
func (e *gdsEngine) dropLocked(k fileKey, fh *fileHandle) bool {
	delete(e.handles, k)
	if fh.refs > 0 {
		fh.gone = true
		return false
	}
	return true
}

// sweep takes every cached handle whose file has no name left out of the
// cache (as forget does) and returns their keys.
func (e *gdsEngine) sweep() []fileKey {
	e.mu.Lock()
	all := make([]cachedHandle, 0, len(e.handles))
	for k, fh := range e.handles {
		all = append(all, cachedHandle{k, fh})
	}
	e.mu.Unlock()
	return e.dropUnlinked(all)
}

// cachedHandle is a handle and the key it was cached under.
type cachedHandle struct {
	k  fileKey
	fh *fileHandle
}

// dropUnlinked takes those of cands whose file has no name left out of
// the cache, if they are still cached under their keys, and returns their
// keys. The descriptors are checked outside the cache's lock, so READs are
// not held up by an fstat (a hung NFS server).
func (e *gdsEngine) dropUnlinked(cands []cachedHandle) []fileKey {
	var dead []cachedHandle
	for _, c := range cands {
		if unlinked(c.fh.f) {
			dead = append(dead, c)
		}
	}
	if len(dead) == 0 {
		return nil
	}
	var keys []fileKey
	var idle []*fileHandle
	e.mu.Lock()
	for _, c := range dead {
		if e.handles[c.k] != c.fh {
			continue // evicted, closed or replaced meanwhile
		}
		if e.dropLocked(c.k, c.fh) {
			idle = append(idle, c.fh)
		}
		keys = append(keys, c.k)
	}
	e.mu.Unlock()
	for _, fh := range idle {
		e.closeHandle(fh)
	}
	return keys
}

// Forget is told that a name of the file (dev, ino) was removed through
// the mount (an unlink, or a rename over it). If the file has no name
// left, its cuFile registrations leave the cache (an idle one is closed
// before Forget returns, one in use when its transfer ends), so the file's
// blocks go back to its filesystem at once; its per-file engine choice is
// forgotten either way (the next READ of the inode decides again). Without
// cuFile there is nothing to do. Safe for concurrent use.
func (e *Engines) Forget(dev, ino uint64) {
	if e.gds == nil {
		return
	}
	id := fileid.Inode{Dev: dev, Ino: ino}
	e.gds.forget(id)
	e.mu.Lock()
	for _, mode := range accessModes {
		delete(e.files, fileKey{Inode: id, mode: mode})
	}
	e.mu.Unlock()
}

// sweepHandles runs gdsEngine.sweep now and forgets the swept files'
// engine choices.
func (e *Engines) sweepHandles() {
	keys := e.gds.sweep()
	if len(keys) == 0 {
		return
	}
	e.mu.Lock()
	for _, k := range keys {
		delete(e.files, k)
	}
	e.mu.Unlock()
}

// startSweeper runs sweepHandles every handleSweepEvery until Close.
func (e *Engines) startSweeper() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	e.stopSweeper = func() {
		cancel()
		<-done
	}
	go func() {
		defer close(done)
		t := time.NewTicker(handleSweepEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				e.sweepHandles()
			}
		}
	}()
}
