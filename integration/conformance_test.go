package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
)

// The conformance suite runs the same operation through a gdsfs mount and
// on a twin directory on the backing filesystem, as root and as two
// unprivileged uids, and compares the errno, what the operation observed
// (a stat, the bytes read) and the state it left: existence, type, mode
// (all 12 bits, 0000 and setuid/setgid included), owner, size, link count,
// symlink target. Each case works in a directory of its own, built the
// same way in the twin and in the backing directory, so no case sees
// another's leftovers.
//
// The operations run with paths relative to the tree's root (the child's
// working directory), so a path has the same length on both trees and the
// kernel's PATH_MAX applies alike; the backing path behind the mount is
// longer, which is what the length cases are about.
//
// One mount per I/O mode serves the whole suite, and each uid runs all its
// cases in one child process (TestConformanceChild).

// confUIDs are the callers: root and two unprivileged users (gid = uid,
// no supplementary groups).
var confUIDs = []int{0, 10001, 10002}

// confOther owns files that none of the callers own.
const confOther = 10003

// confCase is one operation and the fixture it runs on.
type confCase struct {
	name string
	// setup builds the case directory's contents, as root, directly in
	// the twin and in the backing directory.
	setup func(f *fixture)
	// op runs in the child as the caller, with the tree's root as the
	// working directory. It returns what it observed (may be empty).
	op func(c *confCtx) (string, error)
	// check names the entries (relative to the case directory) whose
	// state is compared afterwards.
	check []string
	// checkFn, when set, computes check for the caller (long paths
	// depend on the case directory's length).
	checkFn func(c *confCtx) []string
}

// confCtx is what an operation knows: its caller and its case directory
// (relative to the tree root).
type confCtx struct {
	uid int
	dir string
}

func (c *confCtx) p(name string) string { return c.dir + "/" + name }

// fixture builds one case directory, relative to its descriptor, as root.
type fixture struct {
	t    testing.TB
	fd   int
	uid  int    // the caller the case is for
	path string // the case directory, relative to the tree root
}

func (f *fixture) must(what string, err error) {
	if err != nil {
		f.t.Fatalf("fixture %s: %s: %v", f.path, what, err)
	}
}

