package bench

import (
	"bytes"
	"io"
	"testing"

	"github.com/schollz/progressbar/v3"
)

// The writer under the spinner passes output on in whole lines only
// (tabwriter writes a table cell by cell), and flush writes the rest.
func TestClearingWriterWholeLines(t *testing.T) {
	var out bytes.Buffer
	bar := progressbar.NewOptions(-1, progressbar.OptionSetWriter(io.Discard))
	cw := &clearingWriter{bar: bar, w: &out}
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
