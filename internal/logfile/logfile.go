// Package logfile is where gdsfs mount logs: the default path of a
// background daemon's log and a file that rotates itself when it grows.
package logfile

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

// RotateBytes is the size at which a log file gdsfs opens is moved to
// FILE.1 (replacing the previous one) and started afresh.
const RotateBytes = 64 << 20

// DefaultPath is where `mount --background` logs without --log-file:
// /var/log/gdsfs/<mountpoint>.log as root, $XDG_STATE_HOME/gdsfs/ (default
// ~/.local/state/gdsfs/) otherwise, the mountpoint's absolute path escaped
// into one file name ("/mnt/data" -> "mnt-data.log").
func DefaultPath(mountpoint string, euid int) (string, error) {
	abs, err := filepath.Abs(mountpoint)
	if err != nil {
		return "", fmt.Errorf("log file for %s: %w", mountpoint, err)
	}
	dir := "/var/log/gdsfs"
	if euid != 0 {
		state := os.Getenv("XDG_STATE_HOME")
		if state == "" {
			home, err := os.UserHomeDir()
			if err != nil {
				return "", fmt.Errorf("log file for %s: no $XDG_STATE_HOME or $HOME (%v); give --log-file", mountpoint, err)
			}
			state = filepath.Join(home, ".local", "state")
		}
		dir = filepath.Join(state, "gdsfs")
	}
	return filepath.Join(dir, escapePath(abs)+".log"), nil
}

// escapePath turns an absolute path into one file name: separators become
// '-', bytes other than letters, digits, '.' and '_' become "_xx" (hex), so
// distinct paths give distinct names ("/" is "root").
func escapePath(p string) string {
	p = strings.Trim(filepath.Clean(p), "/")
	if p == "" {
		return "root"
	}
	var b strings.Builder
	for i := 0; i < len(p); i++ {
		switch c := p[i]; {
		case c == '/':
			b.WriteByte('-')
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.' && i > 0:
			b.WriteByte(c)
		default:
			fmt.Fprintf(&b, "_%02x", c)
		}
	}
	return b.String()
}

// Rotating appends to a log file and, when a write would take it past
// limit bytes, renames it to path+".1" and starts a new one, so a
// long-running daemon's log stays bounded (two files of at most limit).
type Rotating struct {
	path  string
	limit int64
	perm  os.FileMode

	mu   sync.Mutex
	f    *os.File // GUARDED_BY(mu)
	size int64    // GUARDED_BY(mu)
}

// Open opens (creating with perm, and its directory with 0700 if
// missing) path for appending.
func Open(path string, limit int64, perm os.FileMode) (*Rotating, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, err
	}
	r := &Rotating{path: path, limit: limit, perm: perm}
	if err := r.open(); err != nil {
		return nil, err
	}
	return r, nil
}

func (r *Rotating) open() error {
	f, err := os.OpenFile(r.path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, r.perm)
	if err != nil {
		return err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return err
	}
	r.f, r.size = f, st.Size()
	return nil
}

// Write appends p, rotating first when p would take the file past the limit.
// A failed rotation keeps writing to the current file: losing log lines is
// worse than a large file.
func (r *Rotating) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.size > 0 && r.size+int64(len(p)) > r.limit {
		if err := os.Rename(r.path, r.path+".1"); err == nil {
			old := r.f
			if err := r.open(); err != nil {
				r.f = old
			} else {
				old.Close()
			}
		}
	}
	n, err := r.f.Write(p)
	r.size += int64(n)
	return n, err
}

// Close closes the current file.
func (r *Rotating) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.f.Close()
}
