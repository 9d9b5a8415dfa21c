package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/internal/pagecache"
)

// evict drops p's pages from the page cache (ext4 honours DONTNEED for
// clean pages).
func evict(t *testing.T, p string) {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
}

func residentOf(t *testing.T, p string) int64 {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return (&pagecache.Plan{Files: []pagecache.File{{Path: p, Size: st.Size()}}}).Resident()
}

// runWarmCmd runs `gdsfs warm args...` in process and returns its stdout.
func runWarmCmd(ctx context.Context, t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newWarmCmd()
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(ctx)
	return out.String(), err
}

func TestWarmReadsOnlyWhatIsNotCached(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "a", "big")
	if err := os.MkdirAll(filepath.Dir(big), 0o755); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("0123456789abcdef"), (20<<20)/16+123) // not page-aligned
	if err := os.WriteFile(big, data, 0o644); err != nil {
		t.Fatal(err)
	}
	small := filepath.Join(dir, "small")
	if err := os.WriteFile(small, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "empty"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	evict(t, big)
	evict(t, small)
	if r := residentOf(t, big); r == int64(len(data)) {
		t.Skip("this filesystem keeps pages cached despite FADV_DONTNEED (tmpfs?)")
	}

	out, err := runWarmCmd(context.Background(), t, "--progress", "never", dir)
	if err != nil {
		t.Fatalf("warm: %v\n%s", err, out)
	}
	if !strings.Contains(out, "warmed 3 files") || !strings.Contains(out, "(100.0%)") {
		t.Errorf("first warm said %q, want 3 files, 100%% cached", out)
	}
	if r := residentOf(t, big); r != int64(len(data)) {
		t.Errorf("after warm %d of %d bytes cached", r, len(data))
	}

	// Resume: evict the second half only; warm reads just that.
	f, err := os.Open(big)
	if err != nil {
		t.Fatal(err)
	}
	half := int64(len(data)/2) &^ 4095
	if err := unix.Fadvise(int(f.Fd()), half, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
	f.Close()
	out, err = runWarmCmd(context.Background(), t, "--progress", "never", big)
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`read ([0-9.]+ [KMG]?i?B)`).FindStringSubmatch(out)
	if m == nil || m[1] != "10 MiB" {
		t.Errorf("resumed warm said %q, want it to read the evicted 10 MiB", out)
	}

	// Fully cached: nothing to read.
	out, err = runWarmCmd(context.Background(), t, "--progress", "never", big, big)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "read 0 B") || !strings.Contains(out, "warmed 1 files") {
		t.Errorf("warm of a cached file (named twice) said %q, want read 0 B of 1 file", out)
	}
}

func TestWarmInterrupted(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, make([]byte, 8<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	evict(t, p)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	out, err := runWarmCmd(ctx, t, "--progress", "never", dir)
	if err == nil {
		t.Fatalf("warm with a cancelled context succeeded: %q", out)
	}
}

func TestWarmUsageErrors(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"missing path", []string{filepath.Join(dir, "nope")}, "does not exist; name files or directories to warm"},
		{"workers zero", []string{"--workers", "0", dir}, "--workers 0: give 1 to 256"},
		{"bad progress", []string{"--progress", "loud", dir}, `--progress "loud": use auto, always or never`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := runWarmCmd(context.Background(), t, tt.args...)
			var ue usageError
			if err == nil || !strings.Contains(err.Error(), tt.want) || !errors.As(err, &ue) {
				t.Errorf("warm %v: %v, want a usage error containing %q", tt.args, err, tt.want)
			}
		})
	}
}
