package cufile

import (
	"bytes"
	"context"
	"os"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/gpubuf"
)

// TestColdReadShapeInACrowd checks the rule for a cold split read among
// others (coldReads.shape, coldReads.crowded): alone or with fewer than
// ColdCrowd in flight it keeps readTaskBytes' tasks and the advice runs;
// from ColdCrowd on it is cut into tasks of the device's largest request
// (evenly, at most a chunk), where that request is larger than the task,
// and no read advises; a range read in whole chunks is not counted.
func TestColdReadShapeInACrowd(t *testing.T) {
	f, err := os.Open(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const chunk, task, n = 8 << 20, 1 << 20, 64 << 20
	opts := func(dev int64, crowd int) Options {
		o := Options{ChunkBytes: chunk, ColdTaskBytes: task, ColdCrowd: crowd}.withDefaults()
		o.cold.ioBytes = func(uint64) int64 { return dev }
		return o
	}
	type want struct {
		task    int64
		crowded bool
	}
	for _, tc := range []struct {
		name  string
		dev   int64
		crowd int
		n     int64
		want  []want // the 1st, 2nd, ... read in flight at once
	}{
		{"4 MiB device: the 4th read in flight", 4 << 20, 4, n, []want{{task, false}, {task, false}, {task, false}, {4 << 20, true}, {4 << 20, true}}},
		{"uneven range: even tasks", 4 << 20, 1, n + 100, []want{{4<<20 + gpubuf.Align, true}}},
		{"range under one device request", 4 << 20, 1, 3 << 20, []want{{3 << 20, true}}},
		{"device request over a chunk", 16 << 20, 1, n, []want{{chunk, true}}},
		{"device request under the task", 256 << 10, 1, n, []want{{task, true}}},
		{"device unknown", 0, 1, n, []want{{task, true}}},
		{"crowd off (0, the default)", 4 << 20, 0, n, []want{{task, false}, {task, false}, {task, false}, {task, false}, {task, false}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := opts(tc.dev, tc.crowd)
			var dones []func()
			for i, w := range tc.want {
				got, done := o.cold.shape(o, f, tc.n, task)
				dones = append(dones, done)
				if got != w.task || o.cold.crowded(o) != w.crowded {
					t.Errorf("read %d in flight: task %d crowded %v, want %d %v", i+1, got, o.cold.crowded(o), w.task, w.crowded)
				}
			}
			for _, d := range dones {
				d()
			}
			if k := o.cold.inflight.Load(); k != 0 || o.cold.crowded(o) {
				t.Errorf("%d cold reads in flight after all ended (crowded %v)", k, o.cold.crowded(o))
			}
		})
	}
	t.Run("whole chunks are not counted", func(t *testing.T) {
		o := opts(4<<20, 1)
		got, done := o.cold.shape(o, f, n, chunk)
		defer done()
		if got != chunk || o.cold.crowded(o) || o.cold.inflight.Load() != 0 {
			t.Errorf("a read in whole chunks: task %d, %d counted in flight", got, o.cold.inflight.Load())
		}
	})
}

// TestSysfsMaxIO reads the largest request of the disk under a file: a
// positive whole number of KiB where /sys says, 0 for a device that is no
// block device.
func TestSysfsMaxIO(t *testing.T) {
	if got := sysfsMaxIO(unix.Mkdev(0, 42)); got != 0 {
		t.Errorf("anonymous device: %d, want 0", got)
	}
	f, err := os.CreateTemp(t.TempDir(), "dev")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if unix.Major(st.Dev) == 0 {
		t.Skip("the temp directory is on no block device")
	}
	got := sysfsMaxIO(st.Dev)
	if got <= 0 || got%1024 != 0 {
		t.Errorf("max request of %d:%d = %d, want a positive number of KiB", unix.Major(st.Dev), unix.Minor(st.Dev), got)
	}
}

// TestCrowdedColdReadsKeepBytes reads one cold file as 6 concurrent
// ranges, each in tasks of a (pretended) device's largest request, with the
// host and posix engines, and checks every byte.
func TestCrowdedColdReadsKeepBytes(t *testing.T) {
	const size = 48*gpubuf.Align + 333
	for _, name := range []string{"host", "posix"} {
		t.Run(name, func(t *testing.T) {
			f, data := coldFile(t, size)
			o := Options{ChunkBytes: 8 * gpubuf.Align, ColdTaskBytes: gpubuf.Align, Workers: 3, Direct: "never", ColdReadAheadBytes: -1, ColdCrowd: 2}.withDefaults()
			o.cold.ioBytes = func(uint64) int64 { return 3 * gpubuf.Align }
			var e Engine = NewHostEngine(o)
			mem := gpubuf.Memory(&hostMem{mmapBytes(size)})
			out := func() []byte { return mem.(*hostMem).b }
			if name == "posix" {
				e = newPosixEngine(&fakeStager{failH2DAt: -1}, o)
				fm := &fakeDevMem{data: make([]byte, size)}
				mem, out = fm, func() []byte { return fm.data }
			}
			const parts = 6
			var wg sync.WaitGroup
			for i := range parts {
				wg.Go(func() {
					off := int64(i) * size / parts
					end := int64(i+1) * size / parts
					if got, err := e.ReadAt(context.Background(), f, mem, off, off, end-off); err != nil || got != end-off {
						t.Errorf("part %d: %d bytes, %v", i, got, err)
					}
				})
			}
			wg.Wait()
			if !bytes.Equal(out(), data) {
				t.Error("the bytes read differ from the file's")
			}
			if k := o.cold.inflight.Load(); k != 0 {
				t.Errorf("%d cold reads in flight after all ended", k)
			}
		})
	}
}
