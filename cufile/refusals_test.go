package cufile

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"
)

// TestRefusalsLogOncePerCause: a dataset's worth of files refused for the
// same cause on one filesystem gives one log line and a count, and another
// cause gets its own line.
func TestRefusalsLogOncePerCause(t *testing.T) {
	var buf bytes.Buffer
	r := newRefusals(zerolog.New(&buf))
	dir := t.TempDir()
	reg := &FileError{Op: "cuFileHandleRegister", Code: fileHandleNotRegistered}
	for i := 0; i < 50; i++ {
		p := filepath.Join(dir, "shard")
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		r.note(f, p, reg, "cufile: cuFile refused file; serving it with the posix engine", refusalHint(reg))
		f.Close()
	}
	r.note(nil, "/x", errors.New("other cause"), "cufile: cuFile failed on file", refusalHint(errors.New("x")))
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 2 {
		t.Fatalf("50 refusals for one cause and 1 for another logged %d lines, want 2:\n%s", len(lines), buf.String())
	}
	if !strings.Contains(lines[0], "udev") {
		t.Errorf("5027 refusal line has no udev hint: %s", lines[0])
	}
	got := r.list()
	if len(got) != 2 || got[0].Files != 50 || got[1].Files != 1 || !strings.Contains(got[0].Cause, "5027") {
		t.Errorf("refusal counts %+v, want 50 for the 5027 cause then 1", got)
	}
}
