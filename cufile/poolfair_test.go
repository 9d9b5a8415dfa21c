package cufile

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"
)

// waitQueued waits until at least n transfers wait for a pool thread,
// failing after 10 s.
func waitQueued(t *testing.T, p *threadPool, n int64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for p.queued.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d transfers wait for a pool thread after 10 s, want %d", p.queued.Load(), n)
		}
		runtime.Gosched()
	}
}

// TestGDSPoolStuckCallerStarvesNoOne: one caller's READs that never end
// (its file is on a hung filesystem: every cuFileRead into its slabs
// blocks) hold every pool thread, and more of them wait; another caller's
// READ of another file still completes with its bytes, as it did when
// each transfer had threads of its own. Before, it waited for a pool
// thread until its context ended.
func TestGDSPoolStuckCallerStarvesNoOne(t *testing.T) {
	const (
		workers = 4
		size    = 1 << 20
	)
	before := runtime.NumGoroutine()
	hung, _ := randomCachedFile(t, size)
	f, data := randomCachedFile(t, size)
	tf := newThreadCuFile(t)
	tf.gate, tf.entered = make(chan struct{}), make(chan struct{}, 256)
	stuck := make([]*fakeCuSlab, poolThreads(workers)/workers+1)
	tf.gated = map[uintptr]bool{}
	for i := range stuck {
		stuck[i] = tf.slab(size)
		tf.gated[stuck[i].ptr] = true
	}
	other := tf.slab(size)
	g := poolTestEngine(t, tf, workers)
	g.pool.spillAfter = spillAfter // the daemon's
	res := make(chan error, len(stuck))
	for _, m := range stuck {
		go func() {
			_, err := g.ReadAt(context.Background(), hung, m, 0, 0, size)
			res <- err
		}()
	}
	for range poolThreads(workers) { // every pool thread is in a cuFileRead that does not return
		<-tf.entered
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	got, err := g.ReadAt(ctx, f, other, 0, 0, size)
	cancel()
	if err != nil || got != size || !bytes.Equal(other.data, data) {
		t.Errorf("another caller's READ while the pool's threads are stuck = %d, %v (bytes equal %v); want %d bytes of its file", got, err, bytes.Equal(other.data, data), size)
	}
	close(tf.gate)
	for range stuck {
		if err := <-res; err != nil {
			t.Errorf("a stuck READ, once its filesystem answers: %v", err)
		}
	}
	g.Close()
	goroutinesBack(t, before)
}

// TestGDSPoolTakesTurns: one caller's huge READs on slow storage hold
// every pool thread; another caller's small READ gets a thread at the
// next chunk that ends, not once one of the huge READs has moved all its
// chunks: pool threads take chunks of the transfers in turn, the longest
// waiting first. (The spill to threads of its own is kept out of it.)
func TestGDSPoolTakesTurns(t *testing.T) {
	const (
		workers = 4
		chunks  = 64 // of the engine's 64 KiB, per huge READ
		size    = chunks << 16
	)
	f, data := randomCachedFile(t, size)
	tf := newThreadCuFile(t)
	tf.gate, tf.entered = make(chan struct{}), make(chan struct{}, 4*chunks)
	huge := make([]*fakeCuSlab, poolThreads(workers)/workers)
	tf.gated = map[uintptr]bool{}
	for i := range huge {
		huge[i] = tf.slab(size)
		tf.gated[huge[i].ptr] = true
	}
	small := tf.slab(64 << 10)
	g := poolTestEngine(t, tf, workers) // no spill: the turn must serve it
	res := make(chan error, len(huge))
	for _, m := range huge {
		go func() {
			_, err := g.ReadAt(context.Background(), f, m, 0, 0, size)
			res <- err
		}()
	}
	for range poolThreads(workers) {
		<-tf.entered
	}
	done := make(chan error, 1)
	go func() {
		got, err := g.ReadAt(context.Background(), f, small, 0, 0, 64<<10)
		if err == nil && (got != 64<<10 || !bytes.Equal(small.data, data[:64<<10])) {
			err = fmt.Errorf("ReadAt = %d (bytes equal %v)", got, bytes.Equal(small.data, data[:64<<10]))
		}
		done <- err
	}()
	waitQueued(t, g.pool, 1)
	released := 0
wait:
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("the small READ: %v", err)
			}
			break wait
		case tf.gate <- struct{}{}: // one huge READ's chunk ends
			released++
		}
	}
	t.Logf("the small READ got a thread after %d of the huge READs' chunks ended", released)
	if released > chunks/2 {
		t.Errorf("the small READ waited for %d chunks of the huge READs to end (of %d each); want a turn at the next one", released, chunks)
	}
	close(tf.gate)
	for range huge {
		if err := <-res; err != nil {
			t.Errorf("a huge READ: %v", err)
		}
	}
}
