package fs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// fakeControl records what the FUSE layer asks of the control path.
type fakeControl struct {
	mu sync.Mutex
	// refuseSessions, if set, is what OpenSession fails with.
	refuseSessions syscall.Errno
	changed        []string
	sessions       []*fakeSession
	ioctls         []fileIoctl
	closed         chan *fakeSession
}

type fileIoctl struct {
	caller  Caller
	path    string
	cmd     uint32
	in      []byte
	content []byte // what f read from offset 0
}

type fakeSession struct {
	caller Caller
	cmds   []uint32
}

func newFakeControl() *fakeControl {
	return &fakeControl{closed: make(chan *fakeSession, 16)}
}

func (c *fakeControl) OpenSession(ctx context.Context, caller Caller) (Session, syscall.Errno) {
	c.mu.Lock()
	refuse := c.refuseSessions
	c.mu.Unlock()
	if refuse != 0 {
		return nil, refuse
	}
	s := &fakeSession{caller: caller}
	c.mu.Lock()
	c.sessions = append(c.sessions, s)
	c.mu.Unlock()
	return &fakeSessionHandle{c: c, s: s}, 0
}

func (c *fakeControl) FileIoctl(ctx context.Context, caller Caller, f *os.File, path string, cmd uint32, in, out []byte) (int32, syscall.Errno) {
	if f == nil {
		return 0, syscall.ENOTTY // not a control-path command
	}
	buf := make([]byte, 64)
	n, err := f.ReadAt(buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return 0, syscall.EIO
	}
	c.mu.Lock()
	c.ioctls = append(c.ioctls, fileIoctl{caller: caller, path: path, cmd: cmd, in: slices.Clone(in), content: buf[:n]})
	c.mu.Unlock()
	copy(out, "reply")
	return 42, 0
}

func (c *fakeControl) Xattr(ctx context.Context, caller Caller, t XattrTarget, name string) ([]byte, syscall.Errno) {
	if name == "user.gdsfs.test" {
		v := "path=" + t.Path
		if t.IsRoot {
			v += " root"
		}
		return []byte(v), 0
	}
	return nil, syscall.ENODATA
}

func (c *fakeControl) Changed(path string) {
	c.mu.Lock()
	c.changed = append(c.changed, path)
	c.mu.Unlock()
}

func (c *fakeControl) changes() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.changed)
}

type fakeSessionHandle struct {
	c *fakeControl
	s *fakeSession
}

func (h *fakeSessionHandle) Ioctl(ctx context.Context, caller Caller, cmd uint32, in, out []byte) (int32, syscall.Errno) {
	h.c.mu.Lock()
	h.s.cmds = append(h.s.cmds, cmd)
	h.c.mu.Unlock()
	copy(out, in)
	return 7, 0
}

func (h *fakeSessionHandle) Close() error {
	h.c.closed <- h.s
	return nil
}

// testMount mounts a fresh backing directory with ctl (may be nil) and
// unmounts it when the test ends.
func testMount(t *testing.T, ctl Control) (mnt, backing string, srv *Server) {
	t.Helper()
	return testMountWith(t, Options{Control: ctl})
}

// testMountWith is testMount with more options (Source, Mountpoint and
// Logger are set here).
func testMountWith(t *testing.T, o Options) (mnt, backing string, srv *Server) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting FUSE in tests needs root (CI runs as root)")
	}
	dir := t.TempDir()
	backing, mnt = filepath.Join(dir, "backing"), filepath.Join(dir, "mnt")
	for _, d := range []string{backing, mnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	log := zerolog.Nop()
	if testing.Verbose() {
		log = zerolog.New(zerolog.NewTestWriter(t))
	}
	o.Source, o.Mountpoint, o.Logger = backing, mnt, log
	srv, err := Mount(context.Background(), o)
	if err != nil {
		t.Fatalf("Mount: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.Unmount(); err != nil {
			t.Errorf("unmount: %v", err)
			srv.UnmountLazy()
		}
		srv.Wait()
	})
	return mnt, backing, srv
}

// iowr is _IOWR('G', nr, size), the shape control-path ioctls have (ctl's
// type letter: the mount hands only those a descriptor).
func iowr(nr, size uintptr) uint32 {
	return uint32(3<<30 | size<<16 | 'G'<<8 | nr)
}

