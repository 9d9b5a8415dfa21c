package cufile

import (
	"slices"
	"sync"
	"testing"
)

// TestColdAdvisorStaysAhead checks the advisor's one promise: it advises a
// cold read's tasks in order, never more than ahead bytes past the tasks
// its workers finished, and not at all once stopped (the file may close).
func TestColdAdvisorStaysAhead(t *testing.T) {
	const task, n = 1 << 20, 64 << 20
	for _, tc := range []struct {
		name   string
		ahead  int64
		dones  int
		window int // tasks advised ahead
	}{
		{"eight tasks ahead, none finished", 8 << 20, 0, 8},
		{"eight ahead, three finished", 8 << 20, 3, 8},
		{"ahead below one task still advises one", 100, 2, 1},
		{"ahead past the range advises all of it", 1 << 30, 0, 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			var got [][2]int64
			calls := make(chan struct{}, 128)
			a := adviseAhead(4096, n, task, tc.ahead, func(off, n int64) {
				mu.Lock()
				got = append(got, [2]int64{off, n})
				mu.Unlock()
				calls <- struct{}{}
			})
			want := min(64, tc.window+tc.dones)
			for range tc.window {
				<-calls
			}
			for range tc.dones {
				a.taskDone()
				<-calls
			}
			a.stop()
			a.taskDone() // after stop: no effect, no panic
			mu.Lock()
			defer mu.Unlock()
			if len(got) != want {
				t.Fatalf("advised %d tasks, want %d (ahead %d bytes, %d finished)", len(got), want, tc.ahead, tc.dones)
			}
			for k, r := range got {
				wantN := int64(task)
				if k == 63 {
					wantN = n - 63*task
				}
				if r != [2]int64{4096 + int64(k)*task, wantN} {
					t.Fatalf("advice %d = %v, want [%d %d]", k, r, 4096+int64(k)*task, wantN)
				}
			}
		})
	}
	var none *coldAdvisor
	none.taskDone()
	none.stop()
}

// TestColdAdviceOnlyForColdBufferedSplits: advice runs only when asked
// for (not by default: on this machine's disk it halved the cold read and
// the warm re-read after it), for a read in cold tasks through the page
// cache, never for O_DIRECT or whole chunks.
func TestColdAdviceOnlyForColdBufferedSplits(t *testing.T) {
	f, _ := writeRandomFile(t, 1<<20)
	off := Options{ChunkBytes: 8 << 20, ColdTaskBytes: 1 << 20}.withDefaults()
	opts := off
	opts.ColdReadAheadBytes = -1 // --cold-readahead auto
	for _, tc := range []struct {
		name   string
		opts   Options
		direct bool
		n      int64
		task   int64
		want   bool
	}{
		{"cold buffered split", opts, false, 16 << 20, 1 << 20, true},
		{"O_DIRECT", opts, true, 16 << 20, 1 << 20, false},
		{"whole chunks (cached or short)", opts, false, 16 << 20, 8 << 20, false},
		{"one task", opts, false, 1 << 20, 1 << 20, false},
		{"a size", Options{ChunkBytes: 8 << 20, ColdTaskBytes: 1 << 20, ColdReadAheadBytes: 4 << 20}.withDefaults(), false, 16 << 20, 1 << 20, true},
		{"default: off", off, false, 16 << 20, 1 << 20, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := tc.opts.coldAdvice(f, tc.direct, 0, tc.n, tc.task)
			defer a.stop()
			if (a != nil) != tc.want {
				t.Errorf("coldAdvice = %v, want advice %v", a != nil, tc.want)
			}
		})
	}
}

// TestColdAdvisorKeepsItsWindowWhenBehind: when the workers finish tasks
// the advisor has not reached yet (its advice blocked in the kernel, a
// disk queue full), the advisor goes on ahead of where the workers are,
// the full window, skipping the tasks already read. Before, a task
// finished before the advisor counted it was forgotten: the advisor next
// advised tasks already read and stayed that many tasks short of its
// window for the rest of the read.
func TestColdAdvisorKeepsItsWindowWhenBehind(t *testing.T) {
	const task, n, window = 1 << 20, 16 << 20, 2
	var mu sync.Mutex
	var got []int64
	calls := make(chan struct{}, 16)
	entered, gate := make(chan struct{}), make(chan struct{})
	a := adviseAhead(0, n, task, window*task, func(off, _ int64) {
		mu.Lock()
		got = append(got, off/task)
		mu.Unlock()
		if off == 0 {
			close(entered)
			<-gate // the first advice blocks until the workers are past it
		}
		calls <- struct{}{}
	})
	<-entered
	for range 3 { // the workers read tasks 0, 1 and 2 meanwhile
		a.taskDone()
	}
	close(gate)
	for range window + 1 {
		<-calls
	}
	a.stop()
	mu.Lock()
	defer mu.Unlock()
	if want := []int64{0, 3, 4}; !slices.Equal(got, want) {
		t.Fatalf("advised tasks %v, want %v (3 finished, %d ahead)", got, want, window)
	}
}
