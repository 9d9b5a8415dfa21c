// Package walk lists the regular files under a set of paths, the way
// `gdsfs warm` reads its arguments: files or directory trees, each file once,
// unreadable entries reported and skipped rather than fatal.
package walk

import (
	"context"
	iofs "io/fs"
	"path/filepath"
)

// Files calls fn for every regular file under paths (a file named directly,
// or found in a tree), once per path even when reached twice. Entries that
// cannot be read are returned in skipped, and their directories are not
// entered. An error from fn stops the walk and is returned as it is (the
// caller's usage errors stay recognisable); ctx being done stops it with
// ctx.Err().
func Files(ctx context.Context, paths []string, fn func(path string) error) (skipped []error, err error) {
	seen := map[string]bool{}
	for _, root := range paths {
		err := filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if err != nil {
				skipped = append(skipped, err)
				if d != nil && d.IsDir() {
					return filepath.SkipDir
				}
				return nil
			}
			if !d.Type().IsRegular() || seen[p] {
				return nil
			}
			seen[p] = true
			return fn(p)
		})
		if ctx.Err() != nil {
			return skipped, ctx.Err()
		}
		if err != nil {
			return skipped, err
		}
	}
	return skipped, nil
}