// file creates name with data, mode and owner (mode set after chown, so
// setuid bits stay).
func (f *fixture) file(name string, mode uint32, uid, gid int, data string) {
	fd, err := unix.Openat(f.fd, name, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	f.must("create "+name, err)
	defer unix.Close(fd)
	if data != "" {
		_, err = unix.Write(fd, []byte(data))
		f.must("write "+name, err)
	}
	f.must("chown "+name, unix.Fchown(fd, uid, gid))
	f.must("chmod "+name, unix.Fchmod(fd, mode))
}

// dir creates a directory with mode and owner.
func (f *fixture) dir(name string, mode uint32, uid, gid int) {
	f.must("mkdir "+name, unix.Mkdirat(f.fd, name, 0o700))
	f.must("chown "+name, unix.Fchownat(f.fd, name, uid, gid, unix.AT_SYMLINK_NOFOLLOW))
	f.must("chmod "+name, unix.Fchmodat(f.fd, name, mode, 0))
}

func (f *fixture) symlink(target, name string) {
	f.must("symlink "+name, unix.Symlinkat(target, f.fd, name))
	f.must("chown "+name, unix.Fchownat(f.fd, name, f.uid, f.uid, unix.AT_SYMLINK_NOFOLLOW))
}

// chain creates the directories of a long path (owned by the caller).
func (f *fixture) chain(comps []string) {
	rel := ""
	for _, c := range comps {
		rel += c
		f.dir(rel, 0o755, f.uid, f.uid)
		rel += "/"
	}
}

// longPath splits a path of exactly total bytes, relative to the tree
// root and starting with the case directory dir, into directories (of 200
// bytes each) and a last component (1 to 255 bytes).
func longPath(dir string, total int) (comps []string, leaf string) {
	rem := total - len(dir) - 1
	for rem > 255 {
		comps = append(comps, strings.Repeat(string(rune('a'+len(comps)%26)), 200))
		rem -= 201
	}
	return comps, strings.Repeat("L", rem)
}

// long is a path of total bytes below the case directory: the setup's
// view (relative to the case directory) and the operation's (relative to
// the tree root).
type long struct {
	comps []string
	leaf  string
}

func mkLong(dir string, total int) long {
	c, l := longPath(dir, total)
	return long{c, l}
}

func (l long) rel(leaf string) string {
	if len(l.comps) == 0 {
		return leaf
	}
	return strings.Join(l.comps, "/") + "/" + leaf
}

// Path lengths relative to the tree root: PATH_MAX counts the NUL, so
// 4095 bytes is the longest path a syscall takes.
const (
	atPathMax     = 4095
	beyondPathMax = 4096
)

func name(n int) string { return strings.Repeat("n", n) }

// ok drops a result: only the errno is compared.
func ok(err error) (string, error) { return "", err }

func statString(p string) (string, error) {
	var st syscall.Stat_t
	if err := syscall.Lstat(p, &st); err != nil {
		return "", err
	}
	return fmt.Sprintf("mode=%o type=%o uid=%d gid=%d size=%d", st.Mode&0o7777, st.Mode&syscall.S_IFMT, st.Uid, st.Gid, st.Size), nil
}

func readString(p string) (string, error) {
	b, err := os.ReadFile(p)
	return string(b), errnoOf(err)
}

func writeTo(p string, flags int) error {
	fd, err := syscall.Open(p, syscall.O_WRONLY|flags, 0)
	if err != nil {
		return err
	}
	_, err = syscall.Write(fd, []byte("w"))
	return errors.Join(err, syscall.Close(fd))
}

func createFile(p string, mode uint32) error {
	fd, err := syscall.Open(p, syscall.O_CREAT|syscall.O_EXCL|syscall.O_WRONLY, mode)
	if err != nil {
		return err
	}
	return syscall.Close(fd)
}

// confCases returns the table. Case i of caller uid runs in caseDir(uid, i).
func confCases() []confCase {
	var cs []confCase
	add := func(c ...confCase) { cs = append(cs, c...) }

	// Mode 0000 (item 1) and creation modes.
	add(
		confCase{name: "creat-0000", op: func(c *confCtx) (string, error) {
			if err := createFile(c.p("f"), 0); err != nil {
				return "", err
			}
			return statString(c.p("f"))
		}, check: []string{"f"}},
		confCase{name: "creat-0644", op: func(c *confCtx) (string, error) { return ok(createFile(c.p("f"), 0o644)) }, check: []string{"f"}},
		confCase{name: "creat-4755", op: func(c *confCtx) (string, error) { return ok(createFile(c.p("f"), 0o4755)) }, check: []string{"f"}},
		confCase{name: "creat-2755", op: func(c *confCtx) (string, error) { return ok(createFile(c.p("f"), 0o2755)) }, check: []string{"f"}},
		confCase{name: "creat-umask0-0666", op: func(c *confCtx) (string, error) {
			old := syscall.Umask(0)
			defer syscall.Umask(old)
			return ok(createFile(c.p("f"), 0o666))
		}, check: []string{"f"}},
		confCase{name: "mkdir-0000", op: func(c *confCtx) (string, error) {
			if err := syscall.Mkdir(c.p("d"), 0); err != nil {
				return "", err
			}
			return statString(c.p("d"))
		}, check: []string{"d"}},
		confCase{name: "mkdir-umask0-1777", op: func(c *confCtx) (string, error) {
			old := syscall.Umask(0)
			defer syscall.Umask(old)
			return ok(syscall.Mkdir(c.p("d"), 0o1777))
		}, check: []string{"d"}},
		confCase{name: "creat-in-sgid-dir",
			setup: func(f *fixture) { f.dir("g", 0o2777, confOther, confOther) },
			op:    func(c *confCtx) (string, error) { return ok(createFile(c.p("g/f"), 0o2755)) },
			check: []string{"g", "g/f"}},
		confCase{name: "mkdir-in-sgid-dir",
			setup: func(f *fixture) { f.dir("g", 0o2777, confOther, confOther) },
			op:    func(c *confCtx) (string, error) { return ok(syscall.Mkdir(c.p("g/d"), 0o755)) },
			check: []string{"g/d"}},
		confCase{name: "read-file-0000",
			setup: func(f *fixture) { f.file("z", 0, 0, 0, "secret") },
			op:    func(c *confCtx) (string, error) { return readString(c.p("z")) },
			check: []string{"z"}},
		confCase{name: "stat-file-0000",
			setup: func(f *fixture) { f.file("z", 0, f.uid, f.uid, "secret") },
			op:    func(c *confCtx) (string, error) { return statString(c.p("z")) },
			check: []string{"z"}},
		confCase{name: "write-own-file-0000",
			setup: func(f *fixture) { f.file("z", 0, f.uid, f.uid, "secret") },
			op:    func(c *confCtx) (string, error) { return ok(writeTo(c.p("z"), 0)) },
			check: []string{"z"}},
		confCase{name: "list-dir-0000",
			setup: func(f *fixture) { f.dir("z", 0, 0, 0) },
			op: func(c *confCtx) (string, error) {
				es, err := os.ReadDir(c.p("z"))
				return fmt.Sprint(len(es)), errnoOf(err)
			},
			check: []string{"z"}},
		confCase{name: "stat-dir-0000",
			setup: func(f *fixture) { f.dir("z", 0, f.uid, f.uid) },
			op:    func(c *confCtx) (string, error) { return statString(c.p("z")) },
			check: []string{"z"}},
		confCase{name: "chmod-own-0000", setup: func(f *fixture) { f.file("f", 0o644, f.uid, f.uid, "x") },
			op: func(c *confCtx) (string, error) {
				if err := syscall.Chmod(c.p("f"), 0); err != nil {
					return "", err
				}
				return statString(c.p("f"))
			}, check: []string{"f"}},
	)

	// setuid/setgid clearing (item 5).
	add(
		confCase{name: "write-4777-other",
			setup: func(f *fixture) { f.file("s", 0o4777, confOther, confOther, "x") },
			op:    func(c *confCtx) (string, error) { return ok(writeTo(c.p("s"), 0)) },
			check: []string{"s"}},
		confCase{name: "append-4777-other",
			setup: func(f *fixture) { f.file("s", 0o4777, confOther, confOther, "x") },
			op:    func(c *confCtx) (string, error) { return ok(writeTo(c.p("s"), syscall.O_APPEND)) },
			check: []string{"s"}},
		confCase{name: "write-6777-own",
			setup: func(f *fixture) { f.file("s", 0o6777, f.uid, f.uid, "x") },
			op:    func(c *confCtx) (string, error) { return ok(writeTo(c.p("s"), 0)) },
			check: []string{"s"}},
		confCase{name: "write-2775-group",
			setup: func(f *fixture) { f.file("s", 0o2775, confOther, f.uid, "x") },
			op:    func(c *confCtx) (string, error) { return ok(writeTo(c.p("s"), 0)) },
			check: []string{"s"}},
		confCase{name: "write-2765-group-no-x",
			setup: func(f *fixture) { f.file("s", 0o2765, confOther, f.uid, "x") },
			op:    func(c *confCtx) (string, error) { return ok(writeTo(c.p("s"), 0)) },
			check: []string{"s"}},
		confCase{name: "truncate-4777-other",
			setup: func(f *fixture) { f.file("s", 0o4777, confOther, confOther, "xyz") },
			op:    func(c *confCtx) (string, error) { return ok(syscall.Truncate(c.p("s"), 1)) },
			check: []string{"s"}},
		confCase{name: "ftruncate-4777-other",
			setup: func(f *fixture) { f.file("s", 0o4777, confOther, confOther, "xyz") },
			op: func(c *confCtx) (string, error) {
				fd, err := syscall.Open(c.p("s"), syscall.O_WRONLY, 0)
				if err != nil {
					return "", err
				}
				err = syscall.Ftruncate(fd, 1)
				return ok(errors.Join(err, syscall.Close(fd)))
			},
			check: []string{"s"}},
		confCase{name: "otrunc-4777-other",
			setup: func(f *fixture) { f.file("s", 0o4777, confOther, confOther, "xyz") },
			op: func(c *confCtx) (string, error) {
				fd, err := syscall.Open(c.p("s"), syscall.O_WRONLY|syscall.O_TRUNC, 0)
				if err != nil {
					return "", err
				}
				return ok(syscall.Close(fd))
			},
			check: []string{"s"}},
		confCase{name: "fallocate-4777-other",
			setup: func(f *fixture) { f.file("s", 0o4777, confOther, confOther, "xyz") },
			op: func(c *confCtx) (string, error) {
				fd, err := syscall.Open(c.p("s"), syscall.O_WRONLY, 0)
				if err != nil {
					return "", err
				}
				err = unix.Fallocate(fd, 0, 0, 8192)
				return ok(errors.Join(err, syscall.Close(fd)))
			},
			check: []string{"s"}},
		confCase{name: "copy-file-range-4777-other",
			setup: func(f *fixture) {
				f.file("s", 0o4777, confOther, confOther, "xyz")
				f.file("src", 0o644, f.uid, f.uid, "copied")
			},
			op: func(c *confCtx) (string, error) {
				in, err := syscall.Open(c.p("src"), syscall.O_RDONLY, 0)
				if err != nil {
					return "", err
				}
				defer syscall.Close(in)
				out, err := syscall.Open(c.p("s"), syscall.O_WRONLY, 0)
				if err != nil {
					return "", err
				}
				_, err = unix.CopyFileRange(in, nil, out, nil, 6, 0)
				return ok(errors.Join(err, syscall.Close(out)))
			},
			check: []string{"s"}},
		confCase{name: "chown-own-4755",
			setup: func(f *fixture) { f.file("s", 0o4755, f.uid, f.uid, "x") },
			op:    func(c *confCtx) (string, error) { return ok(syscall.Chown(c.p("s"), -1, c.uid)) },
			check: []string{"s"}},
		confCase{name: "chown-own-2755-dir",
			setup: func(f *fixture) { f.dir("s", 0o2755, f.uid, f.uid) },
			op:    func(c *confCtx) (string, error) { return ok(syscall.Chown(c.p("s"), -1, c.uid)) },
			check: []string{"s"}},
		confCase{name: "chown-other-to-self",
			setup: func(f *fixture) { f.file("s", 0o644, confOther, confOther, "x") },
			op:    func(c *confCtx) (string, error) { return ok(syscall.Chown(c.p("s"), c.uid, -1)) },
			check: []string{"s"}},
		confCase{name: "chmod-other",
			setup: func(f *fixture) { f.file("s", 0o644, confOther, confOther, "x") },
			op:    func(c *confCtx) (string, error) { return ok(syscall.Chmod(c.p("s"), 0o600)) },
			check: []string{"s"}},
		confCase{name: "chmod-setgid-not-in-group",
			setup: func(f *fixture) { f.file("s", 0o644, f.uid, confOther, "x") },
			op:    func(c *confCtx) (string, error) { return ok(syscall.Chmod(c.p("s"), 0o2755)) },
			check: []string{"s"}},
	)

	// Sticky directories: the callers own neither the directory (root's)
	// nor the files (confOther's).
	sticky := func(f *fixture) {
		f.dir("t", 0o1777, 0, 0)
		f.file("t/f", 0o666, confOther, confOther, "x")
		f.file("t/mine", 0o644, f.uid, f.uid, "m")
		f.dir("t/sd", 0o777, confOther, confOther)
	}
	stickyCheck := []string{"t", "t/f", "t/g", "t/mine", "t/sd"}
	add(
		confCase{name: "sticky-unlink-other", setup: sticky, op: func(c *confCtx) (string, error) { return ok(syscall.Unlink(c.p("t/f"))) }, check: stickyCheck},
		confCase{name: "sticky-rename-other", setup: sticky, op: func(c *confCtx) (string, error) { return ok(syscall.Rename(c.p("t/f"), c.p("t/g"))) }, check: stickyCheck},
		confCase{name: "sticky-rename-out-other", setup: sticky, op: func(c *confCtx) (string, error) { return ok(syscall.Rename(c.p("t/f"), c.p("g"))) }, check: append(stickyCheck, "g")},
		confCase{name: "sticky-rename-over-other", setup: sticky, op: func(c *confCtx) (string, error) { return ok(syscall.Rename(c.p("t/mine"), c.p("t/f"))) }, check: stickyCheck},
		confCase{name: "sticky-rmdir-other", setup: sticky, op: func(c *confCtx) (string, error) { return ok(syscall.Rmdir(c.p("t/sd"))) }, check: stickyCheck},
		confCase{name: "sticky-unlink-own", setup: sticky, op: func(c *confCtx) (string, error) { return ok(syscall.Unlink(c.p("t/mine"))) }, check: stickyCheck},
		confCase{name: "sticky-link-other", setup: sticky, op: func(c *confCtx) (string, error) { return ok(syscall.Link(c.p("t/f"), c.p("t/g"))) }, check: stickyCheck},
		confCase{name: "sticky-ocreat-other", setup: sticky, op: func(c *confCtx) (string, error) {
			// fs.protected_regular: O_CREAT of another user's file in a
			// world-writable sticky directory.
			fd, err := syscall.Open(c.p("t/f"), syscall.O_CREAT|syscall.O_WRONLY, 0o644)
			if err != nil {
				return "", err
			}
			return ok(syscall.Close(fd))
		}, check: stickyCheck},
	)

	// O_TMPFILE: the mode as given, and linking it into the tree.
	add(
		confCase{name: "tmpfile-0000", op: func(c *confCtx) (string, error) {
			fd, err := syscall.Open(c.dir, unix.O_TMPFILE|syscall.O_WRONLY, 0)
			if err != nil {
				return "", err
			}
			defer syscall.Close(fd)
			var st syscall.Stat_t
			if err := syscall.Fstat(fd, &st); err != nil {
				return "", err
			}
			return fmt.Sprintf("mode=%o uid=%d gid=%d", st.Mode&0o7777, st.Uid, st.Gid), nil
		}},
		confCase{name: "tmpfile-link", op: func(c *confCtx) (string, error) {
			fd, err := syscall.Open(c.dir, unix.O_TMPFILE|syscall.O_WRONLY, 0o640)
			if err != nil {
				return "", err
			}
			defer syscall.Close(fd)
			if _, err := syscall.Write(fd, []byte("tmp")); err != nil {
				return "", err
			}
			return ok(unix.Linkat(unix.AT_FDCWD, fmt.Sprintf("/proc/self/fd/%d", fd), unix.AT_FDCWD, c.p("t"), unix.AT_SYMLINK_FOLLOW))
		}, check: []string{"t"}},
	)

	// Every syscall class on ordinary names.
	plain := func(f *fixture) {
		f.file("f", 0o644, f.uid, f.uid, "data")
		f.file("other600", 0o600, confOther, confOther, "secret")
		f.dir("d", 0o755, f.uid, f.uid)
		f.file("d/x", 0o644, f.uid, f.uid, "x")
		f.dir("e", 0o755, f.uid, f.uid)
		f.symlink("f", "sl")
	}
	plainCheck := []string{"f", "g", "d", "d/x", "e", "sl", "n", "other600"}
	add(
		confCase{name: "link-own", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Link(c.p("f"), c.p("g"))) }, check: plainCheck},
		confCase{name: "link-other-0600", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Link(c.p("other600"), c.p("g"))) }, check: plainCheck},
		confCase{name: "link-exists", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Link(c.p("f"), c.p("e"))) }, check: plainCheck},
		confCase{name: "mknod-chr", setup: plain, op: func(c *confCtx) (string, error) {
			return ok(syscall.Mknod(c.p("n"), syscall.S_IFCHR|0o644, int(unix.Mkdev(1, 3))))
		}, check: plainCheck},
		confCase{name: "mknod-reg-0000", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Mknod(c.p("n"), syscall.S_IFREG, 0)) }, check: plainCheck},
		confCase{name: "mkfifo", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Mknod(c.p("n"), syscall.S_IFIFO|0o640, 0)) }, check: plainCheck},
		confCase{name: "mkfifo-exists", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Mknod(c.p("f"), syscall.S_IFIFO|0o640, 0)) }, check: plainCheck},
		confCase{name: "symlink", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Symlink("../x/y", c.p("n"))) }, check: plainCheck},
		confCase{name: "readlink", setup: plain, op: func(c *confCtx) (string, error) { return os.Readlink(c.p("sl")) }, check: plainCheck},
		confCase{name: "rmdir-nonempty", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Rmdir(c.p("d"))) }, check: plainCheck},
		confCase{name: "rmdir-empty", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Rmdir(c.p("e"))) }, check: plainCheck},
		confCase{name: "rmdir-file", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Rmdir(c.p("f"))) }, check: plainCheck},
		confCase{name: "unlink-dir", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Unlink(c.p("d"))) }, check: plainCheck},
		confCase{name: "unlink-symlink", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Unlink(c.p("sl"))) }, check: plainCheck},
		confCase{name: "rename-file", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Rename(c.p("f"), c.p("g"))) }, check: plainCheck},
		confCase{name: "rename-dir-over-empty", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Rename(c.p("d"), c.p("e"))) }, check: plainCheck},
		confCase{name: "rename-empty-over-nonempty", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Rename(c.p("e"), c.p("d"))) }, check: plainCheck},
		confCase{name: "rename-file-over-dir", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Rename(c.p("f"), c.p("e"))) }, check: plainCheck},
		confCase{name: "rename-noreplace", setup: plain, op: func(c *confCtx) (string, error) {
			return ok(unix.Renameat2(unix.AT_FDCWD, c.p("f"), unix.AT_FDCWD, c.p("sl"), unix.RENAME_NOREPLACE))
		}, check: plainCheck},
		confCase{name: "rename-exchange", setup: plain, op: func(c *confCtx) (string, error) {
			return ok(unix.Renameat2(unix.AT_FDCWD, c.p("f"), unix.AT_FDCWD, c.p("d"), unix.RENAME_EXCHANGE))
		}, check: plainCheck},
		confCase{name: "truncate-own", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Truncate(c.p("f"), 2)) }, check: plainCheck},
		confCase{name: "truncate-other-0600", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Truncate(c.p("other600"), 0)) }, check: plainCheck},
		confCase{name: "read-other-0600", setup: plain, op: func(c *confCtx) (string, error) { return readString(c.p("other600")) }, check: plainCheck},
		confCase{name: "chmod-own-4755", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Chmod(c.p("f"), 0o4755)) }, check: plainCheck},
		confCase{name: "chown-own-to-other", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Chown(c.p("f"), confOther, -1)) }, check: plainCheck},
		confCase{name: "lchown-symlink", setup: plain, op: func(c *confCtx) (string, error) { return ok(syscall.Lchown(c.p("sl"), -1, c.uid)) }, check: plainCheck},
		confCase{name: "xattr-set-get", setup: plain, op: func(c *confCtx) (string, error) {
			if err := unix.Setxattr(c.p("f"), "user.conf", []byte("v"), 0); err != nil {
				return "", err
			}
			b := make([]byte, 16)
			n, err := unix.Getxattr(c.p("f"), "user.conf", b)
			if err != nil {
				return "", err
			}
			return string(b[:n]), nil
		}, check: plainCheck},
		confCase{name: "xattr-get-other-0600", setup: plain, op: func(c *confCtx) (string, error) {
			_, err := unix.Getxattr(c.p("other600"), "user.conf", make([]byte, 16))
			return ok(err)
		}, check: plainCheck},
	)

	// NAME_MAX: 255 bytes is the longest name, 256 is too long.
	for _, n := range []int{255, 256} {
		nm := name(n)
		withName := func(f *fixture) {
			f.file("f", 0o644, f.uid, f.uid, "data")
			if n <= 255 {
				f.file("s"+nm[1:], 0o644, f.uid, f.uid, "long")
			}
		}
		chk := []string{"f", nm, "s" + nm[1:]}
		add(
			confCase{name: fmt.Sprintf("name%d-creat", n), setup: withName, op: func(c *confCtx) (string, error) { return ok(createFile(c.p(nm), 0o640)) }, check: chk},
			confCase{name: fmt.Sprintf("name%d-mkdir", n), setup: withName, op: func(c *confCtx) (string, error) { return ok(syscall.Mkdir(c.p(nm), 0o750)) }, check: chk},
			confCase{name: fmt.Sprintf("name%d-mkfifo", n), setup: withName, op: func(c *confCtx) (string, error) { return ok(syscall.Mknod(c.p(nm), syscall.S_IFIFO|0o600, 0)) }, check: chk},
			confCase{name: fmt.Sprintf("name%d-symlink", n), setup: withName, op: func(c *confCtx) (string, error) { return ok(syscall.Symlink("f", c.p(nm))) }, check: chk},
			confCase{name: fmt.Sprintf("name%d-link", n), setup: withName, op: func(c *confCtx) (string, error) { return ok(syscall.Link(c.p("f"), c.p(nm))) }, check: chk},
			confCase{name: fmt.Sprintf("name%d-rename", n), setup: withName, op: func(c *confCtx) (string, error) { return ok(syscall.Rename(c.p("f"), c.p(nm))) }, check: chk},
			confCase{name: fmt.Sprintf("name%d-stat", n), setup: withName, op: func(c *confCtx) (string, error) { return statString(c.p("s" + nm[1:])) }, check: chk},
		)
	}

	// PATH_MAX: paths relative to the tree root of exactly 4095 bytes
	// (the longest a syscall takes) and 4096 (too long), whose backing
	// paths are longer than PATH_MAX.
	for _, total := range []int{atPathMax, beyondPathMax} {
		total := total
		// Every case directory has the same layout: the directories of
		// the long path, and at its end an existing file "x...", an
		// existing directory "y..." and an existing symlink "z..." (one
		// byte shorter names, so the new name fits exactly).
		lp := func(c *confCtx) long { return mkLong(c.dir, total) }
		setup := func(f *fixture) {
			l := mkLong(f.path, total)
			f.chain(l.comps)
			f.file("f", 0o644, f.uid, f.uid, "short")
			short := l.leaf[1:]
			f.file(l.rel("x"+short), 0o644, f.uid, f.uid, "long")
			f.dir(l.rel("y"+short), 0o755, f.uid, f.uid)
			f.symlink("f", l.rel("z"+short))
		}
		check := func(c *confCtx) []string {
			l := lp(c)
			s := l.leaf[1:]
			return []string{"f", l.rel(l.leaf), l.rel("x" + s), l.rel("y" + s), l.rel("z" + s)}
		}
		// at is the new entry, ex the existing file, dir the existing
		// directory, sl the existing symlink: all total bytes long.
		at := func(c *confCtx) string { l := lp(c); return c.dir + "/" + l.rel(l.leaf) }
		ex := func(c *confCtx) string { l := lp(c); return c.dir + "/" + l.rel("x"+l.leaf[1:]) }
		dir := func(c *confCtx) string { l := lp(c); return c.dir + "/" + l.rel("y"+l.leaf[1:]) }
		sl := func(c *confCtx) string { l := lp(c); return c.dir + "/" + l.rel("z"+l.leaf[1:]) }
		type pc struct {
			name string
			op   func(c *confCtx) (string, error)
		}
		for _, p := range []pc{
			{"creat", func(c *confCtx) (string, error) { return ok(createFile(at(c), 0o600)) }},
			{"mkdir", func(c *confCtx) (string, error) { return ok(syscall.Mkdir(at(c), 0o700)) }},
			{"mknod-reg", func(c *confCtx) (string, error) { return ok(syscall.Mknod(at(c), syscall.S_IFREG|0o600, 0)) }},
			{"mkfifo", func(c *confCtx) (string, error) { return ok(syscall.Mknod(at(c), syscall.S_IFIFO|0o600, 0)) }},
			{"symlink", func(c *confCtx) (string, error) { return ok(syscall.Symlink("f", at(c))) }},
			{"symlink-target", func(c *confCtx) (string, error) {
				return ok(syscall.Symlink(strings.Repeat("t", total), c.p("f2")))
			}},
			{"link-to", func(c *confCtx) (string, error) { return ok(syscall.Link(c.p("f"), at(c))) }},
			{"link-from", func(c *confCtx) (string, error) { return ok(syscall.Link(ex(c), c.p("g"))) }},
			{"rename-to", func(c *confCtx) (string, error) { return ok(syscall.Rename(c.p("f"), at(c))) }},
			{"rename-from", func(c *confCtx) (string, error) { return ok(syscall.Rename(ex(c), c.p("g"))) }},
			{"unlink", func(c *confCtx) (string, error) { return ok(syscall.Unlink(ex(c))) }},
			{"rmdir", func(c *confCtx) (string, error) { return ok(syscall.Rmdir(dir(c))) }},
			{"truncate", func(c *confCtx) (string, error) { return ok(syscall.Truncate(ex(c), 1)) }},
			{"chmod", func(c *confCtx) (string, error) { return ok(syscall.Chmod(ex(c), 0o4711)) }},
			{"chown", func(c *confCtx) (string, error) { return ok(syscall.Chown(ex(c), -1, c.uid)) }},
			{"stat", func(c *confCtx) (string, error) { return statString(ex(c)) }},
			{"read", func(c *confCtx) (string, error) { return readString(ex(c)) }},
			{"write", func(c *confCtx) (string, error) { return ok(writeTo(ex(c), syscall.O_APPEND)) }},
			{"readlink", func(c *confCtx) (string, error) { return os.Readlink(sl(c)) }},
			{"readdir", func(c *confCtx) (string, error) {
				es, err := os.ReadDir(dir(c))
				return fmt.Sprint(len(es)), errnoOf(err)
			}},
			{"xattr", func(c *confCtx) (string, error) { return ok(unix.Setxattr(ex(c), "user.conf", []byte("v"), 0)) }},
		} {
			add(confCase{name: fmt.Sprintf("path%d-%s", total, p.name), setup: setup, op: p.op, checkFn: check})
		}
	}
	return cs
}

