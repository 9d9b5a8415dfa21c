package ctl

import (
	"os"
	"sync"
	"syscall"
	"time"
)

// choiceTTL is how long the engine chosen for a file serves its later
// requests (WRITE, and READ with a chooser that is not a RangeChooser). The
// cufile chooser without nvidia-fs once measured how much of the whole file
// was in the page cache on every call (about 20 ms per GiB cached on a
// 2-core test machine), more than the transfer of an 8-32 MiB request; it
// now samples at most 8 MiB, and READs ask it about their own range
// (RangeChooser, not cached). The answer only picks the faster of two
// correct engines, so a second-old answer is good enough.
const choiceTTL = time.Second

// choiceShards and choiceMax bound the cache's lock contention and size.
const (
	choiceShards = 16
	choiceMax    = 1024 // entries per shard before the shard is cleared
)

// fileID identifies a backing file across descriptors.
type fileID struct{ dev, ino uint64 }

// choices caches EngineChooser answers per backing file for choiceTTL.
// Concurrent first requests for one file wait for one chooser call.
type choices struct {
	chooser EngineChooser
	ttl     time.Duration
	now     func() time.Time
	shards  [choiceShards]choiceShard
}

type choiceShard struct {
	mu      sync.Mutex
	entries map[fileID]*choice // GUARDED_BY(mu)
}

// choice is one file's cached answer; mu is held across the chooser call.
type choice struct {
	mu  sync.Mutex
	eng Engine    // GUARDED_BY(mu)
	why string    // GUARDED_BY(mu)
	at  time.Time // GUARDED_BY(mu): when eng was chosen
}

func newChoices(c EngineChooser, ttl time.Duration) *choices {
	cs := &choices{chooser: c, ttl: ttl, now: time.Now}
	for i := range cs.shards {
		cs.shards[i].entries = make(map[fileID]*choice)
	}
	return cs
}

// forFile returns the engine for f, identified by id, asking the chooser
// at most once per ttl per file.
func (cs *choices) forFile(f *os.File, id fileID, path string) (Engine, string) {
	if id == (fileID{}) {
		return cs.chooser.For(f, path) // identity unknown: nothing to cache by
	}
	sh := &cs.shards[id.ino%choiceShards]
	sh.mu.Lock()
	c := sh.entries[id]
	if c == nil {
		if len(sh.entries) >= choiceMax {
			clear(sh.entries)
		}
		c = &choice{}
		sh.entries[id] = c
	}
	sh.mu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	now := cs.now()
	if c.eng == nil || now.Sub(c.at) >= cs.ttl {
		c.eng, c.why = cs.chooser.For(f, path)
		c.at = now
	}
	return c.eng, c.why
}

// statFile returns the size and identity of the regular file f; anything
// else is ENOTTY (a data-file command on something that is not a data file).
func statFile(f *os.File) (int64, fileID, syscall.Errno) {
	if f == nil {
		return 0, fileID{}, syscall.ENOTTY
	}
	st, err := f.Stat()
	if err != nil {
		return 0, fileID{}, errnoOf(err)
	}
	if !st.Mode().IsRegular() {
		return 0, fileID{}, syscall.ENOTTY
	}
	var id fileID
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		id = fileID{dev: uint64(sys.Dev), ino: sys.Ino}
	}
	return st.Size(), id, 0
}
