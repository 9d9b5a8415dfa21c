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