func ioctl(fd uintptr, cmd uint32, buf []byte) (int, error) {
	r, _, errno := syscall.Syscall(syscall.SYS_IOCTL, fd, uintptr(cmd), uintptr(unsafe.Pointer(&buf[0])))
	if errno != 0 {
		return int(r), errno
	}
	return int(r), nil
}

func TestControlFile(t *testing.T) {
	ctl := newFakeControl()
	mnt, backing, _ := testMount(t, ctl)
	p := filepath.Join(mnt, controlName)
	// A backing file of the same name is shadowed and not listed.
	shadowed := filepath.Join(backing, controlName+"-shadowed")
	if err := os.WriteFile(shadowed, []byte("backing"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(shadowed, filepath.Join(backing, controlName)); err != nil {
		t.Fatal(err)
	}

	st, err := os.Stat(p)
	if err != nil {
		t.Fatalf("stat control file: %v", err)
	}
	sys := st.Sys().(*syscall.Stat_t)
	if st.Mode() != 0o666 || st.Size() != 0 || sys.Uid != 0 {
		t.Errorf("control file: mode %v size %d uid %d, want -rw-rw-rw- 0 0", st.Mode(), st.Size(), sys.Uid)
	}
	if got, err := os.ReadFile(filepath.Join(backing, controlName)); string(got) != "backing" || err != nil {
		t.Errorf("backing %s changed: %q, %v", controlName, got, err)
	}
	names, err := os.ReadDir(mnt)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range names {
		if e.Name() == controlName {
			t.Errorf("readdir lists %s", controlName)
		}
	}

	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatalf("open control file: %v", err)
	}
	buf := []byte("12345678")
	cmd := iowr(1, uintptr(len(buf)))
	if r, err := ioctl(f.Fd(), cmd, buf); err != nil || r != 7 {
		t.Errorf("session ioctl = %d, %v; want 7, nil", r, err)
	}
	if n, err := f.Read(make([]byte, 10)); n != 0 || (err != nil && !errors.Is(err, io.EOF)) {
		t.Errorf("read control file = %d, %v; want 0 bytes", n, err)
	}
	if _, err := f.Write([]byte("x")); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("write control file: %v, want EINVAL", err)
	}
	ctl.mu.Lock()
	if len(ctl.sessions) != 1 {
		t.Fatalf("%d sessions, want 1", len(ctl.sessions))
	}
	s := ctl.sessions[0]
	if s.caller.UID != 0 || s.caller.PID == 0 || !slices.Equal(s.cmds, []uint32{cmd}) {
		t.Errorf("session: caller %+v cmds %x; want uid 0, a pid, cmds [%x]", s.caller, s.cmds, cmd)
	}
	ctl.mu.Unlock()
	f.Close()
	select {
	case got := <-ctl.closed:
		if got != s {
			t.Errorf("closed another session")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("session not closed 10s after the last close of the control file")
	}

	for name, op := range map[string]func() error{
		"unlink":   func() error { return os.Remove(p) },
		"rename":   func() error { return os.Rename(p, filepath.Join(mnt, "x")) },
		"mkdir":    func() error { return os.Mkdir(p, 0o755) },
		"create":   func() error { _, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL, 0o644); return err },
		"truncate": func() error { return os.Truncate(p, 10) },
		"setxattr": func() error { return unix.Setxattr(p, "user.x", []byte("v"), 0) },
	} {
		if err := op(); err == nil {
			t.Errorf("%s of the control file succeeded", name)
		}
	}
}