// caseDir is a case's directory relative to a tree root.
func caseDir(uid, i int) string { return fmt.Sprintf("w/%d/%d", uid, i) }

// confResult is one case's outcome on both trees, as the child reports it.
type confResult struct {
	Case int    `json:"case"`
	Twin string `json:"twin"`
	Mnt  string `json:"mnt"`
}

func outcome(res string, err error) string {
	if err != nil {
		var errno syscall.Errno
		if errors.As(err, &errno) {
			return "errno " + unix.ErrnoName(errno)
		}
		return "error " + err.Error()
	}
	return "ok " + res
}

// TestConformanceChild is not a test: TestConformance runs it as each
// caller to run that caller's cases on both trees.
func TestConformanceChild(t *testing.T) {
	twin, mnt := os.Getenv("GDSFS_CONF_TWIN"), os.Getenv("GDSFS_CONF_MNT")
	if twin == "" || mnt == "" {
		t.Skip("helper process for TestConformance")
	}
	syscall.Umask(0o022)
	if names := os.Getenv("GDSFS_CONF_CTLWRITE"); names != "" {
		childExit(childCtlWrite(twin, mnt, strings.Split(names, ",")))
	}
	uid := os.Getuid()
	w := bufio.NewWriter(os.Stdout)
	for i, c := range confCases() {
		ctx := &confCtx{uid: uid, dir: caseDir(uid, i)}
		var r confResult
		r.Case = i
		for j, root := range []string{twin, mnt} {
			if err := os.Chdir(root); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(2)
			}
			o := outcome(c.op(ctx))
			if j == 0 {
				r.Twin = o
			} else {
				r.Mnt = o
			}
		}
		b, _ := json.Marshal(r)
		fmt.Fprintf(w, "CONF %s\n", b)
	}
	w.Flush()
	os.Exit(0)
}

