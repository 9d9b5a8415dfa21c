package gpubuf

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// HostBackend allocates slabs as new shared-memory files in a private
// directory (by default /dev/shm/gdsfs-<pid>-<random>), one subdirectory per
// uid (u-<random>, owned by the uid, mode 0500: only it and root can look
// inside), mmapped by the daemon. A client in another process maps a slab
// by opening the path Export returns; the file is mode 0600 and owned by the
// uid the slab serves from its creation, so only that uid (and root) can.
// No other uid can even tell which uids have slabs or how large they are.
// The backend holds a lock on the directory's lock file for its lifetime:
// that is how a later daemon tells a live directory from one left by a
// killed daemon (see slabdir.go).
type HostBackend struct {
	dir  string
	next atomic.Uint64

	mu     sync.Mutex
	closed bool
	lock   *os.File          // GUARDED_BY(mu): holds the directory's lock; nil once closed
	uids   map[uint32]string // GUARDED_BY(mu): the uids' subdirectories made so far
}

// HostBackendOptions configures NewHostBackend. The zero value is usable.
type HostBackendOptions struct {
	// Dir is the directory that holds the slab files. It is created (mode
	// 0711: others may open a file they own but not list the directory) and
	// removed by Close. Default: a new /dev/shm/gdsfs-<pid>-<random>, after
	// removing the directories under /dev/shm of daemons no longer running.
	Dir string
}

// NewHostBackend creates the slab directory and returns the backend.
func NewHostBackend(opts HostBackendOptions) (*HostBackend, error) {
	dir := opts.Dir
	if dir == "" {
		removeStaleDirs(shmParent)
		name, err := newSlabDirName()
		if err != nil {
			return nil, err
		}
		dir = filepath.Join(shmParent, name)
	}
	lock, err := createSlabDir(dir)
	if err != nil {
		return nil, err
	}
	return &HostBackend{dir: dir, lock: lock, uids: map[uint32]string{}}, nil
}

// uidDir returns uid's subdirectory, making it on first use.
func (b *HostBackend) uidDir(uid uint32) (string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return "", ErrClosed
	}
	if d, ok := b.uids[uid]; ok {
		return d, nil
	}
	// A random name: other uids can look names up in the 0711 parent,
	// and must not learn which uids have slabs.
	var r [8]byte
	if _, err := rand.Read(r[:]); err != nil {
		return "", fmt.Errorf("gpubuf: random slab directory name: %w", err)
	}
	d := filepath.Join(b.dir, "u-"+hex.EncodeToString(r[:]))
	// 0500: the uid may look up and open its files but not add, remove
	// or rename any. Root (the daemon serving other users) creates files
	// regardless; a daemon running as its own user needs write access.
	mode := os.FileMode(0o500)
	if os.Geteuid() != 0 {
		mode = 0o700
	}
	if err := os.Mkdir(d, 0o700); err != nil {
		return "", fmt.Errorf("gpubuf: create slab directory of uid %d: %w", uid, err)
	}
	if err := os.Chown(d, int(uid), -1); err != nil {
		_ = os.Remove(d)
		if errors.Is(err, os.ErrPermission) {
			return "", fmt.Errorf("gpubuf: give slab directory %q to uid %d: %w (the daemon must run as root to serve other users)", d, uid, err)
		}
		return "", fmt.Errorf("gpubuf: give slab directory %q to uid %d: %w", d, uid, err)
	}
	if err := os.Chmod(d, mode); err != nil {
		_ = os.Remove(d)
		return "", fmt.Errorf("gpubuf: chmod slab directory %q: %w", d, err)
	}
	b.uids[uid] = d
	return d, nil
}

// Dir is the directory holding the slab files.
func (b *HostBackend) Dir() string { return b.dir }

// Name implements Backend.
// HostBackendName is the host backend's Name: its pool's one device is
// shared host memory.
const HostBackendName = "host"

func (b *HostBackend) Name() string { return HostBackendName }

// Devices implements Backend: host memory is one device.
func (b *HostBackend) Devices() int { return 1 }

