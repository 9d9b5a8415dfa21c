package cufile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// threadCuFile is fakeCuFile recording which OS thread each cuFile call
// and each cuCtxSetCurrent ran on: the gds engine's pool (threadpool.go)
// promises a fixed, small set of threads, each made current once per
// device. It checks that every cuFileRead/cuFileWrite runs on a thread
// with the slab's device current, and can hold calls at a gate or fail
// every call into one slab.
type threadCuFile struct {
	*fakeCuFile
	gate     chan struct{}    // non-nil: each call waits for it to close
	gated    map[uintptr]bool // non-nil: only calls into these slabs wait at gate (set before any call)
	entered  chan struct{}    // a token per call that reached the gate
	failBase uintptr          // calls into the slab at this pointer fail with EIO

	tmu       sync.Mutex
	ioThreads map[int]int    // GUARDED_BY(tmu): calls per OS thread
	sets      map[[2]int]int // GUARDED_BY(tmu): SetCurrent calls per (thread, device)
	current   map[int]int    // GUARDED_BY(tmu): device current on each thread
	wrong     int            // GUARDED_BY(tmu): calls on a thread without the slab's device current
	entries   int            // GUARDED_BY(tmu): calls, counted before the gate
}

func newThreadCuFile(t testing.TB) *threadCuFile {
	return &threadCuFile{fakeCuFile: newFakeCuFile(t), ioThreads: map[int]int{}, sets: map[[2]int]int{}, current: map[int]int{}}
}

func (c *threadCuFile) SetCurrent(device int) error {
	tid := unix.Gettid()
	c.tmu.Lock()
	defer c.tmu.Unlock()
	c.sets[[2]int{tid, device}]++
	c.current[tid] = device
	return nil
}

// enter records a cuFile call into the slab at base and answers whether
// it fails.
func (c *threadCuFile) enter(base uintptr) error {
	tid := unix.Gettid()
	device := -1
	c.fakeCuFile.mu.Lock()
	if m := c.slabs[base]; m != nil {
		device = m.device
	}
	c.fakeCuFile.mu.Unlock()
	c.tmu.Lock()
	c.ioThreads[tid]++
	c.entries++
	if cur, ok := c.current[tid]; !ok || cur != device {
		c.wrong++
	}
	c.tmu.Unlock()
	// A real cuFileRead blocks its thread for a while (a copy, a pread):
	// yielding here lets the scheduler run other goroutines beside it,
	// as it does then.
	runtime.Gosched()
	if c.gate != nil && (c.gated == nil || c.gated[base]) {
		c.entered <- struct{}{}
		<-c.gate
	}
	if base == c.failBase {
		return fmt.Errorf("fake cuFileRead: %w", syscall.EIO)
	}
	return nil
}

// calls returns the cuFile calls made so far, including those at the gate.
func (c *threadCuFile) calls() int {
	c.tmu.Lock()
	defer c.tmu.Unlock()
	return c.entries
}

func (c *threadCuFile) Read(h, base uintptr, size, fileOff, bufOff int64) (int64, error) {
	if err := c.enter(base); err != nil {
		return 0, err
	}
	return c.fakeCuFile.Read(h, base, size, fileOff, bufOff)
}

func (c *threadCuFile) Write(h, base uintptr, size, fileOff, bufOff int64) (int64, error) {
	if err := c.enter(base); err != nil {
		return 0, err
	}
	return c.fakeCuFile.Write(h, base, size, fileOff, bufOff)
}

// threads returns the OS threads that made cuFile calls, the most
// SetCurrent calls of one (thread, device), and the calls made without
// the slab's device current.
func (c *threadCuFile) threads() (io, mostSets, wrong int) {
	c.tmu.Lock()
	defer c.tmu.Unlock()
	for _, n := range c.sets {
		mostSets = max(mostSets, n)
	}
	return len(c.ioThreads), mostSets, c.wrong
}

// poolTestEngine is the gds engine (compat mode) on tf's fake calls with
// workers workers per transfer, closed at the end of the test. Its
// transfers never spill to threads of their own (a test of the spill sets
// pool.spillAfter back): on a loaded machine, or under -race, a fake
// transfer can wait for a pool thread longer than spillAfter.
func poolTestEngine(t *testing.T, tf *threadCuFile, workers int) *gdsEngine {
	t.Helper()
	g := newGDSEngine(nil, nil, 64<<10, workers, true)
	g.d, g.io, g.reg = tf, tf, tf.handles
	if g.pool == nil { // GDSFS_CUFILE_POOL=0 in the environment: these tests are of the pool
		g.pool = newThreadPool(poolThreads(workers), g.bind)
	}
	g.pool.spillAfter = time.Hour
	t.Cleanup(g.Close)
	return g
}

