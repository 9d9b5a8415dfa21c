package reader

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"syscall"

	"github.com/gdsfs/gdsfs/internal/mountinfo"
	"github.com/gdsfs/gdsfs/internal/usage"
	"github.com/gdsfs/gdsfs/internal/xattr"
)

// Info returns the user.gdsfs.info attribute of path (a file or directory
// on a gdsfs mount): how gdsfs serves it (docs/protocol.md, section 6).
// A path that is missing or not on a mount is a usage.Error.
func Info(path string) ([]byte, error) {
	v, err := xattr.Get(path, "user.gdsfs.info")
	switch {
	case errors.Is(err, syscall.ENOENT):
		return nil, usage.Errorf("%s: no such file or directory", path)
	case mountinfo.Unreachable(path, err) != "":
		return nil, usage.Errorf("%s", mountinfo.Unreachable(path, err))
	case errors.Is(err, syscall.EACCES):
		return nil, usage.Errorf("%s: permission denied; this user may not read it", path)
	case errors.Is(err, syscall.ENODATA), errors.Is(err, syscall.ENOTSUP):
		return nil, usage.Errorf("%s is not on a gdsfs mount (it has no user.gdsfs.info); mount its directory with gdsfs mount", path)
	case err != nil:
		return nil, fmt.Errorf("read user.gdsfs.info of %s: %w", path, err)
	}
	return v, nil
}

// PrintInfo prints the user.gdsfs.info document v of path as gdsfs stat
// does: the known fields first, in a useful order, then any newer ones.
func PrintInfo(w io.Writer, path string, v []byte) error {
	var info map[string]any
	if err := json.Unmarshal(v, &info); err != nil {
		return fmt.Errorf("user.gdsfs.info of %s is not JSON: %w", path, err)
	}
	fmt.Fprintf(w, "%s\n", path)
	// Known fields first, in a useful order; anything newer after them.
	order := []string{"type", "size", "engine", "reason", "format", "align", "path", "dev", "ino", "mtime_ns"}
	labels := map[string]string{"path": "backing", "reason": "why", "mtime_ns": "mtime (ns)"}
	seen := map[string]bool{}
	show := func(k string) {
		val, ok := info[k]
		if !ok {
			return
		}
		seen[k] = true
		label := k
		if l, ok := labels[k]; ok {
			label = l
		}
		if f, ok := val.(float64); ok {
			fmt.Fprintf(w, "  %-11s %d\n", label+":", int64(f))
			return
		}
		if s, ok := val.(string); ok && s == "" {
			val = "-"
		}
		fmt.Fprintf(w, "  %-11s %v\n", label+":", val)
	}
	for _, k := range order {
		show(k)
	}
	var rest []string
	for k := range info {
		if !seen[k] {
			rest = append(rest, k)
		}
	}
	sort.Strings(rest)
	for _, k := range rest {
		show(k)
	}
	return nil
}
