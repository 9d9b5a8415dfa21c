package gpubuf

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// Slab directories and how a daemon tells a dead one's from a live one's.
//
// A daemon's pid does not identify it: in a container the daemon is pid 1
// on every start, and a daemon in another container sharing /dev/shm lives
// in another pid namespace, where its pid means nothing (or another
// process). So the default directory name carries a random part, unique
// per start, and liveness is an flock(2) the backend holds on the
// directory's lock file for its lifetime. The kernel drops that lock when
// the holder dies, however it dies, and flock works between processes of
// any pid namespace that see the same tmpfs: a directory whose lock can be
// taken belongs to no running backend.

// shmParent is where default slab directories are made.
const shmParent = "/dev/shm"

// slabDirLock is the lock file in a slab directory. It appears under this
// name only once locked (createSlabDir renames it into place), so a sweep
// never takes the lock of a directory that is still being set up.
const slabDirLock = "lock"

// newSlabDirName returns gdsfs-<pid>-<12 random hex digits>: the pid for
// people looking at /dev/shm, the random part so that no two starts share
// a name.
func newSlabDirName() (string, error) {
	var r [6]byte
	if _, err := rand.Read(r[:]); err != nil {
		return "", fmt.Errorf("gpubuf: random slab directory name: %w", err)
	}
	return fmt.Sprintf("gdsfs-%d-%s", os.Getpid(), hex.EncodeToString(r[:])), nil
}

// createSlabDir makes dir (mode 0711) with its lock file, locked; the
// returned file holds the lock until it is closed.
func createSlabDir(dir string) (*os.File, error) {
	if err := os.Mkdir(dir, 0o711); err != nil {
		return nil, fmt.Errorf("gpubuf: create slab directory %q: %w", dir, err)
	}
	lock, err := lockSlabDir(dir)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	return lock, nil
}

func lockSlabDir(dir string) (*os.File, error) {
	// Mkdir is subject to the umask; the mode is part of the contract.
	if err := os.Chmod(dir, 0o711); err != nil {
		return nil, fmt.Errorf("gpubuf: chmod slab directory %q: %w", dir, err)
	}
	// Created under another name and renamed once locked: a sweep that
	// finds the lock file finds it locked, until this process dies.
	tmp := filepath.Join(dir, slabDirLock+".new")
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("gpubuf: create slab directory lock: %w", err)
	}
	if err := flockNB(f); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("gpubuf: lock slab directory %q: %w", dir, err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, slabDirLock)); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("gpubuf: lock slab directory %q: %w", dir, err)
	}
	return f, nil
}

// flockNB takes f's exclusive flock without waiting.
func flockNB(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) {
		for {
			ferr = unix.Flock(int(fd), unix.LOCK_EX|unix.LOCK_NB)
			if !errors.Is(ferr, unix.EINTR) {
				return
			}
		}
	}); err != nil {
		return err
	}
	return ferr
}

// removeStaleDirs removes the slab directories under parent (gdsfs-*)
// whose lock can be taken: their backend is gone (a daemon killed before
// it could clean up) and their memory would otherwise stay allocated until
// reboot. Directories without a lock file (not a slab directory, or one
// being set up) and those of other owners are left alone. It returns the
// directories removed.
func removeStaleDirs(parent string) []string {
	dirs, _ := filepath.Glob(filepath.Join(parent, "gdsfs-*"))
	var removed []string
	for _, d := range dirs {
		if removeIfStale(d) {
			removed = append(removed, d)
		}
	}
	return removed
}

// removeIfStale removes dir if it is a slab directory of this uid whose
// lock is free; it reports whether it did.
func removeIfStale(dir string) bool {
	fi, err := os.Lstat(dir)
	if err != nil || !fi.IsDir() {
		return false // gone meanwhile, or a symlink or file: not ours
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); !ok || int(st.Uid) != os.Geteuid() {
		return false // another user's: not ours to judge
	}
	f, err := os.OpenFile(filepath.Join(dir, slabDirLock), os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return false // no lock file: not a slab directory, or not set up yet
	}
	defer f.Close()
	if err := flockNB(f); err != nil {
		return false // EWOULDBLOCK: its backend is alive
	}
	// Removed while holding the lock, so that a second sweep running at
	// the same time finds it held or the file gone.
	return os.RemoveAll(dir) == nil
}
