package cache

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.ReaderAt
	n atomic.Int64
}

func (c *countingReader) ReadAt(b []byte, off int64) (int, error) {
	n, err := c.r.ReadAt(b, off)
	c.n.Add(int64(n))
	return n, err
}

// sparseSafetensors writes a safetensors file of size bytes (sparse) whose
// 8-byte header length is hdrLen, followed by '{'.
func sparseSafetensors(t *testing.T, p string, hdrLen uint64, size int64) {
	t.Helper()
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var b [9]byte
	binary.LittleEndian.PutUint64(b[:], hdrLen)
	b[8] = '{'
	if _, err := f.Write(b[:]); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
}

// TestSafetensorsHeaderLimit: a header beyond SafetensorsMaxHeader (but
// within the format's 100 MB) is refused from its 8-byte length, without
// reading it, with a reason naming the limit.
func TestSafetensorsHeaderLimit(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name   string
		hdrLen uint64
		want   string
	}{
		{"crafted 97 MB", 97_000_000, "exceeds gdsfs's index limit of 16 MiB"},
		{"just over", SafetensorsMaxHeader + 1, "exceeds gdsfs's index limit of 16 MiB"},
		{"over the format", 100_000_001, "exceeds the format's limit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_")+".safetensors")
			sparseSafetensors(t, p, tc.hdrLen, int64(tc.hdrLen)+8)
			f, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			r := &countingReader{r: f}
			_, err = Parse(r, int64(tc.hdrLen)+8, p)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Parse = %v, want ErrInvalid saying %q", err, tc.want)
			}
			if n := r.n.Load(); n > 1024 {
				t.Errorf("read %d bytes to refuse the header, want <= 1024 (its length alone decides)", n)
			}
		})
	}
}

// TestIndexesNegativeCached: a refused file is parsed once; later asks of
// the same identity hit the cached refusal, and a change parses again.
func TestIndexesNegativeCached(t *testing.T) {
	x := newTestIndexes(t)
	p := filepath.Join(t.TempDir(), "crafted.safetensors")
	sparseSafetensors(t, p, 97_000_000, 97_000_008)
	ctx := context.Background()
	for range 4 {
		if _, err := getPath(ctx, x, p); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Get = %v, want ErrInvalid", err)
		}
	}
	if st := x.Stats(); st.Parses != 1 || st.Hits != 3 {
		t.Fatalf("4 asks of a refused file: %+v, want 1 parse and 3 hits", st)
	}
	sparseSafetensors(t, p, 96_000_000, 96_000_008)
	if _, err := getPath(ctx, x, p); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Get = %v, want ErrInvalid", err)
	}
	if p := x.Stats().Parses; p != 2 {
		t.Errorf("parses = %d after the file changed, want 2", p)
	}
}

// TestIndexesParseSlots: at most DefaultParses files parse at once; a miss
// that finds no slot within the wait fails with ErrBusy (not cached), and
// succeeds once slots free up.
func TestIndexesParseSlots(t *testing.T) {
	x := newTestIndexes(t)
	x.parseWait = 20 * time.Millisecond
	started := make(chan string, 8)
	release := make(chan struct{})
	var inFlight, peak atomic.Int32
	x.parseFn = func(r io.ReaderAt, size int64, name string) (*Index, error) {
		n := inFlight.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		defer inFlight.Add(-1)
		started <- name
		<-release
		return Parse(r, size, name)
	}
	dir := t.TempDir()
	paths := make([]string, DefaultParses+1)
	for i := range paths {
		paths[i] = filepath.Join(dir, fmt.Sprintf("a%d.npy", i))
		writeFile(t, paths[i], npyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", make([]byte, 4)))
	}
	var wg sync.WaitGroup
	errs := make([]error, DefaultParses)
	for i := range DefaultParses {
		// One requester each: a uid's own share is one parse.
		ctx := WithRequester(context.Background(), uint32(1000+i))
		wg.Go(func() { _, errs[i] = getPath(ctx, x, paths[i]) })
	}
	for range DefaultParses {
		<-started
	}
	// Every slot is taken: the next file waits parseWait and gives up.
	ctx := WithRequester(context.Background(), 2000)
	last := paths[DefaultParses]
	if _, err := getPath(ctx, x, last); !errors.Is(err, ErrBusy) {
		t.Fatalf("Get with every slot taken = %v, want ErrBusy", err)
	}
	close(release)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("Get(%s) = %v", paths[i], err)
		}
	}
	if _, err := getPath(ctx, x, last); err != nil {
		t.Errorf("Get once slots are free = %v (ErrBusy must not be cached)", err)
	}
	if p := peak.Load(); p > DefaultParses {
		t.Errorf("%d parses ran at once, limit %d", p, DefaultParses)
	}
	if st := x.Stats(); st.Busy != 1 {
		t.Errorf("busy = %d, want 1", st.Busy)
	}
}

