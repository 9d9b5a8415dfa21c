package integration

import (
	"maps"
	"slices"
	"testing"

	"github.com/hanwen/go-fuse/v2/posixtest"
)

// TestPosixtest runs every test of go-fuse's posixtest suite against a
// fresh gdsfs mount, once with kernel passthrough (where the kernel offers
// it), once with the daemon serving all I/O, and once against the gdsfs
// binary mounted with its default flags (control path included). No test
// is skipped.
func TestPosixtest(t *testing.T) {
	tests := maps.Clone(posixtest.All) // never mutate go-fuse's map
	// Tests whose backing directory must be on tmpfs, and why.
	onTmpfs := map[string]string{
		// ext4 (CI's /tmp) without the ea_inode feature keeps xattr
		// values in one block and fails 8 KiB values with ENOSPC, so
		// posixtest would skip; tmpfs stores them.
		"XAttrLarge": "backing filesystem must store 8 KiB xattr values",
	}
	for _, mode := range []struct {
		name          string
		noPassthrough bool
		cli           bool
	}{{"passthrough", false, false}, {"daemon", true, false}, {"cli", false, true}} {
		t.Run(mode.name, func(t *testing.T) {
			for _, name := range slices.Sorted(maps.Keys(tests)) {
				t.Run(name, func(t *testing.T) {
					o := mountOpts{NoPassthrough: mode.noPassthrough}
					if _, ok := onTmpfs[name]; ok {
						o.Backing = tmpfsDir(t)
					}
					var mnt string
					if mode.cli {
						mnt = mountCLI(t, o.Backing)
					} else {
						mnt, _ = mountGdsfs(t, o)
					}
					tests[name](t, mnt)
				})
			}
		})
	}
}
