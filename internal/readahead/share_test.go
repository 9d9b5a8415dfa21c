package readahead

import "testing"

// lead records how far each key's windows reach past its READs.
type lead struct {
	ahead map[int]int64 // key -> end of what was read ahead
	most  map[int]int64 // key -> the most it was ahead of its READ right after one
}

func (l *lead) read(tr *Tracker[int], key int, owner uint32, lo, hi, size int64) {
	if l.ahead == nil {
		l.ahead, l.most = map[int]int64{}, map[int]int64{}
	}
	if r := tr.ReadAs(key, owner, lo, hi, size); r.Len() > 0 {
		l.ahead[key] = max(l.ahead[key], r.End)
	}
	l.most[key] = max(l.most[key], l.ahead[key]-hi)
}

// TestTrackerShare: the streams of one owner reading ahead at once share
// MaxBytes (each at least its READ's length), so that N workers' streams
// read ahead about MaxBytes in all, not N times it: what they have read
// ahead and not yet consumed is what the disk is idle for while they work
// through it at the end of their files (issue 15: cold 64 KiB samples, 8
// workers' streams 32 MiB ahead each). Another owner's stream, streams
// that reached the end of their files and streams forgotten leave the
// share.
func TestTrackerShare(t *testing.T) {
	const (
		size = 1 << 30
		n    = 4 * MiB // one READ: a group of 64 samples of 64 KiB
	)
	cases := []struct {
		name    string
		streams int                             // owner 1's streams reading in turn, from offset 0
		reads   int                             // READs of each
		after   func(l *lead, tr *Tracker[int]) // then
		key     int                             // the stream whose lead is checked
		want    int64                           // its largest lead at most
		atLeast int64                           // and at least
	}{
		{"one stream: the whole window", 1, 12, nil, 0, 32 * MiB, 28 * MiB},
		{"two streams: half each", 2, 12, nil, 1, 16 * MiB, 12 * MiB},
		{"eight streams: a READ's length each (32 MiB / 8 = 4 MiB)", 8, 12, nil, 7, n, n},
		{"sixteen streams: still a READ's length each", 16, 12, nil, 15, n, n},
		{"another owner's stream is not in the share", 8, 12, func(l *lead, tr *Tracker[int]) {
			for k := range 12 {
				l.read(tr, 100, 2, int64(k)*n, int64(k+1)*n, size)
			}
		}, 100, 32 * MiB, 28 * MiB},
		{"streams at the end of their files leave the share", 8, 12, func(l *lead, tr *Tracker[int]) {
			for key := range 7 {
				l.read(tr, key, 1, 12*n, 16*n, 16*n) // a file of 16 READs: its end
			}
			for k := 12; k < 24; k++ {
				l.read(tr, 7, 1, int64(k)*n, int64(k+1)*n, size)
			}
		}, 7, 32 * MiB, 28 * MiB},
		{"forgotten streams leave the share", 8, 12, func(l *lead, tr *Tracker[int]) {
			for key := range 7 {
				tr.Forget(key)
			}
			for k := 12; k < 24; k++ {
				l.read(tr, 7, 1, int64(k)*n, int64(k+1)*n, size)
			}
		}, 7, 32 * MiB, 28 * MiB},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tr := NewTracker[int](Config{})
			var l lead
			for k := range tc.reads {
				for key := range tc.streams {
					l.read(tr, key, 1, int64(k)*n, int64(k+1)*n, size)
				}
			}
			if tc.after != nil {
				clear(l.most) // the lead after it
				tc.after(&l, tr)
			}
			if got := l.most[tc.key]; got > tc.want || got < tc.atLeast {
				t.Errorf("stream %d read ahead up to %d MiB past its READs, want %d to %d MiB", tc.key, got/MiB, tc.atLeast/MiB, tc.want/MiB)
			}
			for key := range l.ahead { // every stream that read ahead
				tr.Forget(key)
			}
			if len(tr.live) != 0 {
				t.Errorf("every stream forgotten, still counted reading ahead: %v", tr.live)
			}
		})
	}
}

// TestTrackerStreamReadByAnotherOwner: one open file read by two owners
// (a descriptor passed to another uid's process: the daemon keys streams
// by the open file) never panics and keeps each owner's count of streams
// reading ahead exact, however the READs interleave; forgetting the
// stream leaves no count behind.
func TestTrackerStreamReadByAnotherOwner(t *testing.T) {
	const n = 4 * MiB
	for _, order := range [][]uint32{{1, 2}, {2, 1, 2}, {1, 1, 2, 2, 1}} {
		tr := NewTracker[int](Config{})
		for k := range 12 {
			owner := order[k%len(order)]
			tr.ReadAs(0, owner, int64(k)*n, int64(k+1)*n, 1<<30)
			tr.ReadAs(1, 1, int64(k)*n, int64(k+1)*n, 1<<30)
		}
		tr.mu.Lock()
		live := map[uint32]int{}
		for _, e := range tr.streams {
			if e.live() {
				live[e.owner]++
			}
		}
		for o, c := range tr.live {
			if live[o] != c {
				t.Errorf("order %v: owner %d counted %d streams reading ahead, has %d", order, o, c, live[o])
			}
		}
		tr.mu.Unlock()
		tr.Forget(0)
		tr.Forget(1)
		if len(tr.live) != 0 || len(tr.owners) != 0 {
			t.Errorf("order %v: after both streams are forgotten, counts %v %v left", order, tr.live, tr.owners)
		}
	}
}