func TestFileIoctl(t *testing.T) {
	ctl := newFakeControl()
	mnt, backing, _ := testMount(t, ctl)
	if err := os.WriteFile(filepath.Join(backing, "shard.tar"), []byte("contents"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(mnt, "shard.tar"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 16)
	copy(buf, "request")
	cmd := iowr(2, 16)
	r, err := ioctl(f.Fd(), cmd, buf)
	if err != nil || r != 42 {
		t.Fatalf("file ioctl = %d, %v; want 42, nil", r, err)
	}
	if !bytes.HasPrefix(buf, []byte("reply")) {
		t.Errorf("ioctl output %q, want the Control's reply", buf)
	}
	ctl.mu.Lock()
	defer ctl.mu.Unlock()
	if len(ctl.ioctls) != 1 {
		t.Fatalf("%d FileIoctl calls, want 1", len(ctl.ioctls))
	}
	got := ctl.ioctls[0]
	if got.path != filepath.Join(backing, "shard.tar") || got.cmd != cmd ||
		!bytes.HasPrefix(got.in, []byte("request")) || string(got.content) != "contents" || got.caller.PID == 0 {
		t.Errorf("FileIoctl got %+v", got)
	}
}

func TestNoControl(t *testing.T) {
	mnt, backing, _ := testMount(t, nil)
	if _, err := os.Stat(filepath.Join(mnt, controlName)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stat %s without a control path: %v, want ENOENT", controlName, err)
	}
	if err := os.WriteFile(filepath.Join(backing, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{filepath.Join(mnt, "f"), mnt} {
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		// FS_IOC_GETFLAGS works on the backing ext4/tmpfs file; through the
		// mount it must not reach it.
		var flags [8]byte
		if _, err := ioctl(f.Fd(), unix.FS_IOC_GETFLAGS, flags[:]); !errors.Is(err, syscall.ENOTTY) {
			t.Errorf("FS_IOC_GETFLAGS on %s: %v, want ENOTTY", p, err)
		}
		if _, err := ioctl(f.Fd(), iowr(2, 16), make([]byte, 16)); !errors.Is(err, syscall.ENOTTY) {
			t.Errorf("control ioctl on %s without a control path: %v, want ENOTTY", p, err)
		}
		f.Close()
	}
}

func TestXattr(t *testing.T) {
	ctl := newFakeControl()
	mnt, backing, _ := testMount(t, ctl)
	bf := filepath.Join(backing, "f")
	if err := os.WriteFile(bf, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(bf, "user.gdsfs.real", []byte("stored"), 0); err != nil {
		t.Skipf("backing filesystem has no user xattrs: %v", err)
	}
	mf := filepath.Join(mnt, "f")
	get := func(p, name string) (string, error) {
		buf := make([]byte, 256)
		n, err := unix.Getxattr(p, name, buf)
		if err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	}
	tests := []struct {
		path, name, want string
		err              error
	}{
		{mf, "user.gdsfs.test", "path=" + bf, nil},
		{mnt, "user.gdsfs.test", "path=" + backing + " root", nil},
		{mf, "user.gdsfs.real", "stored", nil}, // Control says ENODATA: backing value
		{mf, "user.gdsfs.none", "", syscall.ENODATA},
	}
	for _, tc := range tests {
		got, err := get(tc.path, tc.name)
		if got != tc.want || !errors.Is(err, tc.err) && !(err == nil && tc.err == nil) {
			t.Errorf("getxattr(%s, %s) = %q, %v; want %q, %v", tc.path, tc.name, got, err, tc.want, tc.err)
		}
	}
	// A size query (empty buffer) reports the virtual value's length.
	if n, err := unix.Getxattr(mf, "user.gdsfs.test", nil); err != nil || n != len("path="+bf) {
		t.Errorf("getxattr size = %d, %v", n, err)
	}
	if err := unix.Setxattr(mf, "user.gdsfs.x", []byte("v"), 0); !errors.Is(err, syscall.EPERM) {
		t.Errorf("setxattr user.gdsfs.x: %v, want EPERM", err)
	}
	if err := unix.Removexattr(mf, "user.gdsfs.real"); !errors.Is(err, syscall.EPERM) {
		t.Errorf("removexattr user.gdsfs.real: %v, want EPERM", err)
	}
	if err := unix.Setxattr(mf, "user.plain", []byte("v"), 0); err != nil {
		t.Errorf("setxattr user.plain: %v", err)
	}
	if v, err := get(bf, "user.plain"); v != "v" || err != nil {
		t.Errorf("user.plain on the backing file = %q, %v", v, err)
	}
	buf := make([]byte, 1024)
	n, err := unix.Listxattr(mf, buf)
	if err != nil {
		t.Fatal(err)
	}
	names := strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00")
	slices.Sort(names)
	if want := []string{"user.gdsfs.real", "user.plain"}; !slices.Equal(names, want) {
		t.Errorf("listxattr = %q, want %q (only the backing file's attributes)", names, want)
	}
}

func TestChanged(t *testing.T) {
	ctl := newFakeControl()
	mnt, backing, _ := testMount(t, ctl)
	b := func(n string) string { return filepath.Join(backing, n) }
	m := func(n string) string { return filepath.Join(mnt, n) }
	if err := os.WriteFile(b("r"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		op   func() error
		want []string
	}{
		{"read open", func() error { _, err := os.ReadFile(m("r")); return err }, nil},
		{"write", func() error { return os.WriteFile(m("w"), []byte("data"), 0o644) }, []string{b("w")}},
		{"truncate", func() error { return os.Truncate(m("w"), 1) }, []string{b("w")}},
		{"rename", func() error { return os.Rename(m("w"), m("w2")) }, []string{b("w"), b("w2")}},
		{"link", func() error { return os.Link(m("w2"), m("w3")) }, []string{b("w3"), b("w2")}},
		{"unlink", func() error { return os.Remove(m("w3")) }, []string{b("w3")}},
	}
	for _, tc := range tests {
		before := len(ctl.changes())
		if err := tc.op(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		// Release of a write open is asynchronous; wait for settle by
		// reading the set of distinct paths rather than the count.
		got := ctl.changes()[before:]
		for _, w := range tc.want {
			if !slices.Contains(got, w) {
				t.Errorf("%s: Changed calls %q, missing %q", tc.name, got, w)
			}
		}
		if tc.want == nil && len(got) != 0 {
			t.Errorf("%s: Changed calls %q, want none", tc.name, got)
		}
	}
}

func TestPassthroughReported(t *testing.T) {
	mnt, backing, srv := testMount(t, nil)
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	release := unix.ByteSliceToString(u.Release[:])
	var major, minor int
	if _, err := fmt.Sscanf(release, "%d.%d", &major, &minor); err != nil {
		t.Fatalf("kernel release %q: %v", release, err)
	}
	want := major > 6 || major == 6 && minor >= 9
	on, why := srv.Passthrough()
	if on != want {
		t.Errorf("Passthrough() = %v (%s) on Linux %s as root; want %v", on, why, release, want)
	}
	if why == "" {
		t.Error("Passthrough gives no reason")
	}
	if err := os.WriteFile(filepath.Join(backing, "f"), []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.ReadFile(filepath.Join(mnt, "f")); err != nil {
		t.Fatal(err)
	}
	st := srv.Stats()
	if want && (st.Passthrough == 0 || st.Refused != 0) {
		t.Errorf("after one open with passthrough on: stats %+v", st)
	}
}

// TestPassthroughRefusedPerFile: a backing file the kernel refuses for
// passthrough (here: one on another FUSE mount, stacked too deep) is served
// by the daemon and reported, and passthrough stays on for other files
// (go-fuse alone would turn it off for the whole mount).
func TestPassthroughRefusedPerFile(t *testing.T) {
	mnt, backing, srv := testMount(t, nil)
	if on, why := srv.Passthrough(); !on {
		t.Skipf("no passthrough on this machine: %s", why)
	}
	// The inner mount sits inside the outer mount's backing directory.
	innerSrc := t.TempDir()
	innerMnt := filepath.Join(backing, "inner")
	if err := os.Mkdir(innerMnt, 0o755); err != nil {
		t.Fatal(err)
	}
	inner, err := Mount(context.Background(), Options{Source: innerSrc, Mountpoint: innerMnt, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := inner.Unmount(); err != nil {
			inner.UnmountLazy()
		}
		inner.Wait()
	})
	// Cleanups run last-in first-out: the inner mount goes before the
	// outer one, which is what unmounting needs.
	if err := os.WriteFile(filepath.Join(innerSrc, "deep"), []byte("deep"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"a", "b"} {
		if err := os.WriteFile(filepath.Join(backing, n), []byte(n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	read := func(rel, want string) {
		t.Helper()
		got, err := os.ReadFile(filepath.Join(mnt, rel))
		if err != nil || string(got) != want {
			t.Fatalf("read %s: %q, %v; want %q", rel, got, err, want)
		}
	}
	read("a", "a")
	before := srv.Stats()
	read("inner/deep", "deep")
	mid := srv.Stats()
	if mid.Refused != before.Refused+1 || mid.Daemon != before.Daemon+1 {
		t.Errorf("open of a file on a nested FUSE mount: stats %+v -> %+v, want one refusal served by the daemon", before, mid)
	}
	read("b", "b")
	after := srv.Stats()
	if after.Passthrough != mid.Passthrough+1 {
		t.Errorf("open after a refusal: stats %+v -> %+v, want passthrough still used", mid, after)
	}
	on, why := srv.Passthrough()
	if !on || !strings.Contains(why, "refused for 1") || !strings.Contains(why, "inner/deep") {
		t.Errorf("Passthrough() = %v, %q; want on, naming the refused file", on, why)
	}
}
