// Package fuseconn aborts FUSE connections through the kernel's fusectl
// filesystem (/sys/fs/fuse/connections/N): the way out of a mount whose
// daemon is hung, stopped or a zombie waiting for its own answer. Aborting
// ends every request in flight with ECONNABORTED and makes every later one
// fail with ENOTCONN, so no process stays blocked on the mount; the daemon
// sees its /dev/fuse descriptor fail and, if it still runs, exits.
package fuseconn

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/mountinfo"
)

// ControlDir is where the kernel's fusectl filesystem is mounted.
const ControlDir = "/sys/fs/fuse/connections"

// Dir is connection conn's directory under ControlDir.
func Dir(conn uint64) string { return filepath.Join(ControlDir, strconv.FormatUint(conn, 10)) }

// Abort aborts the FUSE connection of mount m (a mountinfo entry: its
// device number names the connection, no stat of the mount needed). It
// mounts fusectl at ControlDir first when it is not (root only). It
// returns an error wrapping os.ErrNotExist when the connection is gone
// already (nothing to abort).
func Abort(m mountinfo.Entry) error {
	if !strings.HasPrefix(m.FSType, "fuse") {
		return fmt.Errorf("abort %s: a %s mount is no FUSE connection", m.MountPoint, m.FSType)
	}
	if err := ensureControl(); err != nil {
		return err
	}
	p := filepath.Join(Dir(m.ConnID()), "abort")
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("abort the FUSE connection of %s: %w", m.MountPoint, err)
	}
	_, err = f.WriteString("1")
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("abort the FUSE connection of %s: write %s: %w", m.MountPoint, p, err)
	}
	return nil
}

// Waiting is the number of requests of mount m's connection that wait for
// an answer from its daemon (fusectl's "waiting"), and false when fusectl
// is not mounted or the connection is gone. It mounts nothing.
func Waiting(m mountinfo.Entry) (int, bool) {
	b, err := os.ReadFile(filepath.Join(Dir(m.ConnID()), "waiting"))
	if err != nil {
		return 0, false
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	return n, err == nil
}

// ensureControl mounts fusectl at ControlDir unless it is mounted.
func ensureControl() error {
	m, ok, err := mountinfo.At(ControlDir)
	if err != nil {
		return err
	}
	if ok && m.FSType == "fusectl" {
		return nil
	}
	err = unix.Mount("fusectl", ControlDir, "fusectl", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "")
	switch {
	case err == nil, errors.Is(err, unix.EBUSY): // EBUSY: mounted meanwhile
		return nil
	case errors.Is(err, unix.EPERM):
		return fmt.Errorf("mount fusectl at %s: %w (only root may: run as root, or mount -t fusectl none %s)", ControlDir, err, ControlDir)
	}
	return fmt.Errorf("mount fusectl at %s: %w", ControlDir, err)
}

// Handle is an open abort file of one FUSE connection. The kernel binds
// an open fusectl file to its connection, so a write to it aborts that
// connection and no other, even once the mount is gone and its number
// names a newer connection (numbers are reused at once: the lowest free
// device number). A write after the connection is gone does nothing.
type Handle struct {
	f *os.File
	m mountinfo.Entry
}

// Open opens mount m's abort file (mounting fusectl first where needed,
// root only). Open it while m is known to be mounted (Pin), and keep it
// for as long as the connection may need aborting.
func Open(m mountinfo.Entry) (*Handle, error) {
	if !strings.HasPrefix(m.FSType, "fuse") {
		return nil, fmt.Errorf("abort %s: a %s mount is no FUSE connection", m.MountPoint, m.FSType)
	}
	if err := ensureControl(); err != nil {
		return nil, err
	}
	p := filepath.Join(Dir(m.ConnID()), "abort")
	f, err := os.OpenFile(p, os.O_WRONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("abort the FUSE connection of %s: %w", m.MountPoint, err)
	}
	return &Handle{f: f, m: m}, nil
}

// Abort aborts the connection h was opened on.
func (h *Handle) Abort() error {
	if _, err := h.f.WriteString("1"); err != nil {
		return fmt.Errorf("abort the FUSE connection of %s: write %s: %w", h.m.MountPoint, h.f.Name(), err)
	}
	return nil
}

// Close closes h's abort file.
func (h *Handle) Close() error { return h.f.Close() }

// Pinned is a mount held by a file opened on its root (O_PATH): while it
// is open the mount cannot go away (so neither its device number, which
// names its FUSE connection, nor its mount id is reused), and Path names
// it exactly, whatever is mounted or linked at its mount point meanwhile.
type Pinned struct {
	f *os.File
	m mountinfo.Entry
}

// ErrChanged marks a mount point that no longer holds the mount a caller
// read from the mount table: it was unmounted, replaced, overmounted, or
// its path now runs through a symbolic link.
var ErrChanged = errors.New("no longer the mount that was checked")

// Pin opens mount m's root without following symbolic links and checks
// that the file is on m (its mount id, and the mount table's entry for
// that id: m's device and mount point). The open sends the FUSE daemon no
// request (O_PATH), so it cannot hang on a hung mount. An error wraps
// ErrChanged when the path now names something else.
func Pin(m mountinfo.Entry) (*Pinned, error) {
	fd, err := unix.Openat2(unix.AT_FDCWD, m.MountPoint, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_SYMLINKS,
	})
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
		return nil, fmt.Errorf("%s: %w (%v)", m.MountPoint, ErrChanged, err)
	}
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", m.MountPoint, err)
	}
	f := os.NewFile(uintptr(fd), m.MountPoint)
	id, err := MountID(fd)
	if err != nil {
		f.Close()
		return nil, err
	}
	cur, ok, err := mountinfo.ByID(id)
	if err != nil {
		f.Close()
		return nil, err
	}
	if !ok || id != m.ID || cur.MountPoint != m.MountPoint || cur.Major != m.Major || cur.Minor != m.Minor {
		f.Close()
		return nil, fmt.Errorf("%s: %w (mount %d, device %d:%d, now mount %d)", m.MountPoint, ErrChanged, m.ID, m.Major, m.Minor, id)
	}
	return &Pinned{f: f, m: m}, nil
}

// MountID is the mount id of the file open at fd (/proc/self/fdinfo):
// the first field of its mount's line in the mount table.
func MountID(fd int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", fd))
	if err != nil {
		return 0, fmt.Errorf("read the mount id of a file: %w", err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "mnt_id:"); ok {
			id, err := strconv.Atoi(strings.TrimSpace(v))
			if err != nil {
				return 0, fmt.Errorf("fdinfo mnt_id %q: %w", v, err)
			}
			return id, nil
		}
	}
	return 0, errors.New("fdinfo has no mnt_id")
}

// Path is a path that names the pinned mount's root itself (a
// /proc/self/fd link), for umount2: it unmounts that mount, never
// whatever its mount point's path leads to now.
func (p *Pinned) Path() string { return fmt.Sprintf("/proc/self/fd/%d", p.f.Fd()) }

// Entry is the mount table's entry of the pinned mount.
func (p *Pinned) Entry() mountinfo.Entry { return p.m }

// Close lets the mount go.
func (p *Pinned) Close() error { return p.f.Close() }
