package ctlserver

import (
	"testing"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/fs"
)

var _ fs.FileCloser = (*Server)(nil)

// TestReadaheadForgetsClosedFile: the FUSE release of an open forgets its
// stream. Kept, a stream closed mid-file (a run ended or killed mid-shard)
// stayed "reading ahead" until a full table evicted it, and divided its
// uid's --readahead among every such stream of files long closed.
func TestReadaheadForgetsClosedFile(t *testing.T) {
	e := newEnv(t, envOptions{slabBytes: 16 << 20, budgetBytes: 64 << 20, noIndexes: true})
	buffered := cufile.NewHostEngine(cufile.Options{})
	for _, name := range []string{"a.bin", "b.bin", "c.bin"} {
		f, _ := e.coldFile(name, 8<<20)
		for j := range int64(3) { // a sequential run, stopped mid-file
			off := j * 64 << 10
			e.srv.ra.afterRead(1000, f, buffered, []span{{off: off, length: 64 << 10, valid: 64 << 10, start: off, end: off + 64<<10}}, 8<<20, false)
		}
		if got := e.srv.ra.t.Len(); got != 1 {
			t.Fatalf("%s read: %d streams, want 1", name, got)
		}
		e.srv.ra.wg.Wait()
		e.srv.FileClosed(f)
		f.Close()
		if got := e.srv.ra.t.Len(); got != 0 {
			t.Fatalf("%s closed: %d streams remembered, want 0", name, got)
		}
	}
	e.srv.FileClosed(nil) // a handle the control path never saw
}