// entryState describes one entry for comparison.
func entryState(dirfd int, rel string) string {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, rel, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return "absent (" + unix.ErrnoName(err.(syscall.Errno)) + ")"
	}
	s := fmt.Sprintf("type=%o mode=%04o uid=%d gid=%d nlink=%d", st.Mode&unix.S_IFMT, st.Mode&0o7777, st.Uid, st.Gid, st.Nlink)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		s += " size=" + strconv.FormatInt(st.Size, 10)
	case unix.S_IFLNK:
		b := make([]byte, 8192)
		n, err := unix.Readlinkat(dirfd, rel, b)
		if err != nil {
			s += " readlink " + err.Error()
		} else {
			s += fmt.Sprintf(" target=%d:%.20q", n, b[:n])
		}
	}
	return s
}

func openDirPath(t testing.TB, p string) int {
	t.Helper()
	fd, err := unix.Open(p, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open %s: %v", p, err)
	}
	return fd
}

// TestConformance: see the comment at the top of this file.
func TestConformance(t *testing.T) {
	requireRoot(t)
	for _, mode := range []struct {
		name          string
		noPassthrough bool
	}{{"passthrough", false}, {"daemon", true}} {
		t.Run(mode.name, func(t *testing.T) { runConformance(t, mode.noPassthrough) })
	}
}

