package reader

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/internal/usage"
	"github.com/gdsfs/gdsfs/internal/xattr"
)

// Index reads the index JSON of path (on a gdsfs mount) from the daemon:
// the user.gdsfs.index attribute, or, for an index over the 64 KiB an
// attribute holds (E2BIG), the paged INDEX call of the control path
// (docs/protocol.md). Without an index, the error gives the daemon's
// reason (user.gdsfs.info's index_error), else this process's.
func Index(ctx context.Context, path string) ([]byte, error) {
	mp, err := FindMount(path)
	if err != nil {
		return nil, err
	}
	doc, err := xattr.Get(path, "user.gdsfs.index")
	switch {
	case err == nil:
		return doc, nil
	case errors.Is(err, syscall.ENOENT):
		return nil, usage.Errorf("%s: no such file", path)
	case errors.Is(err, syscall.ENODATA):
		return nil, noIndexError(path)
	case errors.Is(err, syscall.EACCES):
		return nil, usage.Errorf("%s: permission denied; this user may not read it", path)
	case !errors.Is(err, syscall.E2BIG):
		return nil, fmt.Errorf("read user.gdsfs.index of %s: %w", path, err)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, usage.Errorf("%v", err) // "open PATH: why"
	}
	defer f.Close()
	cl, err := ctl.OpenSession(mp)
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	doc, err = cl.Index(ctx, f)
	if errors.Is(err, syscall.ENODATA) {
		return nil, noIndexError(path)
	}
	return doc, err
}

// noIndexError explains why the daemon has no index for path: the reason
// user.gdsfs.info gives for a corrupt shard (index_error), else parsing the
// file here (the reason of a daemon that predates index_error, or "not a
// format gdsfs indexes").
func noIndexError(path string) error {
	info, err := xattr.Get(path, "user.gdsfs.info")
	if err == nil {
		if why := indexErrorOf(info); why != "" {
			return corruptError(path, why)
		}
	}
	_, err = LocalIndex(path)
	if err == nil {
		return fmt.Errorf("%s: the daemon serves no index for it, though it parses here (was it just written? try again)", path)
	}
	return err
}

// corruptError is gdsfs index's one line for a file its format parser
// refuses: the parser's reason, without the package's prefix, and what to do.
func corruptError(path, why string) error {
	return usage.Errorf("%s: %s; the file is truncated or corrupt: write it again", path, strings.TrimPrefix(why, "cache: "))
}

// indexErrorOf returns the index_error of a user.gdsfs.info document ("" when
// none, or when the document is not the expected JSON).
func indexErrorOf(info []byte) string {
	var fi struct {
		IndexError string `json:"index_error"`
	}
	if json.Unmarshal(info, &fi) != nil {
		return ""
	}
	return fi.IndexError
}

// LocalIndex parses path in this process and returns its index JSON (the
// document Index returns), for files that are not on a mount.
func LocalIndex(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, usage.Errorf("%v", err) // "open PATH: why"
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("stat %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return nil, usage.Errorf("%s is not a regular file; gdsfs index reads shard files", path)
	}
	x, err := cache.Parse(f, st.Size(), path)
	switch {
	case errors.Is(err, cache.ErrNoIndex):
		return nil, usage.Errorf("%s has no index: it is not a tar, MDS shard or index.json, safetensors, torch.save zip or .npy file", path)
	case errors.Is(err, cache.ErrInvalid):
		return nil, corruptError(path, err.Error())
	case err != nil:
		return nil, fmt.Errorf("index %s: %w", path, err)
	}
	return x.JSON()
}