// TestGDSPoolPrime: priming (Engines.choose, when the daemon builds its
// engines) starts every pool thread and makes each device current once
// on each, reading nothing; READs into device 0 after it make no
// SetCurrent call at all, and run on the primed threads.
func TestGDSPoolPrime(t *testing.T) {
	const (
		workers = 4
		size    = 1 << 20
		devices = 2
	)
	f, data := randomCachedFile(t, size)
	tf := newThreadCuFile(t)
	g := poolTestEngine(t, tf, workers)
	g.prime(devices)
	tf.tmu.Lock()
	primed := map[int]bool{}
	for k, n := range tf.sets {
		primed[k[0]] = true
		if n != 1 {
			t.Errorf("priming made device %d current %d times on thread %d, want once", k[1], n, k[0])
		}
	}
	sets := len(tf.sets)
	tf.tmu.Unlock()
	if want := poolThreads(workers); len(primed) != want || sets != want*devices {
		t.Errorf("priming reached %d threads with %d (thread, device) pairs; want %d threads, %d pairs", len(primed), sets, want, want*devices)
	}
	if io := tf.calls(); io != 0 {
		t.Errorf("priming made %d cuFile calls, want none", io)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			m := tf.slab(size)
			if got, err := g.ReadAt(context.Background(), f, m, 0, 0, size); err != nil || got != size || !bytes.Equal(m.data, data) {
				t.Errorf("ReadAt after priming = %d, %v (bytes equal %v)", got, err, bytes.Equal(m.data, data))
			}
		})
	}
	wg.Wait()
	tf.tmu.Lock()
	defer tf.tmu.Unlock()
	if len(tf.sets) != sets {
		t.Errorf("READs after priming made SetCurrent calls: %d (thread, device) pairs, %d after priming", len(tf.sets), sets)
	}
	for k, n := range tf.sets {
		if n != 1 {
			t.Errorf("thread %d made device %d current %d times, want once (at priming)", k[0], k[1], n)
		}
	}
	for tid := range tf.ioThreads {
		if !primed[tid] {
			t.Errorf("thread %d made cuFile calls without being primed", tid)
		}
	}
	if tf.wrong != 0 {
		t.Errorf("%d cuFile calls ran on a thread without the slab's device current", tf.wrong)
	}
}

// TestGDSPoolSwitch: GDSFS_CUFILE_POOL, read when the engine is built,
// turns the pool off with 0 (or off, false, no) and leaves it on
// otherwise, unset included.
func TestGDSPoolSwitch(t *testing.T) {
	for _, tc := range []struct {
		value string
		set   bool
		want  bool
	}{
		{"", false, true},
		{"", true, true},
		{"1", true, true},
		{"0", true, false},
		{" off ", true, false},
		{"FALSE", true, false},
		{"no", true, false},
	} {
		t.Run(fmt.Sprintf("%q set %v", tc.value, tc.set), func(t *testing.T) {
			if tc.set {
				t.Setenv(poolEnv, tc.value)
			} else {
				t.Setenv(poolEnv, "")
				os.Unsetenv(poolEnv)
			}
			g := newGDSEngine(nil, nil, 0, 4, true)
			defer g.Close()
			if got := g.pool != nil; got != tc.want {
				t.Errorf("%s=%q: pool on %v, want %v", poolEnv, tc.value, got, tc.want)
			}
		})
	}
}

// goroutinesBack waits until no more goroutines run than before (those
// of the engine and its transfers have exited), failing after 10 s.
func goroutinesBack(t *testing.T, before int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines, %d before the engine:\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(time.Millisecond)
	}
}

