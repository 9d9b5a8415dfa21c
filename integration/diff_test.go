package integration

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
)

// TestDifferential applies the same seeded random operations to a gdsfs
// mount and to a plain directory, and compares the outcome of every
// operation (errno) and, after each batch, the full trees: names, types,
// sizes, modes, link counts and contents.
//
// Reproduce a failure with GDSFS_DIFF_SEED=<seed printed in the log>.
func TestDifferential(t *testing.T) {
	seed := uint64(20261130)
	if s := os.Getenv("GDSFS_DIFF_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("GDSFS_DIFF_SEED=%q: %v", s, err)
		}
		seed = v
	}
	for _, mode := range []struct {
		name          string
		noPassthrough bool
	}{{"passthrough", false}, {"daemon", true}} {
		t.Run(mode.name, func(t *testing.T) {
			t.Logf("seed %d", seed)
			mnt, _ := startMount(t, mountOpts{NoPassthrough: mode.noPassthrough}).dirs()
			ref := t.TempDir()
			d := &differ{
				t:    t,
				rng:  rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
				root: [2]string{ref, mnt},
			}
			defer d.closeAll()
			const batches, perBatch = 40, 100
			for b := range batches {
				for range perBatch {
					d.step()
				}
				d.compareTrees(fmt.Sprintf("after batch %d (%d ops)", b, (b+1)*perBatch))
				if t.Failed() {
					return
				}
			}
			t.Logf("%d operations, %d succeeded on both trees", d.ops, d.succeeded)
			if d.succeeded < d.ops/3 {
				t.Errorf("only %d of %d operations succeeded: the test exercises too little", d.succeeded, d.ops)
			}
		})
	}
}

// differ runs one operation on both trees: root[0] is the plain reference
// directory, root[1] the mount. Open descriptors are kept in pairs.
type differ struct {
	t    *testing.T
	rng  *rand.Rand
	root [2]string
	open [][2]*os.File
	ops  int
	// succeeded counts operations that succeeded on both trees, so a
	// seed that only produces errors is noticed.
	succeeded int
}

var diffNames = []string{"a", "b", "c", "d", "e", "d1/a", "d1/b", "d1/c", "d2/a", "d2/b", "d1/d3/a", "d1/d3/b"}
var diffDirs = []string{"d1", "d2", "d1/d3", "d4"}

// diffModes are modes go-fuse or a root daemon can get wrong.
var diffModes = []uint32{0, 0o4755, 0o2775, 0o6777, 0o1777, 0o2765}

func (d *differ) name() string { return diffNames[d.rng.IntN(len(diffNames))] }
func (d *differ) dir() string  { return diffDirs[d.rng.IntN(len(diffDirs))] }

func (d *differ) data() []byte {
	n := d.rng.IntN(64 << 10)
	if d.rng.IntN(8) == 0 {
		n = d.rng.IntN(1 << 20)
	}
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(d.rng.Uint32())
	}
	return b
}

// both runs op on each tree and fails the test if the errors differ.
func (d *differ) both(what string, op func(root string, i int) error) {
	var errs [2]error
	for i, r := range d.root {
		errs[i] = op(r, i)
	}
	if errs[0] == nil && errs[1] == nil {
		d.succeeded++
	}
	if errnoOf(errs[0]) != errnoOf(errs[1]) {
		d.t.Errorf("op %d %s: plain dir: %v; gdsfs: %v", d.ops, what, errs[0], errs[1])
	}
}

func errnoOf(err error) error {
	if err == nil {
		return nil
	}
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return err
}

