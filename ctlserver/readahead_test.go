package ctlserver

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/internal/pagecache"
	"github.com/gdsfs/gdsfs/internal/readahead"
	"golang.org/x/sys/unix"
)

// coldFile writes a file of n bytes, flushes it and drops it from the page
// cache (posix_fadvise DONTNEED on this file only: other tests' files stay
// cached), and opens it read-only with the kernel's own readahead off
// (POSIX_FADV_RANDOM), so what is cached after a READ is the READ's bytes
// and what the daemon read ahead.
func (e *testEnv) coldFile(name string, n int) (*os.File, []byte) {
	e.t.Helper()
	f, data := e.file(name, n, os.O_RDONLY)
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		e.t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		e.t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
		e.t.Fatal(err)
	}
	if c, ok := pagecache.Cached(f, 0, int64(n)); !ok {
		e.t.Skip("no cachestat(2) on this kernel: residency cannot be checked")
	} else if c > int64(n)/16 {
		e.t.Skipf("%d of %d bytes still cached after POSIX_FADV_DONTNEED", c, n)
	}
	return f, data
}

// batch is one READ of a batch of k samples of sample bytes each from
// off, one tar header apart: the ranges a dataset worker asks for.
func batch(off uint64, k int, sample uint64) []ctl.Range {
	var rs []ctl.Range
	for i := range k {
		rs = append(rs, ctl.Range{Offset: off + uint64(i)*(sample+512), Length: sample})
	}
	return rs
}

// cachedFrac is the part of [off, off+n) of f in the page cache.
func cachedFrac(t *testing.T, f *os.File, off, n int64) float64 {
	t.Helper()
	c, ok := pagecache.Cached(f, off, n)
	if !ok {
		t.Fatal("cachestat failed")
	}
	return float64(min(c, n)) / float64(n)
}