// TestGDSPoolThreads: many callers' concurrent READs and WRITEs through
// the gds engine, then more one after another, make their cuFile calls on
// at most poolThreads(workers) OS threads, each made current once per
// device (a slab on device 0, then on device 1), with the slab's device
// current at every call; the bytes and the short count at end of file are
// as before. Per-transfer goroutines (GDSFS_CUFILE_POOL=0) locked a thread
// for each of a transfer's workers and made it current each time.
func TestGDSPoolThreads(t *testing.T) {
	const (
		workers = 4
		size    = 1 << 20 // 16 chunks of 64 KiB
		callers = 32
	)
	f, data := randomCachedFile(t, size)
	out, err := os.OpenFile(filepath.Join(t.TempDir(), "out"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	tf := newThreadCuFile(t)
	g := poolTestEngine(t, tf, workers)
	ctx := context.Background()
	// one transfer: caller i reads the file into a fresh slab on device
	// (every fourth from 100 KiB before the end, asking for the whole
	// file: a short read), or writes its slab's bytes to out at i MiB.
	one := func(i, device int) error {
		m := tf.slab(size)
		m.device = device
		switch i % 4 {
		case 1:
			copy(m.data, data)
			got, err := g.WriteAt(ctx, out, m, 0, int64(i)*size, size)
			if err != nil || got != size {
				return fmt.Errorf("caller %d: WriteAt = %d, %v", i, got, err)
			}
			back := make([]byte, size)
			if _, err := out.ReadAt(back, int64(i)*size); err != nil || !bytes.Equal(back, data) {
				return fmt.Errorf("caller %d: the written bytes differ (%v)", i, err)
			}
		case 3:
			const at = size - 100<<10
			got, err := g.ReadAt(ctx, f, m, 0, at, size)
			if err != nil || got != size-at || !bytes.Equal(m.data[:got], data[at:]) {
				return fmt.Errorf("caller %d: ReadAt past end of file = %d, %v; want %d bytes of the file's", i, got, err, size-at)
			}
		default:
			got, err := g.ReadAt(ctx, f, m, 0, 0, size)
			if err != nil || got != size || !bytes.Equal(m.data, data) {
				return fmt.Errorf("caller %d: ReadAt = %d, %v (bytes equal %v)", i, got, err, bytes.Equal(m.data, data))
			}
		}
		return nil
	}
	for device := range 2 {
		start := make(chan struct{})
		errs := make(chan error, callers)
		for i := range callers {
			go func() { <-start; errs <- one(i, device) }()
		}
		close(start)
		for range callers {
			if err := <-errs; err != nil {
				t.Error(err)
			}
		}
		for i := range callers {
			if err := one(i, device); err != nil {
				t.Error(err)
			}
		}
	}
	io, mostSets, wrong := tf.threads()
	t.Logf("%d OS threads made cuFile calls; a thread was made current on one device at most %d times", io, mostSets)
	if bound := poolThreads(workers); io > bound || io == 0 {
		t.Errorf("cuFile called on %d OS threads; want between 1 and %d (the pool of a %d-worker engine)", io, bound, workers)
	}
	if mostSets != 1 {
		t.Errorf("a thread was made current on one device %d times; want once", mostSets)
	}
	if wrong != 0 {
		t.Errorf("%d cuFile calls ran on a thread without the slab's device current", wrong)
	}
}

// TestGDSPoolCancel: a READ whose context is cancelled while its chunks
// run stops handing them out and answers context.Canceled; one cancelled
// while every pool thread is busy answers at once, without a thread; the
// busy transfers then complete, and nothing is left running after Close.
func TestGDSPoolCancel(t *testing.T) {
	const (
		workers = 4
		size    = 1 << 20
	)
	before := runtime.NumGoroutine()
	f, data := randomCachedFile(t, size)
	tf := newThreadCuFile(t)
	tf.gate, tf.entered = make(chan struct{}), make(chan struct{}, 64)
	g := poolTestEngine(t, tf, workers)

	t.Run("while its chunks run", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		res := make(chan error, 1)
		go func() {
			_, err := g.ReadAt(ctx, f, tf.slab(size), 0, 0, size)
			res <- err
		}()
		for range workers {
			<-tf.entered
		}
		cancel()
		r0 := tf.calls()
		for range workers { // let the chunks in flight finish
			tf.gate <- struct{}{}
		}
		if err := <-res; !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled ReadAt = %v, want context.Canceled", err)
		}
		if r1 := tf.calls(); r1 != r0 {
			t.Errorf("%d cuFileReads began after the cancel, want none", r1-r0)
		}
	})
	t.Run("while waiting for a thread", func(t *testing.T) {
		busy := poolThreads(workers) / workers // transfers that take every pool thread
		res := make(chan error, busy)
		slabs := make([]*fakeCuSlab, busy)
		for i := range slabs {
			slabs[i] = tf.slab(size)
			go func() {
				got, err := g.ReadAt(context.Background(), f, slabs[i], 0, 0, size)
				if err == nil && (got != size || !bytes.Equal(slabs[i].data, data)) {
					err = fmt.Errorf("ReadAt = %d (bytes equal %v)", got, bytes.Equal(slabs[i].data, data))
				}
				res <- err
			}()
		}
		for range busy * workers {
			<-tf.entered
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if _, err := g.ReadAt(ctx, f, tf.slab(size), 0, 0, size); !errors.Is(err, context.Canceled) {
			t.Errorf("ReadAt cancelled while the pool is busy = %v, want context.Canceled", err)
		}
		close(tf.gate)
		for range busy {
			if err := <-res; err != nil {
				t.Error(err)
			}
		}
	})
	g.Close()
	goroutinesBack(t, before)
}

// TestGDSPoolCloseWaits: Close returns only once the pool's threads have
// ended, so no cuFile call is in flight when the handles are deregistered;
// the transfer in flight completes; a transfer after Close fails at once.
func TestGDSPoolCloseWaits(t *testing.T) {
	const (
		workers = 2
		size    = 256 << 10
	)
	before := runtime.NumGoroutine()
	f, data := randomCachedFile(t, size)
	tf := newThreadCuFile(t)
	tf.gate, tf.entered = make(chan struct{}), make(chan struct{}, 64)
	g := poolTestEngine(t, tf, workers)
	m := tf.slab(size)
	res := make(chan error, 1)
	go func() {
		got, err := g.ReadAt(context.Background(), f, m, 0, 0, size)
		if err == nil && (got != size || !bytes.Equal(m.data, data)) {
			err = fmt.Errorf("ReadAt = %d (bytes equal %v)", got, bytes.Equal(m.data, data))
		}
		res <- err
	}()
	for range workers {
		<-tf.entered
	}
	closed := make(chan struct{})
	go func() { g.Close(); close(closed) }()
	select {
	case <-closed:
		t.Error("Close returned while cuFileReads were in flight")
	case <-time.After(10 * time.Millisecond): // a chance to see that bug, not a synchronisation
	}
	close(tf.gate)
	<-closed
	if err := <-res; err != nil {
		t.Errorf("the READ in flight at Close: %v", err)
	}
	if _, err := g.ReadAt(context.Background(), f, tf.slab(size), 0, 0, size); !errors.Is(err, errEngineClosed) {
		t.Errorf("ReadAt after Close = %v, want errEngineClosed", err)
	}
	g.Close() // twice is harmless
	goroutinesBack(t, before)
}

// TestGDSPoolClosedIsNoRefusal: a READ or WRITE that reaches cuFile after
// the engines closed (daemon shutdown) answers errEngineClosed; the file
// is not demoted to posix nor logged as one cuFile failed on.
func TestGDSPoolClosedIsNoRefusal(t *testing.T) {
	const size = 256 << 10
	c := cuFileConfigs[1] // --engine gds without nvidia-fs
	f, _ := randomCachedFile(t, size)
	cf := newFakeCuFile(t)
	e := c.engines(cf)
	if e.gds.pool == nil { // GDSFS_CUFILE_POOL=0 in the environment: this is a test of the pool
		e.gds.pool = newThreadPool(poolThreads(e.gds.workers), e.gds.bind)
	}
	eng, why := e.ChooseAs(f, f.Name(), 0, size, nil)
	if _, ok := eng.(*fallbackEngine); !ok {
		t.Fatalf("the file is chosen as %s (%q), want cuFile", eng.Name(), why)
	}
	e.gds.Close()
	m := cf.slab(size)
	if _, err := eng.ReadAt(context.Background(), f, m, 0, 0, size); !errors.Is(err, errEngineClosed) {
		t.Errorf("ReadAt after Close = %v, want errEngineClosed", err)
	}
	if _, err := eng.WriteAt(context.Background(), f, m, 0, 0, size); !errors.Is(err, errEngineClosed) {
		t.Errorf("WriteAt after Close = %v, want errEngineClosed", err)
	}
	if r := e.Refusals(); len(r) != 0 {
		t.Errorf("a closed engine's answer was taken for cuFile failing on the file: %+v", r)
	}
	if eng, _ := e.ChooseAs(f, f.Name(), 0, size, nil); eng.Name() == EnginePosix {
		t.Error("the file was demoted to posix")
	}
}

// TestGDSPoolChunkError: a chunk's error fails its own transfer, with the
// chunk named, while the transfers beside it complete with their bytes,
// and the pool still serves transfers after.
func TestGDSPoolChunkError(t *testing.T) {
	const (
		workers = 4
		size    = 1 << 20
		good    = 8
	)
	f, data := randomCachedFile(t, size)
	tf := newThreadCuFile(t)
	g := poolTestEngine(t, tf, workers)
	bad := tf.slab(size)
	tf.failBase = bad.ptr
	start := make(chan struct{})
	errs := make(chan error, good+1)
	go func() {
		<-start
		_, err := g.ReadAt(context.Background(), f, bad, 0, 0, size)
		if !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), "chunk at +") {
			errs <- fmt.Errorf("ReadAt into the failing slab = %v, want EIO naming its chunk", err)
			return
		}
		errs <- nil
	}()
	read := func() error {
		m := tf.slab(size)
		got, err := g.ReadAt(context.Background(), f, m, 0, 0, size)
		if err != nil || got != size || !bytes.Equal(m.data, data) {
			return fmt.Errorf("ReadAt beside the failing one = %d, %v (bytes equal %v)", got, err, bytes.Equal(m.data, data))
		}
		return nil
	}
	for range good {
		go func() { <-start; errs <- read() }()
	}
	close(start)
	for range good + 1 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	if err := read(); err != nil {
		t.Errorf("after the failure: %v", err)
	}
}