// TestIndexesParseSlotsPerUID: a uid whose parse runs waits for it before
// starting another (ErrBusy after the wait), while another uid is served:
// one user asking for many files cannot take every slot.
func TestIndexesParseSlotsPerUID(t *testing.T) {
	x := newTestIndexes(t)
	x.parseWait = 20 * time.Millisecond
	started := make(chan struct{}, 4)
	release := make(chan struct{})
	x.parseFn = func(r io.ReaderAt, size int64, name string) (*Index, error) {
		if strings.Contains(name, "slow") {
			started <- struct{}{}
			<-release
		}
		return Parse(r, size, name)
	}
	dir := t.TempDir()
	npy := npyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", make([]byte, 4))
	for _, n := range []string{"slow.npy", "second.npy", "other.npy"} {
		writeFile(t, filepath.Join(dir, n), npy)
	}
	attacker := WithRequester(context.Background(), 1001)
	done := make(chan error, 1)
	go func() { _, err := getPath(attacker, x, filepath.Join(dir, "slow.npy")); done <- err }()
	<-started
	if _, err := getPath(attacker, x, filepath.Join(dir, "second.npy")); !errors.Is(err, ErrBusy) {
		t.Errorf("a second parse for the same uid = %v, want ErrBusy", err)
	}
	if _, err := getPath(WithRequester(context.Background(), 1002), x, filepath.Join(dir, "other.npy")); err != nil {
		t.Errorf("another uid's parse while the first uid's runs = %v", err)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	x.uids.mu.Lock()
	left := len(x.uids.m)
	x.uids.mu.Unlock()
	if left != 0 {
		t.Errorf("%d per-uid slot entries left with no parse running", left)
	}
}

// TestIndexesNeverOpen: Get reads only through the descriptor it is given;
// a FIFO (opened without blocking) has no index and is not read; a
// write-only descriptor is EBADF.
func TestIndexesNeverOpen(t *testing.T) {
	x := newTestIndexes(t)
	dir := t.TempDir()
	fifo := filepath.Join(dir, "shard.tar")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(fifo, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := x.Get(context.Background(), fifo, f); !errors.Is(err, ErrNoIndex) {
		t.Errorf("Get of a FIFO = %v, want ErrNoIndex", err)
	}
	// O_PATH descriptors (what fs hands over for anything but regular
	// files and directories) stat, and never read.
	for _, tc := range []struct {
		path string
		want error
	}{{fifo, ErrNoIndex}, {regular(t, dir), syscall.EBADF}} {
		fd, err := unix.Open(tc.path, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		pf := os.NewFile(uintptr(fd), tc.path)
		if _, err := x.Get(context.Background(), tc.path, pf); !errors.Is(err, tc.want) {
			t.Errorf("Get of an O_PATH descriptor of %s = %v, want %v", tc.path, err, tc.want)
		}
		pf.Close()
	}
	if _, err := x.Get(context.Background(), fifo, nil); !errors.Is(err, syscall.EBADF) {
		t.Errorf("Get without a descriptor = %v, want EBADF", err)
	}
	if p := x.Stats().Parses; p != 0 {
		t.Errorf("parses = %d, want 0", p)
	}
}

// TestParserLimits: inputs within the file-size bounds but beyond gdsfs's
// index limits are refused with the limit named, before the memory they
// would cost is spent.
func TestParserLimits(t *testing.T) {
	// A tar of PAX members whose names add up to more than 8 MiB.
	var tarBuf bytes.Buffer
	tw := tar.NewWriter(&tarBuf)
	for i := range 200 {
		name := fmt.Sprintf("%d/%s.bin", i, strings.Repeat("n", 45_000))
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Typeflag: tar.TypeReg, Format: tar.FormatPAX}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	// An MDS shard of 2^18 empty samples of 9 columns of fixed size 0:
	// nothing in the file, 2.4 million column ranges in the index.
	const n = 1 << 18
	cols := `{"version":2,"format":"mds","column_names":["a","b","c","d","e","f","g","h","i"],` +
		`"column_encodings":["int","int","int","int","int","int","int","int","int"],"column_sizes":[0,0,0,0,0,0,0,0,0]}`
	mds := binary.LittleEndian.AppendUint32(nil, n)
	start := uint32(4 + 4*(n+1) + len(cols))
	for range n + 1 {
		mds = binary.LittleEndian.AppendUint32(mds, start)
	}
	mds = append(mds, cols...)
	// A zip whose zip64 end record claims 2^18+1 records.
	var zipBuf bytes.Buffer
	zipBuf.WriteString("PK\x03\x04") // a local header's magic, for Detect
	zipBuf.Write(make([]byte, 26))
	z64 := make([]byte, 56)
	copy(z64, "PK\x06\x06")
	binary.LittleEndian.PutUint64(z64[4:], 44)
	binary.LittleEndian.PutUint64(z64[32:], 1<<18+1)
	binary.LittleEndian.PutUint64(z64[40:], 1<<18*46)
	zipBuf.Write(z64)
	loc := make([]byte, 20)
	copy(loc, "PK\x06\x07")
	binary.LittleEndian.PutUint64(loc[8:], 30) // the zip64 record's offset
	zipBuf.Write(loc)
	eocd := make([]byte, 22)
	copy(eocd, "PK\x05\x06")
	binary.LittleEndian.PutUint16(eocd[8:], 0xffff)
	binary.LittleEndian.PutUint16(eocd[10:], 0xffff)
	binary.LittleEndian.PutUint32(eocd[12:], 0xffffffff)
	binary.LittleEndian.PutUint32(eocd[16:], 0xffffffff)
	zipBuf.Write(eocd)
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"a.tar", tarBuf.Bytes(), "member names of more than 8388608 bytes"},
		{"shard.00000.mds", mds, "exceed gdsfs's index limit of 1048576 column ranges"},
		{"big.pt", zipBuf.Bytes(), "262145 records exceed gdsfs's index limit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(bytes.NewReader(tc.data), int64(len(tc.data)), tc.name)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Parse = %v, want ErrInvalid saying %q", err, tc.want)
			}
		})
	}
}

