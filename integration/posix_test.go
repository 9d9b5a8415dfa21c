package integration

import (
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hanwen/go-fuse/v2/posixtest"
)

// TestPosixtest runs every test of go-fuse's posixtest suite against a
// fresh gdsfs mount, once with kernel passthrough (where the kernel offers
// it), once with the daemon serving all I/O, and once against the gdsfs
// binary mounted with its default flags (control path included). No test
// is skipped.
func TestPosixtest(t *testing.T) {
	tests := maps.Clone(posixtest.All) // never mutate go-fuse's map
	// go-fuse's version expects OFD semantics (posixlock_test.go).
	tests["FcntlFlockLocksFile"] = fcntlLocksArePerProcess
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
						mnt, _ = startMount(t, o).dirs()
					}
					tests[name](t, mnt)
				})
			}
		})
	}
}

// TestSymlinkSwap attacks the root daemon as an unprivileged user who can
// write to a directory of the backing tree: after the kernel has looked up
// a file and a directory (long cache timeouts keep those nodes), the user
// replaces them, directly in the backing directory, with symlinks to a
// root 0600 file and a root 0700 directory. Reads, listings and xattrs
// through the mount must never reach the root-owned targets: the daemon
// does not follow symlinks in the backing tree, and the kernel, told the
// node is stale, looks the names up again and follows the symlinks itself,
// as the user.
func TestSymlinkSwap(t *testing.T) {
	requireRoot(t)
	const uid = 10001
	base := t.TempDir()
	backing := filepath.Join(base, "backing")
	shared := filepath.Join(backing, "shared")
	secret := filepath.Join(base, "secret")
	secretDir := filepath.Join(base, "secretdir")
	for _, d := range []string{backing, shared, secretDir} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, secret, []byte("SECRET-FILE"))
	writeFile(t, filepath.Join(secretDir, "SECRET-NAME"), []byte("x"))
	writeFile(t, filepath.Join(secretDir, "pub"), []byte("SECRET-IN-DIR"))
	if err := unix.Setxattr(secret, "user.s", []byte("SECRET-XATTR"), 0); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(secret, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(secretDir, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(shared, "f"), []byte("public"))
	writeFile(t, filepath.Join(shared, "d", "pub"), []byte("public"))
	if err := unix.Setxattr(filepath.Join(shared, "f"), "user.s", []byte("public"), 0); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"", "f", "d", "d/pub"} {
		if err := os.Chown(filepath.Join(shared, p), uid, uid); err != nil {
			t.Fatal(err)
		}
	}
	mnt, _ := startMount(t, mountOpts{Backing: backing, AllowOther: true, AttrTimeout: time.Hour, EntryTimeout: time.Hour}).dirs()
	for _, p := range []string{base, mnt} {
		for d := p; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
			if err := os.Chmod(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	script := `M=$1/shared B=$2/shared
cat $M/f $M/d/pub >/dev/null && ls $M/d >/dev/null && getfattr -n user.s $M/f >/dev/null || exit 1
mv $B/f $B/f.old && ln -s "$3" $B/f && mv $B/d $B/d.old && ln -s "$4" $B/d || exit 1
echo "cat f: $(cat $M/f 2>&1)"
echo "cat d/pub: $(cat $M/d/pub 2>&1)"
echo "ls d: $(ls $M/d 2>&1)"
echo "stat d/pub: $(stat -c size=%s $M/d/pub 2>&1)"
echo "getfattr f: $(getfattr --only-values -n user.s $M/f 2>&1)"
echo "listxattr f: $(getfattr -d $M/f 2>&1)"
`
	cmd := exec.Command("sh", "-c", script, "sh", mnt, backing, secret, secretDir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("attack script: %v\n%s", err, out)
	}
	t.Logf("as uid %d after the swap:\n%s", uid, out)
	// "size=13": the size of the root-owned d/pub.
	for _, leak := range []string{"SECRET", "size=13"} {
		if strings.Contains(string(out), leak) {
			t.Errorf("uid %d reached root-owned data through the mount (%q):\n%s", uid, leak, out)
		}
	}
	// The same names still work for what the user may reach: the
	// daemon answers with the symlinks, and the kernel follows them.
	if got, err := os.Readlink(filepath.Join(mnt, "shared", "f")); err != nil || got != secret {
		t.Errorf("readlink through the mount: %q, %v; want %q", got, err, secret)
	}
}

// TestBackingReplacedBehindMount: files and directories replaced directly
// in the backing directory, while the kernel still caches the old nodes
// (long timeouts), read back as the new ones through the mount: the daemon
// answers ESTALE for the old node and the kernel looks the name up again,
// so no caller sees the error.
func TestBackingReplacedBehindMount(t *testing.T) {
	backing := t.TempDir()
	writeFile(t, filepath.Join(backing, "f"), []byte("old"))
	writeFile(t, filepath.Join(backing, "d", "old"), []byte("x"))
	mnt, _ := startMount(t, mountOpts{Backing: backing, AttrTimeout: time.Hour, EntryTimeout: time.Hour}).dirs()
	if got, err := os.ReadFile(filepath.Join(mnt, "f")); err != nil || string(got) != "old" {
		t.Fatalf("read f: %q, %v", got, err)
	}
	if es, err := os.ReadDir(filepath.Join(mnt, "d")); err != nil || len(es) != 1 {
		t.Fatalf("list d: %v, %v", es, err)
	}
	writeFile(t, filepath.Join(backing, "f.new"), []byte("new contents"))
	if err := os.Rename(filepath.Join(backing, "f.new"), filepath.Join(backing, "f")); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(backing, "d.new", "new"), []byte("y"))
	if err := os.RemoveAll(filepath.Join(backing, "d")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(backing, "d.new"), filepath.Join(backing, "d")); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "f")); err != nil || string(got) != "new contents" {
		t.Errorf("read f after it was replaced in the backing directory: %q, %v", got, err)
	}
	if st, err := os.Stat(filepath.Join(mnt, "f")); err != nil || st.Size() != int64(len("new contents")) {
		t.Errorf("stat f after it was replaced: %v, %v", st, err)
	}
	es, err := os.ReadDir(filepath.Join(mnt, "d"))
	if err != nil || len(es) != 1 || es[0].Name() != "new" {
		t.Errorf("list d after it was replaced: %v, %v", es, err)
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "d", "new")); err != nil || string(got) != "y" {
		t.Errorf("read d/new: %q, %v", got, err)
	}
}