// Alloc implements Backend.
func (b *HostBackend) Alloc(_ context.Context, device int, size int64, uid uint32) (Memory, error) {
	if device != 0 {
		return nil, fmt.Errorf("gpubuf: host backend has one device, asked for %d", device)
	}
	if size <= 0 || size%Align != 0 {
		return nil, fmt.Errorf("gpubuf: slab size %d is not a positive multiple of %d", size, Align)
	}
	dir, err := b.uidDir(uid)
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, fmt.Sprintf("slab-%d", b.next.Add(1)))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("gpubuf: create slab file: %w", err)
	}
	m := &hostMemory{path: path, f: f, size: size, uid: uid}
	if err := m.init(); err != nil {
		_ = f.Close()
		_ = os.Remove(path)
		return nil, err
	}
	return m, nil
}

// Close removes the slab directory, then lets go of its lock. Slabs must
// have been closed first (the Pool does this); files still present are
// removed too.
func (b *HostBackend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	if err := os.RemoveAll(b.dir); err != nil {
		return fmt.Errorf("gpubuf: remove slab directory: %w", err)
	}
	if b.lock != nil {
		// The directory is gone: nothing is left for the lock to guard.
		_ = b.lock.Close()
		b.lock = nil
	}
	return nil
}

// hostMemory is one shared-memory slab file of one uid, mapped MAP_SHARED.
type hostMemory struct {
	path string
	f    *os.File
	size int64
	uid  uint32
	data []byte
}

var _ HostMemory = (*hostMemory)(nil)

func (m *hostMemory) init() error {
	if err := m.f.Truncate(m.size); err != nil {
		return fmt.Errorf("gpubuf: size slab file %q: %w", m.path, err)
	}
	if err := m.f.Chown(int(m.uid), -1); err != nil {
		if errors.Is(err, os.ErrPermission) {
			return fmt.Errorf("gpubuf: give slab %q to uid %d: %w (the daemon must run as root to serve other users)", m.path, m.uid, err)
		}
		return fmt.Errorf("gpubuf: give slab %q to uid %d: %w", m.path, m.uid, err)
	}
	data, err := unix.Mmap(int(m.f.Fd()), 0, int(m.size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("gpubuf: mmap slab file %q: %w", m.path, err)
	}
	m.data = data
	return nil
}

func (m *hostMemory) Size() int64             { return m.size }
func (m *hostMemory) HostBytes() []byte       { return m.data }
func (m *hostMemory) Export() ([]byte, error) { return []byte(m.path), nil }

// Close frees the slab. The file is truncated to zero bytes before it is
// unlinked: tmpfs frees its pages at once, and a client that kept a
// mapping (or the file open) past its leases gets SIGBUS (or EOF) instead
// of holding memory beyond the pool's budget. The uid may grow the file
// again through a descriptor it kept; that is its own tmpfs memory, as
// with any file it creates in /dev/shm, and no one else's data.
func (m *hostMemory) Close() error {
	var errs []error
	if err := m.f.Truncate(0); err != nil {
		errs = append(errs, fmt.Errorf("gpubuf: truncate slab %q: %w", m.path, err))
	}
	if m.data != nil {
		if err := unix.Munmap(m.data); err != nil {
			errs = append(errs, fmt.Errorf("gpubuf: unmap slab %q: %w", m.path, err))
		}
		m.data = nil
	}
	if err := os.Remove(m.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("gpubuf: remove slab %q: %w", m.path, err))
	}
	if err := m.f.Close(); err != nil {
		errs = append(errs, fmt.Errorf("gpubuf: close slab %q: %w", m.path, err))
	}
	return errors.Join(errs...)
}

// ExportFD returns a new descriptor of the slab file (O_RDWR, close-on-exec)
// and its size: the slab socket hands it to the slab's uid (ctl.FDExporter).
func (m *hostMemory) ExportFD() (*os.File, int64, error) {
	rc, err := m.f.SyscallConn()
	if err != nil {
		return nil, 0, fmt.Errorf("gpubuf: slab %q: %w", m.path, err)
	}
	nfd := -1
	var derr error
	// Control holds the descriptor open while it runs: a concurrent Close
	// cannot hand its number to another file under the dup.
	if err := rc.Control(func(fd uintptr) { nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, 0, fmt.Errorf("gpubuf: slab %q: %w", m.path, err)
	}
	if derr != nil {
		return nil, 0, fmt.Errorf("gpubuf: duplicate slab %q: %w", m.path, derr)
	}
	return os.NewFile(uintptr(nfd), m.path), m.size, nil
}