// Sequential READs of small ranges of a cold file read the file ahead of
// them, and the bytes every READ returns are the file's. Random READs, warm data and engines that do not
// read through the page cache read nothing ahead; two opens of one file
// are two streams.
func TestReadahead(t *testing.T) {
	const (
		fileBytes = 48 << 20
		sample    = 60 << 10
		k         = 16 // samples per READ: about 1 MiB
		step      = k * (sample + 512)
	)
	buffered := cufile.NewHostEngine(cufile.Options{})
	seq := func(off uint64, n int) []uint64 { // n READs one after the other from off
		var offs []uint64
		for i := range n {
			offs = append(offs, off+uint64(i)*step)
		}
		return offs
	}
	cases := []struct {
		name   string
		engine cufile.Engine
		warm   bool
		offs   []uint64 // first sample of each READ
		jobs   bool     // readahead expected
		ahead  [2]int64 // a range expected cached (jobs) or not
	}{
		{"sequential", buffered, false, seq(0, 6), true, [2]int64{8 << 20, 36 << 20}},
		{"sequential from mid-file", buffered, false, seq(16<<20, 8), true, [2]int64{26 << 20, 46 << 20}},
		{"random", buffered, false, []uint64{40 << 20, 3 << 20, 20 << 20, 9 << 20}, false, [2]int64{31 << 20, 39 << 20}},
		{"warm", buffered, true, seq(0, 4), false, [2]int64{0, 0}},
		{"direct engine", &vecEngine{Engine: buffered}, false, seq(0, 6), false, [2]int64{8 << 20, 36 << 20}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, envOptions{slabBytes: 16 << 20, budgetBytes: 64 << 20, noIndexes: true})
			e.srv.opts.Engines = fixedEngine{c.engine}
			cl := e.client(1000, ctl.Token{})
			f, data := e.coldFile("a.bin", fileBytes)
			if c.warm {
				if _, err := f.ReadAt(make([]byte, fileBytes), 0); err != nil {
					t.Fatal(err)
				}
			}
			for _, off := range c.offs {
				rs := batch(off, k, sample)
				ls, err := cl.Read(context.Background(), f, ctl.HostDevice, rs)
				if err != nil {
					t.Fatal(err)
				}
				checkLeases(t, cl, rs, ls, data)
				releaseAll(t, cl, ls)
				e.srv.ra.wg.Wait() // the readahead this READ started is submitted
			}
			started := e.srv.ra.started.Load()
			if c.jobs != (started > 0) {
				t.Errorf("%d readahead jobs, want any: %v", started, c.jobs)
			}
			if n := e.srv.ra.failed.Load(); n != 0 {
				t.Errorf("%d readahead jobs failed", n)
			}
			if c.ahead[1] > 0 {
				got := cachedFrac(t, f, c.ahead[0], c.ahead[1]-c.ahead[0])
				if c.jobs && got < 0.9 {
					t.Errorf("[%d MiB, %d MiB) is %.0f%% cached after the READs, want read ahead", c.ahead[0]>>20, c.ahead[1]>>20, 100*got)
				}
				if !c.jobs && got > 0.1 {
					t.Errorf("[%d MiB, %d MiB) is %.0f%% cached after the READs, want nothing read ahead", c.ahead[0]>>20, c.ahead[1]>>20, 100*got)
				}
			}
			e.checkIdle()
		})
	}
	// Two opens of one file by two users, read in turns: each is its
	// own sequential stream (a shared one would see jumps and read
	// nothing ahead, and one user's READs would steer the readahead of
	// the other's open). A second file that is never READ stays cold:
	// only the file a READ came with is read ahead.
	t.Run("two users' opens", func(t *testing.T) {
		e := newEnv(t, envOptions{slabBytes: 16 << 20, budgetBytes: 64 << 20, noIndexes: true})
		e.srv.opts.Engines = fixedEngine{buffered}
		clients := []*ctl.Client{e.client(1001, ctl.Token{}), e.client(1002, ctl.Token{})}
		f1, data := e.coldFile("a.bin", fileBytes)
		other, _ := e.coldFile("b.bin", 8<<20)
		f2, err := os.Open(f1.Name())
		if err != nil {
			t.Fatal(err)
		}
		defer f2.Close()
		if err := unix.Fadvise(int(f2.Fd()), 0, 0, unix.FADV_RANDOM); err != nil {
			t.Fatal(err)
		}
		for i := range 4 {
			for j, f := range []*os.File{f1, f2} {
				cl := clients[j]
				rs := batch(uint64(j)*(24<<20)+uint64(i)*step, k, sample)
				ls, err := cl.Read(context.Background(), f, ctl.HostDevice, rs)
				if err != nil {
					t.Fatal(err)
				}
				checkLeases(t, cl, rs, ls, data)
				releaseAll(t, cl, ls)
				e.srv.ra.wg.Wait()
			}
		}
		for j, r := range [][2]int64{{5 << 20, 11 << 20}, {27 << 20, 31 << 20}} {
			if got := cachedFrac(t, f1, r[0], r[1]-r[0]); got < 0.9 {
				t.Errorf("uid %d's open: [%d MiB, %d MiB) is %.0f%% cached, want read ahead", 1001+j, r[0]>>20, r[1]>>20, 100*got)
			}
		}
		if got := cachedFrac(t, other, 0, 8<<20); got > 0.1 {
			t.Errorf("a file never READ is %.0f%% cached", 100*got)
		}
	})
	// The opener goes away (a killed worker: its descriptor closed) while
	// readahead of its file is pending: the job fails quietly.
	t.Run("closed file", func(t *testing.T) {
		e := newEnv(t, envOptions{slabBytes: 16 << 20, budgetBytes: 64 << 20, noIndexes: true})
		e.srv.opts.Engines = fixedEngine{buffered}
		cl := e.client(1000, ctl.Token{})
		f, _ := e.coldFile("a.bin", 8<<20)
		ls, err := cl.Read(context.Background(), f, ctl.HostDevice, batch(0, k, sample))
		if err != nil {
			t.Fatal(err)
		}
		releaseAll(t, cl, ls)
		e.srv.ra.wg.Wait()
		f.Close()
		var fl pagecache.Fills
		if _, err := fl.Fill(context.Background(), f, 0, 1<<20); err == nil {
			t.Error("readahead of a closed file succeeded")
		}
		e.srv.ra.afterRead(1000, f, buffered, []span{{off: 1 << 20, length: 4096, valid: 4096, start: 1 << 20, end: 1<<20 + 4096}}, 8<<20, false)
		e.srv.ra.wg.Wait()
	})
}

