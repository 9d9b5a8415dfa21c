package bench

import (
	"bytes"
	"io"
	"runtime"
	"testing"
)

// The writer under the spinner passes output on in whole lines only
// (tabwriter writes a table cell by cell), and flush writes the rest.
func TestClearingWriterWholeLines(t *testing.T) {
	var out bytes.Buffer
	cw := &clearingWriter{bar: newSpinner(io.Discard, "test"), w: &out}
	steps := []struct {
		write, want string
	}{
		{"measurement", ""},
		{"\tunit", ""},
		{"\n", "measurement\tunit\n"},
		{"a\tb\nc", "measurement\tunit\na\tb\n"},
		{"\td\ne", "measurement\tunit\na\tb\nc\td\n"},
	}
	for _, s := range steps {
		cw.tick()
		if n, err := cw.Write([]byte(s.write)); n != len(s.write) || err != nil {
			t.Fatalf("Write(%q) = %d, %v", s.write, n, err)
		}
		if out.String() != s.want {
			t.Fatalf("after Write(%q): %q, want %q", s.write, out.String(), s.want)
		}
	}
	cw.flush()
	if want := "measurement\tunit\na\tb\nc\td\ne"; out.String() != want {
		t.Errorf("after flush: %q, want %q", out.String(), want)
	}
}

// The spinner draws only when the suite's ticker advances it, under the
// clearingWriter's lock: the library's own redraw goroutine drew without
// it and raced with Clear (seen under -race).
func TestSpinnerHasNoRedrawGoroutine(t *testing.T) {
	before := runtime.NumGoroutine()
	bar := newSpinner(io.Discard, "test")
	defer bar.Finish()
	if err := bar.Add(1); err != nil {
		t.Fatal(err)
	}
	if n := runtime.NumGoroutine(); n > before {
		t.Errorf("%d goroutines after making the spinner, %d before: it redraws on its own", n, before)
	}
}
