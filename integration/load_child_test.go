package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/internal/xattr"
)

// loadResult is what one client process reports, as one JSON line after
// resultPrefix on stdout.
type loadResult struct {
	ID         int            `json:"id"`
	Ops        map[string]int `json:"ops"`
	Bytes      int64          `json:"bytes_verified"`
	Eagain     int            `json:"eagain_retries"`
	ErrorCount int            `json:"error_count"`
	Errors     []string       `json:"errors"` // the first few
	// Fault mode: the errno that ended the run and when (Unix ns).
	LastErrno string `json:"last_errno,omitempty"`
	FailedAt  int64  `json:"failed_at_ns,omitempty"`
}

const resultPrefix = "LOADRESULT "

// TestLoadChild is not a test: the load and fault tests re-exec the test
// binary with GDSFS_LOAD_CHILD set to run one client process. It does
// nothing otherwise.
func TestLoadChild(t *testing.T) {
	mode, env := childMode(t, "LOAD")
	id, _ := strconv.Atoi(env("ID"))
	untilNs, _ := strconv.ParseInt(env("UNTIL"), 10, 64)
	c := &loadClient{
		mnt:   env("MNT"),
		id:    id,
		until: time.Unix(0, untilNs),
		rng:   mrand.New(mrand.NewPCG(uint64(id), uint64(untilNs))),
		res:   loadResult{ID: id, Ops: map[string]int{}},
	}
	var err error
	switch mode {
	case "mixed":
		err = c.mixed(false)
	case "untilfail":
		err = c.mixed(true)
	case "bigread":
		err = c.bigReads()
	default:
		err = fmt.Errorf("unknown load child mode %q", mode)
	}
	b, _ := json.Marshal(c.res)
	fmt.Printf("%s%s\n", resultPrefix, b)
	if err != nil {
		fmt.Fprintln(os.Stderr, "load child:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// loadClient is one client process's state.
type loadClient struct {
	mnt   string
	id    int
	until time.Time
	rng   *mrand.Rand
	cl    *ctl.Client
	dir   string // this client's directory for creates and writes
	seq   uint64
	res   loadResult
}

// mixed runs random operations until the deadline. With untilFail it
// stops at the first error and records its errno and time (fault tests);
// otherwise errors are counted and the run goes on.
func (c *loadClient) mixed(untilFail bool) error {
	ctx := context.Background()
	c.dir = filepath.Join(c.mnt, "work", fmt.Sprintf("client-%03d", c.id))
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return fmt.Errorf("mkdir %s: %w", c.dir, err)
	}
	cl, err := ctl.OpenSession(c.mnt)
	if err != nil {
		return fmt.Errorf("open session: %w", err)
	}
	c.cl = cl
	defer cl.Close()
	ops := []struct {
		name   string
		weight int
		run    func(context.Context) error
	}{
		{"mount-read", 30, c.mountRead},
		{"control-read", 25, c.controlRead},
		{"xattr-index", 15, c.xattrIndex},
		{"create-rename-unlink", 15, c.createRenameUnlink},
		{"control-write", 15, c.controlWrite},
	}
	total := 0
	for _, o := range ops {
		total += o.weight
	}
	for time.Now().Before(c.until) {
		n := c.rng.IntN(total)
		i := 0
		for ; n >= ops[i].weight; i++ {
			n -= ops[i].weight
		}
		err := ops[i].run(ctx)
		c.res.Ops[ops[i].name]++
		if err == nil {
			continue
		}
		c.res.ErrorCount++
		if len(c.res.Errors) < 5 {
			c.res.Errors = append(c.res.Errors, fmt.Sprintf("%s: %v", ops[i].name, err))
		}
		if untilFail {
			var errno syscall.Errno
			c.res.FailedAt = time.Now().UnixNano()
			c.res.LastErrno = "none"
			if errors.As(err, &errno) {
				c.res.LastErrno = unix.ErrnoName(errno)
			}
			return nil
		}
	}
	return nil
}

// retry runs a control-path call again while the pool is full (EAGAIN is
// back-pressure, not failure: the protocol says release and retry).
func (c *loadClient) retry(f func() error) error {
	for i := 0; ; i++ {
		err := f()
		if !errors.Is(err, syscall.EAGAIN) || i == 1000 {
			return err
		}
		c.res.Eagain++
		time.Sleep(time.Millisecond) // back-off while other clients release
	}
}

func (c *loadClient) verify(what string, got, want []byte) error {
	if !bytes.Equal(got, want) {
		return fmt.Errorf("%s: %d bytes differ from the file's (first byte got %#x)", what, len(want), firstByte(got))
	}
	c.res.Bytes += int64(len(want))
	return nil
}

func firstByte(b []byte) int {
	if len(b) == 0 {
		return -1
	}
	return int(b[0])
}

// mountRead preads a random range of a data file through the mount.
func (c *loadClient) mountRead(context.Context) error {
	i := c.rng.IntN(loadDataFiles)
	size := loadDataSize(i)
	f, err := os.Open(filepath.Join(c.mnt, loadDataName(i)))
	if err != nil {
		return err
	}
	defer f.Close()
	off := c.rng.Int64N(size)
	n := min(1+c.rng.Int64N(256<<10), size-off)
	buf := make([]byte, n)
	if _, err := f.ReadAt(buf, off); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	return c.verify(fmt.Sprintf("pread %s [%d,+%d)", loadDataName(i), off, n), buf, genBytes(loadDataSeed(i), off, int(n)))
}

// controlRead reads 1-4 random ranges into slabs and checks them.
func (c *loadClient) controlRead(ctx context.Context) error {
	i := c.rng.IntN(loadDataFiles)
	size := loadDataSize(i)
	f, err := os.Open(filepath.Join(c.mnt, loadDataName(i)))
	if err != nil {
		return err
	}
	defer f.Close()
	ranges := make([]ctl.Range, 1+c.rng.IntN(4))
	for k := range ranges {
		ranges[k] = ctl.Range{Offset: uint64(c.rng.Int64N(size)), Length: uint64(1 + c.rng.Int64N(1<<20))}
	}
	var ls []ctl.Lease
	if err := c.retry(func() error {
		var err error
		ls, err = c.cl.Read(ctx, f, ctl.HostDevice, ranges)
		return err
	}); err != nil {
		return err
	}
	defer c.release(ctx, ls)
	for k, r := range ranges {
		want := min(r.Length, uint64(size)-r.Offset)
		if ls[k].Valid != want {
			return fmt.Errorf("READ %s %+v: valid %d, want %d", loadDataName(i), r, ls[k].Valid, want)
		}
		got, err := c.cl.Bytes(ctx, ls[k])
		if err != nil {
			return err
		}
		if err := c.verify(fmt.Sprintf("READ %s %+v", loadDataName(i), r), got, genBytes(loadDataSeed(i), int64(r.Offset), int(want))); err != nil {
			return err
		}
	}
	return nil
}

func (c *loadClient) release(ctx context.Context, ls []ctl.Lease) error {
	var ids []uint64
	for _, l := range ls {
		if l.ID != 0 {
			ids = append(ids, l.ID)
		}
	}
	if len(ids) == 0 {
		return nil
	}
	return c.cl.Release(ctx, ids...)
}

// xattrIndex reads user.gdsfs.info of a data file and user.gdsfs.index of
// a shard, then reads 1-3 members by name and checks them.
func (c *loadClient) xattrIndex(ctx context.Context) error {
	i := c.rng.IntN(loadDataFiles)
	var info struct {
		Size int64 `json:"size"`
	}
	if err := getxattrJSON(filepath.Join(c.mnt, loadDataName(i)), "user.gdsfs.info", &info); err != nil {
		return err
	}
	if info.Size != loadDataSize(i) {
		return fmt.Errorf("user.gdsfs.info of %s: size %d, want %d", loadDataName(i), info.Size, loadDataSize(i))
	}
	s := c.rng.IntN(loadShards)
	p := filepath.Join(c.mnt, loadShardName(s))
	var idx struct {
		Format string `json:"format"`
	}
	if err := getxattrJSON(p, "user.gdsfs.index", &idx); err != nil {
		return err
	}
	if idx.Format != "tar" {
		return fmt.Errorf("user.gdsfs.index of %s: format %q, want tar", loadShardName(s), idx.Format)
	}
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	js := make([]int, 1+c.rng.IntN(3))
	names := make([]string, len(js))
	for k := range js {
		js[k] = c.rng.IntN(loadShardMember)
		names[k], _, _ = loadMember(s, js[k])
	}
	var ls []ctl.Lease
	if err := c.retry(func() error {
		var err error
		ls, err = c.cl.ReadNames(ctx, f, ctl.HostDevice, names)
		return err
	}); err != nil {
		return err
	}
	defer c.release(ctx, ls)
	for k, j := range js {
		name, seed, size := loadMember(s, j)
		got, err := c.cl.Bytes(ctx, ls[k])
		if err != nil {
			return err
		}
		if err := c.verify(fmt.Sprintf("READ_NAMES %s %s", loadShardName(s), name), got, genBytes(seed, 0, size)); err != nil {
			return err
		}
	}
	return nil
}

func getxattrJSON(p, name string, v any) error {
	b, err := xattr.Get(p, name)
	if err != nil {
		return fmt.Errorf("getxattr %s %s: %w", p, name, err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("getxattr %s %s: %w", p, name, err)
	}
	return nil
}

// createRenameUnlink writes a file through the mount (fsync'd), renames
// it, reads it back, lists the directory and removes it.
func (c *loadClient) createRenameUnlink(context.Context) error {
	c.seq++
	seed := uint64(c.id)<<32 | c.seq
	n := 1 + c.rng.IntN(64<<10)
	data := genBytes(seed, 0, n)
	tmp := filepath.Join(c.dir, fmt.Sprintf("tmp-%d", c.seq))
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	final := filepath.Join(c.dir, fmt.Sprintf("file-%d", c.seq))
	if err := os.Rename(tmp, final); err != nil {
		return err
	}
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(ents, func(e os.DirEntry) bool { return e.Name() == filepath.Base(final) }) {
		return fmt.Errorf("readdir %s: %s missing after rename", c.dir, filepath.Base(final))
	}
	got, err := os.ReadFile(final)
	if err != nil {
		return err
	}
	if err := c.verify("read back "+final, got, data); err != nil {
		return err
	}
	return os.Remove(final)
}

// controlWrite fills a lease, WRITEs it (with SYNC) to a new file, reads
// the file back through the mount and removes it.
func (c *loadClient) controlWrite(ctx context.Context) error {
	c.seq++
	seed := uint64(c.id)<<32 | c.seq | 1<<63
	n := 1 + c.rng.IntN(256<<10)
	data := genBytes(seed, 0, n)
	var l ctl.Lease
	if err := c.retry(func() error {
		var err error
		l, err = c.cl.Alloc(ctx, ctl.HostDevice, int64(n))
		return err
	}); err != nil {
		return err
	}
	defer c.release(ctx, []ctl.Lease{l})
	b, err := c.cl.Bytes(ctx, l)
	if err != nil {
		return err
	}
	copy(b, data)
	p := filepath.Join(c.dir, fmt.Sprintf("ckpt-%d", c.seq))
	f, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	defer os.Remove(p)
	defer f.Close()
	if err := c.cl.Write(ctx, f, l, 0, 0, int64(n), true); err != nil {
		return err
	}
	got := make([]byte, n)
	if _, err := f.ReadAt(got, 0); err != nil {
		return fmt.Errorf("read back %s: %w", p, err)
	}
	return c.verify("WRITE then read "+p, got, data)
}

// bigReads issues whole-file control-path reads back to back until the
// deadline (or until the test kills the process in the middle of one).
func (c *loadClient) bigReads() error {
	ctx := context.Background()
	cl, err := ctl.OpenSession(c.mnt)
	if err != nil {
		return fmt.Errorf("open session: %w", err)
	}
	c.cl = cl
	defer cl.Close()
	for time.Now().Before(c.until) {
		i := c.rng.IntN(loadDataFiles)
		f, err := os.Open(filepath.Join(c.mnt, loadDataName(i)))
		if err != nil {
			return err
		}
		size := uint64(loadDataSize(i))
		ranges := []ctl.Range{{Offset: 0, Length: size}, {Offset: size / 3, Length: size}, {Offset: size / 2, Length: size}, {Offset: 1, Length: size}}
		ls, err := c.cl.Read(ctx, f, ctl.HostDevice, ranges)
		f.Close()
		c.res.Ops["big-read"]++
		if errors.Is(err, syscall.EAGAIN) {
			c.res.Eagain++
			continue
		}
		if err != nil {
			return err
		}
		if err := c.release(ctx, ls); err != nil {
			return err
		}
	}
	return nil
}
