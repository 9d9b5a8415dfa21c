package readahead

import "testing"

// TestTrackerOwners: one owner (a uid) reading many more files than the
// table holds forgets its own streams, not another owner's: the other's
// sequential run goes on reading ahead.
func TestTrackerOwners(t *testing.T) {
	const MiB = 1 << 20
	tr := NewTracker[int](Config{Streams: 8})
	// uid 10001's run, mid-file (a new stream there reads nothing ahead).
	tr.ReadAs(1, 10001, 10*MiB, 11*MiB, 1<<30)
	if r := tr.ReadAs(1, 10001, 11*MiB, 12*MiB, 1<<30); r.Len() == 0 {
		t.Fatal("uid 10001's sequential READs read nothing ahead")
	}
	for k := range 100 { // uid 10002's opens, each READ once
		tr.ReadAs(100+k, 10002, 0, MiB, 1<<30)
	}
	if n := tr.Len(); n > 8 {
		t.Errorf("%d streams remembered, the table holds 8", n)
	}
	if r := tr.ReadAs(1, 10001, 12*MiB, 13*MiB, 1<<30); r.Len() == 0 {
		t.Error("uid 10002's 100 opens made the table forget uid 10001's stream: its run read nothing ahead")
	}
	// Alone, an owner may still use the whole table.
	solo := NewTracker[int](Config{Streams: 4})
	for k := range 4 {
		solo.ReadAs(k, 7, 0, MiB, 1<<30)
	}
	if n := solo.Len(); n != 4 {
		t.Errorf("one owner's 4 opens: %d streams remembered, want 4", n)
	}
}
