package reader

import (
	"bytes"
	"testing"

	"github.com/gdsfs/gdsfs/internal/usage"
)

// TestPrintInfo: the known fields in their order and labels, numbers as
// integers, empty strings as "-", newer fields after them sorted.
func TestPrintInfo(t *testing.T) {
	doc := []byte(`{"zeta":1,"engine":"host","reason":"","size":12345678901,"type":"file","path":"/b/x","alpha":"a"}`)
	var out bytes.Buffer
	if err := PrintInfo(&out, "/m/x", doc); err != nil {
		t.Fatal(err)
	}
	want := "/m/x\n" +
		"  type:       file\n" +
		"  size:       12345678901\n" +
		"  engine:     host\n" +
		"  why:        -\n" +
		"  backing:    /b/x\n" +
		"  alpha:      a\n" +
		"  zeta:       1\n"
	if out.String() != want {
		t.Errorf("got:\n%s\nwant:\n%s", out.String(), want)
	}
	if err := PrintInfo(&out, "/m/x", []byte("not json")); err == nil {
		t.Error("a document that is not JSON: no error")
	}
	if _, err := Info(t.TempDir() + "/missing"); !usage.Is(err) {
		t.Errorf("Info of a missing path: %v, want a usage error", err)
	}
}
