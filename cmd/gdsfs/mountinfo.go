package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// mountEntry is one line of /proc/self/mountinfo, the fields gdsfs needs.
type mountEntry struct {
	MountPoint string
	FSType     string
	Source     string
}

// errMountinfo marks a malformed mountinfo line.
var errMountinfo = errors.New("gdsfs: malformed mountinfo line")

// parseMountinfo parses the format of proc(5) /proc/PID/mountinfo:
//
//	36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
//
// The optional fields end at a lone "-"; paths escape space, tab, newline
// and backslash as octal (\040).
func parseMountinfo(r io.Reader) ([]mountEntry, error) {
	var out []mountEntry
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
			return nil, fmt.Errorf("%w %d: %q", errMountinfo, line, sc.Text())
		}
		out = append(out, mountEntry{
			MountPoint: unescapeMountinfo(f[4]),
			FSType:     f[sep+1],
			Source:     unescapeMountinfo(f[sep+2]),
		})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mountinfo: %w", err)
	}
	return out, nil
}

// unescapeMountinfo decodes the kernel's \ooo escapes; anything else is
// kept as is.
func unescapeMountinfo(s string) string {
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

// mountAt returns the topmost mount on path (the last one listed), or
// false if path is not a mount point.
func mountAt(path string) (mountEntry, bool, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return mountEntry{}, false, fmt.Errorf("read mount table: %w", err)
	}
	defer f.Close()
	ms, err := parseMountinfo(f)
	if err != nil {
		return mountEntry{}, false, err
	}
	var found mountEntry
	ok := false
	for _, m := range ms {
		if m.MountPoint == path {
			found, ok = m, true
		}
	}
	return found, ok, nil
}

// gdsfsFSType is the filesystem type gdsfs mounts show in the mount table.
const gdsfsFSType = "fuse.gdsfs"
