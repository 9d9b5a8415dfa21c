package integration

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// randomBytes returns n deterministic pseudo-random bytes.
func randomBytes(seed uint64, n int) []byte {
	rng := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, n)
	for i := 0; i+8 <= n; i += 8 {
		v := rng.Uint64()
		for j := range 8 {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	return b
}

// makeTree writes a small tree of files, a symlink and a hard link under
// dir.
func makeTree(t *testing.T, dir string) {
	t.Helper()
	for i := range 20 {
		writeFile(t, filepath.Join(dir, fmt.Sprintf("sub%d/file%02d.bin", i%3, i)), randomBytes(uint64(i), 1000*i+7))
	}
	if err := os.Symlink("sub0/file00.bin", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(dir, "sub1/file01.bin"), filepath.Join(dir, "hard")); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(dir, "sub2/file02.bin"), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestTar(t *testing.T) {
	mnt, backing := startMount(t, mountOpts{}).dirs()
	src := t.TempDir()
	makeTree(t, src)
	archive := filepath.Join(t.TempDir(), "src.tar")
	run(t, src, "tar", "-cf", archive, ".")

	// Extract onto the mount; the backing directory must get the same tree.
	run(t, mnt, "tar", "-xpf", archive)
	run(t, "", "diff", "-r", "--no-dereference", src, backing)
	// Create an archive of the mount and compare its listing and contents.
	again := filepath.Join(t.TempDir(), "again.tar")
	run(t, mnt, "tar", "-cf", again, ".")
	out := t.TempDir()
	run(t, out, "tar", "-xpf", again)
	run(t, "", "diff", "-r", "--no-dereference", src, out)
}

func TestCpA(t *testing.T) {
	mnt, backing := startMount(t, mountOpts{}).dirs()
	src := t.TempDir()
	makeTree(t, src)
	if err := unix.Setxattr(filepath.Join(src, "sub0/file00.bin"), "user.note", []byte("kept"), 0); err != nil {
		t.Fatal(err)
	}
	run(t, "", "cp", "-a", src+"/.", filepath.Join(mnt, "copy"))
	run(t, "", "diff", "-r", "--no-dereference", src, filepath.Join(backing, "copy"))
	buf := make([]byte, 16)
	n, err := unix.Getxattr(filepath.Join(backing, "copy/sub0/file00.bin"), "user.note", buf)
	if err != nil || string(buf[:n]) != "kept" {
		t.Errorf("xattr copied by cp -a: %q, %v", buf[:n], err)
	}
	// And back out of the mount, preserving modes and times.
	out := filepath.Join(t.TempDir(), "out")
	run(t, "", "cp", "-a", filepath.Join(mnt, "copy"), out)
	run(t, "", "diff", "-r", "--no-dereference", src, out)
	var a, b syscall.Stat_t
	if err := syscall.Lstat(filepath.Join(src, "sub2/file02.bin"), &a); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Lstat(filepath.Join(out, "sub2/file02.bin"), &b); err != nil {
		t.Fatal(err)
	}
	if a.Mode != b.Mode || a.Mtim != b.Mtim {
		t.Errorf("cp -a through the mount: mode %o mtime %v, want %o %v", b.Mode, b.Mtim, a.Mode, a.Mtim)
	}
}

func sha256File(t *testing.T, p string) string {
	t.Helper()
	out := run(t, "", "sha256sum", p)
	return strings.Fields(out)[0]
}

func TestSha256LargeFiles(t *testing.T) {
	mnt, backing := startMount(t, mountOpts{}).dirs()
	for i, size := range []int{64 << 20, 64<<20 + 12345} {
		data := randomBytes(uint64(100+i), size)
		name := fmt.Sprintf("large%d", i)
		// Write through the mount, hash through the mount and directly.
		writeFile(t, filepath.Join(mnt, name), data)
		sum := sha256.Sum256(data)
		want := hex.EncodeToString(sum[:])
		if got := sha256File(t, filepath.Join(mnt, name)); got != want {
			t.Errorf("%s via mount: sha256 %s, want %s", name, got, want)
		}
		if got := sha256File(t, filepath.Join(backing, name)); got != want {
			t.Errorf("%s in backing dir: sha256 %s, want %s", name, got, want)
		}
	}
}

func TestConcurrentReaders(t *testing.T) {
	mnt, backing := startMount(t, mountOpts{}).dirs()
	data := randomBytes(7, 32<<20)
	writeFile(t, filepath.Join(backing, "shard"), data)
	sum := sha256.Sum256(data)
	want := hex.EncodeToString(sum[:])
	const procs = 16
	var wg sync.WaitGroup
	errs := make(chan error, procs)
	for i := range procs {
		wg.Go(func() {
			// Half the readers read sequentially, half from an offset with dd.
			var cmd *exec.Cmd
			if i%2 == 0 {
				cmd = exec.Command("sha256sum", filepath.Join(mnt, "shard"))
			} else {
				cmd = exec.Command("sh", "-c", "dd if="+filepath.Join(mnt, "shard")+" bs=1M status=none | sha256sum")
			}
			out, err := cmd.CombinedOutput()
			if err != nil {
				errs <- fmt.Errorf("reader %d: %v: %s", i, err, out)
				return
			}
			if got := strings.Fields(string(out))[0]; got != want {
				errs <- fmt.Errorf("reader %d: sha256 %s, want %s", i, got, want)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestPythonMmap maps files on the mount with python's mmap: a shared
// writable map reaches the backing file, a private one does not, and a
// read-only map sees the contents (numpy/safetensors memmaps do this).
func TestPythonMmap(t *testing.T) {
	if _, err := os.Stat("/usr/bin/python3"); err != nil {
		t.Skip("needs /usr/bin/python3 (scripts/install-deps.sh installs it)")
	}
	mnt, backing := startMount(t, mountOpts{}).dirs()
	writeFile(t, filepath.Join(backing, "m"), bytes.Repeat([]byte("0123456789abcdef"), 1<<12))
	script := `
import mmap, os, sys
p = sys.argv[1]
with open(p, "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)            # MAP_SHARED, read-write
    assert m[:4] == b"0123", m[:4]
    m[0:5] = b"HELLO"
    m.flush()
    m.close()
    pm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
    pm[16:21] = b"WORLD"                    # copy-on-write: must not reach the file
    pm.close()
with open(p, "rb") as f:
    r = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    print(r[:21].decode())
`
	out := run(t, "", "/usr/bin/python3", "-c", script, filepath.Join(mnt, "m"))
	if got := strings.TrimSpace(out); got != "HELLO56789abcdef01234" {
		t.Errorf("python mmap read %q", got)
	}
	b, err := os.ReadFile(filepath.Join(backing, "m"))
	if err != nil {
		t.Fatal(err)
	}
	if string(b[:21]) != "HELLO56789abcdef01234" {
		t.Errorf("backing file after mmap writes: %q", b[:21])
	}
}

func TestLargeDirectory(t *testing.T) {
	mnt, backing := startMount(t, mountOpts{}).dirs()
	const n = 100_000
	dir := filepath.Join(backing, "big")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		fd, err := syscall.Open(filepath.Join(dir, strconv.Itoa(i)), syscall.O_CREAT|syscall.O_WRONLY|syscall.O_CLOEXEC, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		syscall.Close(fd)
	}
	entries, err := os.ReadDir(filepath.Join(mnt, "big"))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != n {
		t.Fatalf("readdir of %d entries through the mount: got %d", n, len(entries))
	}
	seen := make([]bool, n)
	for _, e := range entries {
		i, err := strconv.Atoi(e.Name())
		if err != nil || i < 0 || i >= n || seen[i] {
			t.Fatalf("unexpected or duplicate entry %q", e.Name())
		}
		seen[i] = true
	}
	out := run(t, "", "sh", "-c", "ls -f "+filepath.Join(mnt, "big")+" | wc -l")
	if got := strings.TrimSpace(out); got != strconv.Itoa(n+2) {
		t.Errorf("ls -f | wc -l = %s, want %d", got, n+2)
	}
}

// TestPosixExtras covers what training jobs do that posixtest does not.
func TestPosixExtras(t *testing.T) {
	mnt, backing := startMount(t, mountOpts{}).dirs()
	m := func(n string) string { return filepath.Join(mnt, n) }
	b := func(n string) string { return filepath.Join(backing, n) }

	t.Run("UnlinkWhileOpen", func(t *testing.T) {
		writeFile(t, m("u"), []byte("still here"))
		f, err := os.OpenFile(m("u"), os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := os.Remove(m("u")); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(b("u")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("backing file after unlink: %v", err)
		}
		if _, err := f.WriteAt([]byte("!"), 10); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 11)
		if _, err := f.ReadAt(buf, 0); err != nil || string(buf) != "still here!" {
			t.Errorf("read of unlinked open file: %q, %v", buf, err)
		}
	})
	t.Run("AtomicRenameOver", func(t *testing.T) {
		// The checkpoint writer pattern: write tmp, fsync, rename over, fsync dir.
		writeFile(t, m("ckpt"), []byte("old"))
		old, err := os.Open(m("ckpt"))
		if err != nil {
			t.Fatal(err)
		}
		defer old.Close()
		f, err := os.Create(m("ckpt.tmp"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Write([]byte("new")); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatalf("fsync: %v", err)
		}
		if err := unix.Fdatasync(int(f.Fd())); err != nil {
			t.Fatalf("fdatasync: %v", err)
		}
		f.Close()
		if err := os.Rename(m("ckpt.tmp"), m("ckpt")); err != nil {
			t.Fatal(err)
		}
		d, err := os.Open(mnt)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Sync(); err != nil {
			t.Errorf("fsync of the directory: %v", err)
		}
		d.Close()
		for _, p := range []string{m("ckpt"), b("ckpt")} {
			if got, err := os.ReadFile(p); string(got) != "new" || err != nil {
				t.Errorf("%s after rename: %q, %v", p, got, err)
			}
		}
		buf := make([]byte, 3)
		if _, err := old.ReadAt(buf, 0); err != nil || string(buf) != "old" {
			t.Errorf("descriptor opened before the rename reads %q, %v; want the old file", buf, err)
		}
	})
	t.Run("Fallocate", func(t *testing.T) {
		f, err := os.Create(m("fa"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := unix.Fallocate(int(f.Fd()), 0, 0, 1<<20); err != nil {
			t.Fatal(err)
		}
		if st, err := os.Stat(b("fa")); err != nil || st.Size() != 1<<20 {
			t.Errorf("backing size after fallocate: %v, %v", st, err)
		}
	})
	t.Run("ODirect", func(t *testing.T) {
		data := randomBytes(9, 1<<20)
		writeFile(t, b("od"), data)
		fd, err := syscall.Open(m("od"), syscall.O_RDONLY|syscall.O_DIRECT, 0)
		if err != nil {
			t.Fatalf("O_DIRECT open: %v", err)
		}
		defer syscall.Close(fd)
		buf, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE) // page-aligned
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(buf)
		n, err := syscall.Pread(fd, buf, 0)
		if err != nil || n != len(data) || !bytes.Equal(buf, data) {
			t.Errorf("O_DIRECT read: %d bytes, %v, equal=%v", n, err, bytes.Equal(buf[:max(n, 0)], data[:max(n, 0)]))
		}
	})
	t.Run("Statfs", func(t *testing.T) {
		var a, c unix.Statfs_t
		if err := unix.Statfs(mnt, &a); err != nil {
			t.Fatal(err)
		}
		if err := unix.Statfs(backing, &c); err != nil {
			t.Fatal(err)
		}
		if a.Blocks != c.Blocks || a.Bsize != c.Bsize || a.Files != c.Files {
			t.Errorf("statfs: mount blocks %d bsize %d files %d; backing %d %d %d", a.Blocks, a.Bsize, a.Files, c.Blocks, c.Bsize, c.Files)
		}
	})
	t.Run("ChownChmodUtimens", func(t *testing.T) {
		writeFile(t, m("own"), []byte("x"))
		if err := os.Chown(m("own"), 1234, 5678); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Chmod(m("own"), 0o4751); err != nil { // os.Chmod would drop the raw setuid bit
			t.Fatal(err)
		}
		mt := time.Date(2020, 1, 2, 3, 4, 5, 6000, time.UTC)
		if err := os.Chtimes(m("own"), mt, mt); err != nil {
			t.Fatal(err)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(b("own"), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 1234 || st.Gid != 5678 || st.Mode&0o7777 != 0o4751 || time.Unix(st.Mtim.Unix()).UTC() != mt {
			t.Errorf("backing after chown/chmod/utimens: uid %d gid %d mode %o mtime %v", st.Uid, st.Gid, st.Mode&0o7777, time.Unix(st.Mtim.Unix()).UTC())
		}
	})
	t.Run("FlockBetweenProcesses", func(t *testing.T) {
		writeFile(t, m("lock"), nil)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		holder := exec.CommandContext(ctx, "flock", m("lock"), "sh", "-c", "echo locked; cat >/dev/null")
		stdin, err := holder.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		stdout, err := holder.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := holder.Start(); err != nil {
			t.Fatal(err)
		}
		line := make([]byte, 7)
		if _, err := stdout.Read(line); err != nil {
			t.Fatal(err)
		}
		if err := exec.Command("flock", "-n", m("lock"), "true").Run(); err == nil {
			t.Error("flock -n succeeded while another process held the lock")
		}
		stdin.Close()
		if err := holder.Wait(); err != nil {
			t.Fatal(err)
		}
		if err := exec.Command("flock", "-n", m("lock"), "true").Run(); err != nil {
			t.Errorf("flock -n after release: %v", err)
		}
	})
	t.Run("Symlink", func(t *testing.T) {
		if err := os.Symlink("target/x", m("sl")); err != nil {
			t.Fatal(err)
		}
		if got, err := os.Readlink(b("sl")); got != "target/x" || err != nil {
			t.Errorf("backing symlink: %q, %v", got, err)
		}
	})
}

func TestReadOnly(t *testing.T) {
	backing := t.TempDir()
	writeFile(t, filepath.Join(backing, "f"), []byte("data"))
	mnt, _ := startMount(t, mountOpts{ReadOnly: true, Backing: backing}).dirs()
	if got, err := os.ReadFile(filepath.Join(mnt, "f")); string(got) != "data" || err != nil {
		t.Errorf("read on a read-only mount: %q, %v", got, err)
	}
	for name, op := range map[string]func() error{
		"create": func() error { return os.WriteFile(filepath.Join(mnt, "new"), nil, 0o644) },
		"write":  func() error { _, err := os.OpenFile(filepath.Join(mnt, "f"), os.O_WRONLY, 0); return err },
		"unlink": func() error { return os.Remove(filepath.Join(mnt, "f")) },
		"mkdir":  func() error { return os.Mkdir(filepath.Join(mnt, "d"), 0o755) },
	} {
		if err := op(); !errors.Is(err, syscall.EROFS) {
			t.Errorf("%s on a read-only mount: %v, want EROFS", name, err)
		}
	}
}

// TestPermissions checks, as an unprivileged user on an --allow-other
// mount, that every access gets the same answer as on the backing
// directory: the root daemon never widens access.
func TestPermissions(t *testing.T) {
	backing := t.TempDir()
	if err := os.Chmod(backing, 0o755); err != nil {
		t.Fatal(err)
	}
	// t.TempDir's parent is mode 0700; the unprivileged user must reach it.
	if err := os.Chmod(filepath.Dir(backing), 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(backing, "public"), []byte("p"))
	writeFile(t, filepath.Join(backing, "secret"), []byte("s"))
	if err := os.Chmod(filepath.Join(backing, "secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(backing, "private"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(backing, "shared"), 0o777); err != nil {
		t.Fatal(err)
	}
	mnt, _ := startMount(t, mountOpts{AllowOther: true, Backing: backing}).dirs()
	if err := os.Chmod(filepath.Dir(mnt), 0o755); err != nil {
		t.Fatal(err)
	}
	const nobody = 65534
	cases := []struct {
		name, script string
	}{
		{"read public", "cat %s/public"},
		{"read secret", "cat %s/secret"},
		{"write public", "echo x >> %s/public"},
		{"list private", "ls %s/private"},
		{"create in root dir", "touch %s/new-by-nobody"},
		{"create in shared dir", "touch %s/shared/mine && rm %s/shared/mine"},
		{"chmod secret", "chmod 0666 %s/secret"},
		{"chown public", "chown 65534 %s/public"},
		{"set xattr", "setfattr -n user.x -v y %s/public"},
	}
	asNobody := func(script, dir string) error {
		cmd := exec.Command("sh", "-c", strings.ReplaceAll(script, "%s", dir))
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
		return cmd.Run()
	}
	for _, c := range cases {
		direct := asNobody(c.script, backing)
		via := asNobody(c.script, mnt)
		if (direct == nil) != (via == nil) {
			t.Errorf("%s as uid %d: backing dir: %v; gdsfs: %v", c.name, nobody, direct, via)
		}
	}
	// A write by another user clears the setuid bit, on the mount as on
	// the backing filesystem.
	for _, p := range []string{"suid-direct", "suid-mount"} {
		writeFile(t, filepath.Join(backing, p), []byte("x"))
		if err := syscall.Chmod(filepath.Join(backing, p), 0o4777); err != nil {
			t.Fatal(err)
		}
	}
	if err := asNobody("echo y >> %s/suid-direct", backing); err != nil {
		t.Fatal(err)
	}
	if err := asNobody("echo y >> %s/suid-mount", mnt); err != nil {
		t.Fatal(err)
	}
	var sd, sm syscall.Stat_t
	if err := syscall.Stat(filepath.Join(backing, "suid-direct"), &sd); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat(filepath.Join(backing, "suid-mount"), &sm); err != nil {
		t.Fatal(err)
	}
	if sd.Mode != sm.Mode {
		t.Errorf("setuid file written by uid %d: mode %o through gdsfs, %o directly", nobody, sm.Mode&0o7777, sd.Mode&0o7777)
	}
	// The case table must contain both outcomes, or it proves nothing.
	if asNobody("cat %s/public", mnt) != nil || asNobody("cat %s/secret", mnt) == nil {
		t.Error("unprivileged user: reading public should work and secret should fail")
	}
}

// TestCopyFileRange: copy_file_range between two files on the mount is
// done by the backing filesystem and gives the same bytes.
func TestCopyFileRange(t *testing.T) {
	mnt, backing := startMount(t, mountOpts{}).dirs()
	data := randomBytes(11, 3<<20+5)
	writeFile(t, filepath.Join(backing, "src"), data)
	in, err := os.Open(filepath.Join(mnt, "src"))
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.Create(filepath.Join(mnt, "dst"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	offIn, offOut := int64(5), int64(0)
	for offIn < int64(len(data)) {
		n, err := unix.CopyFileRange(int(in.Fd()), &offIn, int(out.Fd()), &offOut, len(data), 0)
		if err != nil {
			t.Fatalf("copy_file_range: %v", err)
		}
		if n == 0 {
			break
		}
	}
	got, err := os.ReadFile(filepath.Join(backing, "dst"))
	if err != nil || !bytes.Equal(got, data[5:]) {
		t.Errorf("copied %d bytes (%v), want %d equal bytes", len(got), err, len(data)-5)
	}
}
