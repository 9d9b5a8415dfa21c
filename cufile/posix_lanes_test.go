package cufile

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestPosixBrokenLaneWakesWaiter checks that a transfer waiting for a lane
// (all Workers lanes in use) gets one when a lane in use breaks: the broken
// lane's room is handed on. It once stayed blocked until its context ended,
// which for an ioctl without a deadline is never.
func TestPosixBrokenLaneWakesWaiter(t *testing.T) {
	st := &fakeStager{failH2DAt: -1, syncErr: errors.New("fake: illegal address")}
	e := newPosixEngine(st, Options{Workers: 1, Direct: "never"})
	held, err := e.acquire(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	got := make(chan error, 1)
	go func() {
		l, err := e.acquire(ctx, 0)
		if err == nil && l == held {
			err = errors.New("got the broken lane")
		}
		got <- err
	}()
	// Let the waiter find no room and block on the free list; were it to
	// arrive later, it would find room of its own and not test the wake-up.
	time.Sleep(100 * time.Millisecond)
	w := &pipeWorker{e: e, device: 0, l: held, pending: []bool{true}}
	if err := w.finish(); err == nil {
		t.Fatal("finish succeeded despite a stream error")
	}
	if !held.(*fakeLane).closed {
		t.Error("the broken lane was not closed")
	}
	if err := <-got; err != nil {
		t.Fatalf("waiting acquire after a lane broke: %v", err)
	}
}

// TestPosixFailedLaneAllocationKeepsRoom checks that a failed staging
// allocation leaves room for a later one.
func TestPosixFailedLaneAllocationKeepsRoom(t *testing.T) {
	st := &failingStager{fakeStager: &fakeStager{failH2DAt: -1}, fail: 1}
	e := newPosixEngine(st, Options{Workers: 1, Direct: "never"})
	if _, err := e.acquire(context.Background(), 0); err == nil {
		t.Fatal("acquire succeeded despite a failed allocation")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := e.acquire(ctx, 0); err != nil {
		t.Fatalf("acquire after a failed allocation: %v", err)
	}
}

// failingStager fails its first fail lane allocations.
type failingStager struct {
	*fakeStager
	fail int
}

func (s *failingStager) newLane(device, slots int, bufBytes int64) (lane, error) {
	if s.fail > 0 {
		s.fail--
		return nil, errors.New("fake: out of pinned memory")
	}
	return s.fakeStager.newLane(device, slots, bufBytes)
}
