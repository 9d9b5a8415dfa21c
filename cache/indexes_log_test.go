package cache

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"
)

// A corrupt shard is logged once per file identity, with the reason, not on
// every lookup (the error is cached), and again once the file changes.
func TestIndexesLogCorruptOnce(t *testing.T) {
	var logs bytes.Buffer
	x, err := NewIndexes(16<<20, zerolog.New(&logs))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.Close)
	bad := filepath.Join(t.TempDir(), "bad.safetensors")
	writeFile(t, bad, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'})
	for range 3 {
		if _, err := getPath(context.Background(), x, bad); !errors.Is(err, ErrInvalid) {
			t.Fatalf("Get = %v, want ErrInvalid", err)
		}
	}
	if n := strings.Count(logs.String(), "corrupt shard"); n != 1 || !strings.Contains(logs.String(), bad) {
		t.Fatalf("%d log lines for one corrupt file, want 1 naming it:\n%s", n, logs.String())
	}
	writeFile(t, bad, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}', ' '})
	x.Invalidate(bad)
	if _, err := getPath(context.Background(), x, bad); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Get = %v, want ErrInvalid", err)
	}
	if n := strings.Count(logs.String(), "corrupt shard"); n != 2 {
		t.Errorf("%d log lines after the file changed, want 2", n)
	}
}
