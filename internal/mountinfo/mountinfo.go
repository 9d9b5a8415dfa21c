// Package mountinfo reads the kernel's mount table (/proc/self/mountinfo):
// which filesystem is mounted where, for gdsfs mount, unmount and doctor.
package mountinfo

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Entry is one line of /proc/self/mountinfo, the fields gdsfs needs.
type Entry struct {
	// ID is the mount's unique id (the line's first field; the mnt_id of
	// /proc/PID/fdinfo of a file opened on it). Ids of mounts that are
	// gone are reused.
	ID         int
	MountPoint string
	FSType     string
	Source     string
	// Major and Minor are the device number of the mounted filesystem
	// (st_dev of its files), from the line itself: a hung FUSE mount's
	// device is known without a stat, which would hang.
	Major, Minor uint32
	// SuperOptions are the per-superblock options ("rw,user_id=0,...").
	SuperOptions string
}

// ConnID is the FUSE connection number of a FUSE mount: its directory
// under /sys/fs/fuse/connections is named after the kernel's dev_t of the
// superblock, (major << 20) | minor.
func (e Entry) ConnID() uint64 { return uint64(e.Major)<<20 | uint64(e.Minor) }

// UserID is the uid a FUSE mount belongs to (its user_id= option: who
// mounted it), and false when the mount has none (not FUSE).
func (e Entry) UserID() (int, bool) {
	for _, o := range strings.Split(e.SuperOptions, ",") {
		if v, ok := strings.CutPrefix(o, "user_id="); ok {
			if uid, err := strconv.ParseUint(v, 10, 32); err == nil {
				return int(uid), true
			}
		}
	}
	return 0, false
}

// ErrMalformed marks a malformed mountinfo line.
var ErrMalformed = errors.New("gdsfs: malformed mountinfo line")

// Parse parses the format of proc(5) /proc/PID/mountinfo:
//
//	36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
//
// The optional fields end at a lone "-"; paths escape space, tab, newline
// and backslash as octal (\040).
func Parse(r io.Reader) ([]Entry, error) {
	var out []Entry
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for line := 1; sc.Scan(); line++ {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		sep := -1
		for i := 6; i < len(f); i++ {
			if f[i] == "-" {
				sep = i
				break
			}
		}
		if len(f) < 6 || sep < 0 || sep+2 >= len(f) {
			return nil, fmt.Errorf("%w %d: %q", ErrMalformed, line, sc.Text())
		}
		major, minor, ok := parseDev(f[2])
		if !ok {
			return nil, fmt.Errorf("%w %d: device %q is not MAJOR:MINOR", ErrMalformed, line, f[2])
		}
		id, err := strconv.Atoi(f[0])
		if err != nil || id < 0 {
			return nil, fmt.Errorf("%w %d: mount id %q is no number", ErrMalformed, line, f[0])
		}
		e := Entry{
			ID:         id,
			MountPoint: unescape(f[4]),
			FSType:     f[sep+1],
			Source:     unescape(f[sep+2]),
			Major:      major,
			Minor:      minor,
		}
		if sep+3 < len(f) {
			e.SuperOptions = f[sep+3]
		}
		out = append(out, e)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	return out, nil
}

// parseDev parses mountinfo's third field, "MAJOR:MINOR" in decimal.
func parseDev(s string) (major, minor uint32, ok bool) {
	a, b, found := strings.Cut(s, ":")
	if !found {
		return 0, 0, false
	}
	ma, err1 := strconv.ParseUint(a, 10, 32)
	mi, err2 := strconv.ParseUint(b, 10, 32)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return uint32(ma), uint32(mi), true
}

// unescape decodes the kernel's \ooo escapes; anything else is
// kept as is.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// At returns the topmost mount on path (the last one listed), or
// false if path is not a mount point.
func At(path string) (Entry, bool, error) {
	ms, err := Read()
	if err != nil {
		return Entry{}, false, err
	}
	m, ok := Topmost(ms, path)
	return m, ok, nil
}

// Read parses this process's mount table.
func Read() ([]Entry, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	defer f.Close()
	return Parse(f)
}

// Topmost is the topmost of ms mounted on path (the last one listed).
func Topmost(ms []Entry, path string) (Entry, bool) {
	var found Entry
	ok := false
	for _, m := range ms {
		if m.MountPoint == path {
			found, ok = m, true
		}
	}
	return found, ok
}

// GDSFSType is the filesystem type gdsfs mounts show in the mount table.
const GDSFSType = "fuse.gdsfs"

// Containing returns the mount point of the filesystem path is on
// (walking up to the nearest mount point) and its type. It reads the mount
// table only, never path itself (a stat of a hung mount hangs), so the
// answer is lexical: symbolic links in path are not followed.
func Containing(path string) (Entry, bool) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return Entry{}, false
	}
	ms, err := Read()
	if err != nil {
		return Entry{}, false
	}
	for d := abs; ; d = filepath.Dir(d) {
		if m, ok := Topmost(ms, d); ok {
			return m, true
		}
		if d == "/" {
			return Entry{}, false
		}
	}
}

// Unreachable says why this process cannot use the gdsfs mount that holds
// path, given the error a stat or getxattr under it returned: its daemon
// exited (ENOTCONN, ECONNABORTED), or it was mounted without --allow-other
// for another user (EACCES, which the kernel returns for every access of
// such a mount). It returns "" when path is on no gdsfs mount or the error
// is another. The text names what to do; callers make it a usage error.
func Unreachable(path string, err error) string {
	dead := errors.Is(err, syscall.ENOTCONN) || errors.Is(err, syscall.ECONNABORTED)
	if !dead && !errors.Is(err, syscall.EACCES) {
		return ""
	}
	m, ok := Containing(path)
	if !ok || m.FSType != GDSFSType {
		return ""
	}
	if dead {
		return fmt.Sprintf("%s is a gdsfs mount whose daemon exited; run gdsfs mount %s again (it cleans up the dead mount), or gdsfs unmount --force %s",
			m.MountPoint, m.MountPoint, m.MountPoint)
	}
	if _, serr := os.Stat(m.MountPoint); !errors.Is(serr, syscall.EACCES) {
		return "" // the mount itself is usable: a file under it is not this user's to read
	}
	return fmt.Sprintf("%s is a gdsfs mount uid %d may not use: it was mounted without --allow-other; mount it with gdsfs mount --allow-other to let other users in",
		m.MountPoint, os.Geteuid())
}

// ByID returns the mount with mount id id, or false if there is none.
func ByID(id int) (Entry, bool, error) {
	ms, err := Read()
	if err != nil {
		return Entry{}, false, err
	}
	for _, m := range ms {
		if m.ID == id {
			return m, true, nil
		}
	}
	return Entry{}, false, nil
}
