package ctlserver

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/gdsfs/gdsfs/cufile"
)

// TestReadaheadJobsPerUID: one uid's sequential READs of many cold files,
// whose readahead jobs do not finish (a slow disk), cannot take every
// readahead job: another uid's READ still gets its readahead started.
func TestReadaheadJobsPerUID(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 1 << 20, budgetBytes: 8 << 20, noIndexes: true})
	ra := e.srv.ra
	release := make(chan struct{})
	ra.fill = func(ctx context.Context, f *os.File, off, n int64) (int64, error) {
		<-release
		return n, nil
	}
	defer func() { close(release); ra.wg.Wait() }()
	buffered := cufile.NewHostEngine(cufile.Options{})
	sparse := func(name string) *os.File { // cold: a hole is never cached
		f, err := os.Create(filepath.Join(t.TempDir(), name))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		if err := f.Truncate(48 << 20); err != nil {
			t.Fatal(err)
		}
		return f
	}
	first := []span{{off: 0, length: 4096, valid: 4096, start: 0, end: 4096}}
	for i := range 2 * readaheadJobs {
		ra.afterRead(10002, sparse(fmt.Sprint("b", i)), buffered, first, 48<<20, false)
	}
	a := sparse("a")
	before := ra.started.Load()
	ra.afterRead(10001, a, buffered, first, 48<<20, false)
	if ra.started.Load() == before {
		t.Errorf("uid 10002 holds %d readahead jobs (of %d, %d dropped); uid 10001's READ got none",
			before, readaheadJobs, ra.dropped.Load())
	}
	if before > readaheadJobsPerUID {
		t.Errorf("uid 10002 started %d readahead jobs, more than its %d", before, readaheadJobsPerUID)
	}
}
