package reader

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/usage"
)

// Without an index, gdsfs index gives the daemon's reason (user.gdsfs.info's
// index_error) rather than re-parsing the file here.
func TestNoIndexErrorFromInfo(t *testing.T) {
	p := filepath.Join(t.TempDir(), "x.tar")
	if err := os.WriteFile(p, []byte("not a tar at all"), 0o644); err != nil {
		t.Fatal(err)
	}
	info := []byte(`{"type":"file","format":"","index_error":"cache: not a valid tar: the daemon's reason"}`)
	if err := unix.Setxattr(p, "user.gdsfs.info", info, 0); err != nil {
		t.Skipf("user xattrs on %s: %v", p, err)
	}
	err := noIndexError(p)
	var ue usage.Error
	if err == nil || !strings.Contains(err.Error(), "the daemon's reason") || !errors.As(err, &ue) {
		t.Errorf("noIndexError = %v, want a usage error with the daemon's index_error", err)
	}
	if want := p + ": not a valid tar: the daemon's reason; the file is truncated or corrupt: write it again"; err == nil || err.Error() != want {
		t.Errorf("noIndexError = %v, want %q (no package prefix, what to do)", err, want)
	}
	for doc, want := range map[string]string{`{"index_error":"why"}`: "why", `{"format":"tar"}`: "", `nope`: ""} {
		if got := indexErrorOf([]byte(doc)); got != want {
			t.Errorf("indexErrorOf(%s) = %q, want %q", doc, got, want)
		}
	}
}