// BenchmarkGDSPool: 16 callers at once, each a 256 KiB READ in 4 chunks
// (one op: all 16), through the gds engine on fake cuFile calls, with the
// pool (on) and with per-transfer goroutines (off). It reports the OS
// threads that made cuFile calls, those the process created since the
// benchmark began (threadcreate profile, over every b.N round) and those
// alive at the end (/proc/self/status). Run each in its own process, so
// the second does not find the first's threads:
//
//	go test -run '^$' -bench 'BenchmarkGDSPool/off' ./cufile/
//	go test -run '^$' -bench 'BenchmarkGDSPool/on' ./cufile/
func BenchmarkGDSPool(b *testing.B) {
	const (
		workers = 4
		size    = 256 << 10
		callers = 16
	)
	base := pprof.Lookup("threadcreate").Count()
	for _, pool := range []bool{false, true} {
		name := "off"
		if pool {
			name = "on"
		}
		b.Run(name, func(b *testing.B) {
			f, _ := randomCachedFile(b, size)
			tf := newThreadCuFile(b)
			g := newGDSEngine(nil, nil, 64<<10, workers, true)
			g.d, g.io, g.reg = tf, tf, tf.handles
			if g.pool != nil {
				g.pool.close()
				g.pool = nil
			}
			if pool {
				g.pool = newThreadPool(poolThreads(workers), g.bind)
				g.pool.spillAfter = time.Hour // the pool's threads only (poolTestEngine)
			}
			defer g.Close()
			slabs := make([]*fakeCuSlab, callers)
			for i := range slabs {
				slabs[i] = tf.slab(size)
			}
			ctx := context.Background()
			b.ResetTimer()
			for range b.N {
				var wg sync.WaitGroup
				for i := range callers {
					wg.Go(func() {
						if got, err := g.ReadAt(ctx, f, slabs[i], 0, 0, size); err != nil || got != size {
							b.Errorf("ReadAt = %d, %v", got, err)
						}
					})
				}
				wg.Wait()
			}
			b.StopTimer()
			io, _, _ := tf.threads()
			b.ReportMetric(float64(io), "cufile-threads")
			b.ReportMetric(float64(pprof.Lookup("threadcreate").Count()-base), "threads-created")
			b.ReportMetric(float64(liveThreads(b)), "threads-alive")
		})
	}
}

// liveThreads is the process's OS thread count (/proc/self/status).
func liveThreads(tb testing.TB) int {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		tb.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			var n int
			if _, err := fmt.Sscan(v, &n); err != nil {
				tb.Fatal(err)
			}
			return n
		}
	}
	tb.Fatal("/proc/self/status has no Threads line")
	return 0
}