// releaseAll releases the leases of a READ.
func releaseAll(t *testing.T, cl *ctl.Client, ls []ctl.Lease) {
	t.Helper()
	var ids []uint64
	for _, l := range ls {
		if l.ID != 0 {
			ids = append(ids, l.ID)
		}
	}
	if err := cl.Release(context.Background(), ids...); err != nil {
		t.Fatal(err)
	}
}

// BenchmarkReadahead is a dataset worker's stream of READs of batches of
// 16 small samples through a 64 MiB file, one after the other, with the
// daemon's readahead and without ("off"): warm (the readahead's cost on
// cached data: it must be none) and cold (the file's pages dropped before
// every pass; the "disk-MB/s" metric is one sequential pass of 8 MiB
// preads over the same cold file, what dd gets). Not a test: no figure is
// asserted.
//
//	go test -run '^$' -bench Readahead ./ctlserver
func BenchmarkReadahead(b *testing.B) {
	const fileBytes = 64 << 20
	for _, sample := range []uint64{16 << 10, 256 << 10} {
		for _, cold := range []bool{false, true} {
			for _, on := range []bool{true, false} {
				name := fmt.Sprintf("%dKiB/warm", sample>>10)
				if cold {
					name = fmt.Sprintf("%dKiB/cold", sample>>10)
				}
				if !on {
					name += "/off"
				}
				b.Run(name, func(b *testing.B) {
					e := newEnv(b, envOptions{slabBytes: 16 << 20, budgetBytes: 64 << 20, noIndexes: true})
					e.srv.opts.Engines = fixedEngine{cufile.NewHostEngine(cufile.Options{})}
					if !on {
						e.srv.ra = newReadaheads(readahead.Config{MaxBytes: -1})
					}
					cl := e.client(1000, ctl.Token{})
					f, _ := e.file("a.bin", fileBytes, os.O_RDONLY)
					drop := func() {
						if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
							b.Fatal(err)
						}
					}
					if cold {
						if err := unix.Fdatasync(int(f.Fd())); err != nil {
							b.Fatal(err)
						}
						drop()
						b.ReportMetric(sequentialMBps(b, f), "disk-MB/s")
						drop()
					}
					ctx := context.Background()
					step := 16 * (sample + 512)
					b.SetBytes(int64(16 * sample))
					off := uint64(0)
					for b.Loop() {
						if off+step > fileBytes {
							off = 0
							if cold {
								b.StopTimer()
								e.srv.ra.wg.Wait()
								drop()
								b.StartTimer()
							}
						}
						ls, err := cl.Read(ctx, f, ctl.HostDevice, batch(off, 16, sample))
						if err != nil {
							b.Fatal(err)
						}
						off += step
						ids := make([]uint64, len(ls))
						for i, l := range ls {
							ids[i] = l.ID
						}
						if err := cl.Release(ctx, ids...); err != nil {
							b.Fatal(err)
						}
					}
					e.srv.ra.wg.Wait()
				})
			}
		}
	}
}

// sequentialMBps reads f once from the start with 8 MiB preads.
func sequentialMBps(b *testing.B, f *os.File) float64 {
	buf := make([]byte, 8<<20)
	t0 := time.Now()
	var n int64
	for {
		k, err := f.ReadAt(buf, n)
		n += int64(k)
		if err != nil {
			break
		}
	}
	return float64(n) / time.Since(t0).Seconds() / 1e6
}