// regular writes a small indexable file in dir and returns its path.
func regular(t *testing.T, dir string) string {
	t.Helper()
	p := filepath.Join(dir, "r.npy")
	writeFile(t, p, npyFile(1, "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", make([]byte, 4)))
	return p
}

// TestIndexesCallerGivesUp: a caller that gives up and closes its
// descriptor leaves the parse it started to finish (on the flight's own
// duplicate) and be cached for the next caller.
func TestIndexesCallerGivesUp(t *testing.T) {
	x := newTestIndexes(t)
	release, finished := make(chan struct{}), make(chan error, 1)
	x.parseFn = func(r io.ReaderAt, size int64, name string) (*Index, error) {
		<-release
		idx, err := Parse(r, size, name)
		finished <- err
		return idx, err
	}
	p := regular(t, t.TempDir())
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	got := make(chan error, 1)
	go func() { _, err := x.Get(ctx, p, f); got <- err }()
	cancel()
	if err := <-got; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Get = %v", err)
	}
	f.Close()
	close(release)
	select {
	case err := <-finished:
		if err != nil {
			t.Fatalf("the parse after its caller closed the descriptor: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the parse its caller gave up on never ran")
	}
	if _, err := getPath(context.Background(), x, p); err != nil {
		t.Fatal(err)
	}
	if st := x.Stats(); st.Parses != 1 {
		t.Errorf("parses = %d, want 1 (the abandoned parse's answer is cached)", st.Parses)
	}
}