func (d *differ) step() {
	d.ops++
	switch op := d.rng.IntN(13); op {
	case 0, 1: // create or overwrite a whole file
		p, data := d.name(), d.data()
		d.both("write "+p, func(r string, _ int) error { return os.WriteFile(filepath.Join(r, p), data, 0o644) })
	case 2, 3: // pwrite at an offset (maybe past the end: a hole)
		p, data, off := d.name(), d.data(), d.rng.Int64N(2<<20)
		d.both(fmt.Sprintf("pwrite %s@%d", p, off), func(r string, _ int) error {
			f, err := os.OpenFile(filepath.Join(r, p), os.O_WRONLY|os.O_CREATE, 0o644)
			if err != nil {
				return err
			}
			_, werr := f.WriteAt(data, off)
			return errors.Join(werr, f.Close())
		})
	case 4: // truncate
		p, size := d.name(), d.rng.Int64N(1<<20)
		d.both(fmt.Sprintf("truncate %s %d", p, size), func(r string, _ int) error { return os.Truncate(filepath.Join(r, p), size) })
	case 5: // rename, files or directories, maybe over an existing name
		var from, to string
		if d.rng.IntN(4) == 0 {
			from, to = d.dir(), d.dir()
		} else {
			from, to = d.name(), d.name()
		}
		d.both("rename "+from+" "+to, func(r string, _ int) error { return os.Rename(filepath.Join(r, from), filepath.Join(r, to)) })
	case 6: // unlink
		p := d.name()
		d.both("unlink "+p, func(r string, _ int) error { return syscall.Unlink(filepath.Join(r, p)) })
	case 7: // mkdir / rmdir
		p := d.dir()
		if d.rng.IntN(2) == 0 {
			d.both("mkdir "+p, func(r string, _ int) error { return syscall.Mkdir(filepath.Join(r, p), 0o755) })
		} else {
			d.both("rmdir "+p, func(r string, _ int) error { return syscall.Rmdir(filepath.Join(r, p)) })
		}
	case 8: // hard link
		from, to := d.name(), d.name()
		d.both("link "+from+" "+to, func(r string, _ int) error { return os.Link(filepath.Join(r, from), filepath.Join(r, to)) })
	case 9: // chmod, sometimes to 0000 or with setuid/setgid/sticky bits
		p, mode := d.name(), uint32(0o600+d.rng.IntN(0o200))
		if d.rng.IntN(3) == 0 {
			mode = diffModes[d.rng.IntN(len(diffModes))]
		}
		d.both(fmt.Sprintf("chmod %s %o", p, mode), func(r string, _ int) error { return syscall.Chmod(filepath.Join(r, p), mode) })
	case 10: // open and keep (read-write), for later writes/fsync after renames and unlinks
		if len(d.open) >= 8 {
			d.closeOne()
			return
		}
		p := d.name()
		var pair [2]*os.File
		d.both("open "+p, func(r string, i int) error {
			f, err := os.OpenFile(filepath.Join(r, p), os.O_RDWR, 0)
			pair[i] = f
			return err
		})
		if pair[0] != nil && pair[1] != nil {
			d.open = append(d.open, pair)
		} else {
			for _, f := range pair {
				if f != nil {
					f.Close()
				}
			}
		}
	case 11: // write, truncate or fsync through a kept descriptor (its file may be renamed or unlinked by now)
		if len(d.open) == 0 {
			return
		}
		pair := d.open[d.rng.IntN(len(d.open))]
		data, off := d.data(), d.rng.Int64N(1<<20)
		switch d.rng.IntN(3) {
		case 0:
			d.both("fd write", func(_ string, i int) error { _, err := pair[i].WriteAt(data, off); return err })
		case 1:
			d.both("fd truncate", func(_ string, i int) error { return pair[i].Truncate(off) })
		case 2:
			d.both("fsync", func(_ string, i int) error { return pair[i].Sync() })
		}
	case 12:
		d.closeOne()
	}
}

func (d *differ) closeOne() {
	if len(d.open) == 0 {
		return
	}
	i := d.rng.IntN(len(d.open))
	pair := d.open[i]
	d.open = append(d.open[:i], d.open[i+1:]...)
	d.both("close", func(_ string, i int) error { return pair[i].Close() })
}

func (d *differ) closeAll() {
	for len(d.open) > 0 {
		d.closeOne()
	}
}

// entry is what is compared of one tree entry.
type entry struct {
	mode  fs.FileMode
	size  int64
	nlink uint64
	sum   [32]byte
}

func (d *differ) tree(root string) map[string]entry {
	out := map[string]entry{}
	err := filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		info, err := de.Info()
		if err != nil {
			return err
		}
		e := entry{mode: info.Mode()}
		if st, ok := info.Sys().(*syscall.Stat_t); ok && !info.IsDir() {
			e.nlink = uint64(st.Nlink)
		}
		if info.Mode().IsRegular() {
			e.size = info.Size()
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			e.sum = sha256.Sum256(b)
		}
		out[rel] = e
		return nil
	})
	if err != nil {
		d.t.Fatalf("walk %s: %v", root, err)
	}
	return out
}

func (d *differ) compareTrees(when string) {
	want, got := d.tree(d.root[0]), d.tree(d.root[1])
	for name, w := range want {
		g, ok := got[name]
		switch {
		case !ok:
			d.t.Errorf("%s: %s missing on gdsfs", when, name)
		case g.mode != w.mode || g.size != w.size || g.nlink != w.nlink:
			d.t.Errorf("%s: %s: gdsfs mode %v size %d nlink %d; plain dir mode %v size %d nlink %d",
				when, name, g.mode, g.size, g.nlink, w.mode, w.size, w.nlink)
		case !bytes.Equal(g.sum[:], w.sum[:]):
			d.t.Errorf("%s: %s: contents differ", when, name)
		}
	}
	for name := range got {
		if _, ok := want[name]; !ok {
			d.t.Errorf("%s: %s exists only on gdsfs", when, name)
		}
	}
}