func runConformance(t *testing.T, noPassthrough bool) {
	base := t.TempDir()
	twin, backing := filepath.Join(base, "twin"), filepath.Join(base, "backing")
	for _, d := range []string{twin, backing} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mnt, _ := startMount(t, mountOpts{Backing: backing, AllowOther: true, NoPassthrough: noPassthrough}).dirs()
	for _, p := range []string{base, mnt} {
		for d := p; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
			if err := os.Chmod(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	cases := confCases()
	// Build every case directory in both trees, directly (not through the
	// mount), as root.
	for _, root := range []string{twin, backing} {
		for _, uid := range confUIDs {
			if err := os.MkdirAll(filepath.Join(root, "w", strconv.Itoa(uid)), 0o755); err != nil {
				t.Fatal(err)
			}
			for i, c := range cases {
				d := filepath.Join(root, caseDir(uid, i))
				if err := os.Mkdir(d, 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Chown(d, uid, uid); err != nil {
					t.Fatal(err)
				}
				if c.setup != nil {
					fd := openDirPath(t, d)
					c.setup(&fixture{t: t, fd: fd, uid: uid, path: caseDir(uid, i)})
					unix.Close(fd)
				}
			}
		}
	}
	bin := worldExecutable(t, os.Args[0])
	pass, total := 0, 0
	for _, uid := range confUIDs {
		cmd := child{bin: bin, family: "CONF", env: map[string]string{"TWIN": twin, "MNT": mnt}, uid: uint32(uid)}.cmd(t)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("child as uid %d: %v\n%s%s", uid, err, out, stderr.Bytes())
		}
		got := map[int]confResult{}
		for _, line := range strings.Split(string(out), "\n") {
			if js, ok := strings.CutPrefix(line, "CONF "); ok {
				var r confResult
				if err := json.Unmarshal([]byte(js), &r); err != nil {
					t.Fatalf("child as uid %d: %q: %v", uid, line, err)
				}
				got[r.Case] = r
			}
		}
		for i, c := range cases {
			total++
			r, ok := got[i]
			if !ok {
				t.Errorf("uid %d %s: no result from the child", uid, c.name)
				continue
			}
			diffs := []string{}
			if r.Twin != r.Mnt {
				diffs = append(diffs, fmt.Sprintf("result: backing fs %q; gdsfs %q", r.Twin, r.Mnt))
			}
			ctx := &confCtx{uid: uid, dir: caseDir(uid, i)}
			fds := [3]int{
				openDirPath(t, filepath.Join(twin, ctx.dir)),
				openDirPath(t, filepath.Join(backing, ctx.dir)),
				openDirPath(t, filepath.Join(mnt, ctx.dir)),
			}
			for _, rel := range c.checks(ctx) {
				tw, bk, mt := entryState(fds[0], rel), entryState(fds[1], rel), entryState(fds[2], rel)
				if tw != bk {
					diffs = append(diffs, fmt.Sprintf("%s: backing fs %s; gdsfs backing %s", short(rel), tw, bk))
				}
				if mt != bk {
					diffs = append(diffs, fmt.Sprintf("%s: through the mount %s; its backing %s", short(rel), mt, bk))
				}
			}
			for _, fd := range fds {
				unix.Close(fd)
			}
			if len(diffs) > 0 {
				t.Errorf("uid %d %s:\n\t%s", uid, c.name, strings.Join(diffs, "\n\t"))
			} else {
				pass++
			}
		}
	}
	t.Logf("%d of %d cases x uids agree with the backing filesystem (%d cases, %d uids)", pass, total, len(cases), len(confUIDs))
}

func (c confCase) checks(ctx *confCtx) []string {
	if c.checkFn != nil {
		return c.checkFn(ctx)
	}
	return c.check
}

// short abbreviates a long relative path for messages.
func short(rel string) string {
	if len(rel) <= 40 {
		return rel
	}
	return fmt.Sprintf("(%d bytes)...%s", len(rel), rel[len(rel)-20:])
}

// childCtlWrite writes 4 bytes into each named file: on the twin with
// pwrite, through the mount with the control path's WRITE.
func childCtlWrite(twin, mnt string, names []string) error {
	ctx := context.Background()
	cl, err := ctl.OpenSession(mnt)
	if err != nil {
		return err
	}
	defer cl.Close()
	l, err := cl.Alloc(ctx, ctl.HostDevice, 4)
	if err != nil {
		return err
	}
	buf, err := cl.Bytes(ctx, l)
	if err != nil {
		return err
	}
	copy(buf, "ctlw")
	for _, name := range names {
		f, err := os.OpenFile(filepath.Join(twin, name), os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		_, err = f.WriteAt([]byte("ctlw"), 1)
		if err := errors.Join(err, f.Close()); err != nil {
			return fmt.Errorf("pwrite %s: %w", name, err)
		}
		f, err = os.OpenFile(filepath.Join(mnt, name), os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		err = cl.Write(ctx, f, l, 0, 1, 4, false)
		if err := errors.Join(err, f.Close()); err != nil {
			return fmt.Errorf("control-path WRITE %s: %w", name, err)
		}
	}
	return cl.Release(ctx, l.ID)
}

// TestControlWriteClearsSetID: a control-path WRITE (done by the daemon,
// as root, which holds CAP_FSETID) clears setuid and setgid bits exactly
// as a write by the caller does on the backing filesystem, for a caller
// owning the file and one who does not, and keeps them for root.
func TestControlWriteClearsSetID(t *testing.T) {
	m := startMount(t, mountOpts{Daemon: true, OtherUIDs: true})
	twin := t.TempDir()
	for d := twin; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	files := []struct {
		name     string
		mode     uint32
		uid, gid int // -1: the caller's
	}{
		{"u4777-other", 0o4777, confOther, confOther},
		{"u4755-own", 0o4755, -1, -1},
		{"g2775-group", 0o2775, confOther, -1},
		{"g2765-group-no-x", 0o2765, confOther, -1},
		{"ug6777-other", 0o6777, confOther, confOther},
	}
	bin := worldExecutable(t, os.Args[0])
	for _, uid := range []int{0, 10001} {
		var names []string
		for _, f := range files {
			name := fmt.Sprintf("%s-%d", f.name, uid)
			names = append(names, name)
			u, g := f.uid, f.gid
			if u < 0 {
				u = uid
			}
			if g < 0 {
				g = uid
			}
			for _, root := range []string{twin, m.backing} {
				p := filepath.Join(root, name)
				writeFile(t, p, []byte("0123456789"))
				if err := os.Chown(p, u, g); err != nil {
					t.Fatal(err)
				}
				if err := syscall.Chmod(p, f.mode); err != nil {
					t.Fatal(err)
				}
			}
		}
		cmd := child{bin: bin, family: "CONF", env: map[string]string{"TWIN": twin, "MNT": m.mnt, "CTLWRITE": strings.Join(names, ",")}, uid: uint32(uid)}.cmd(t)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("child as uid %d: %v\n%s", uid, err, out)
		}
		for _, name := range names {
			var want, got syscall.Stat_t
			if err := syscall.Stat(filepath.Join(twin, name), &want); err != nil {
				t.Fatal(err)
			}
			if err := syscall.Stat(filepath.Join(m.backing, name), &got); err != nil {
				t.Fatal(err)
			}
			if got.Mode != want.Mode || got.Size != want.Size {
				t.Errorf("uid %d wrote %s: through the control path mode %o size %d; a write on the backing filesystem leaves mode %o size %d",
					uid, name, got.Mode&0o7777, got.Size, want.Mode&0o7777, want.Size)
			}
		}
	}
}
