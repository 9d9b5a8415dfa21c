package pagecache

import (
	"context"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
)

// A plan covers every regular file once; Warm reads exactly its missing
// ranges and leaves them cached.
func TestPlanWarm(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "a", "big")
	if err := os.MkdirAll(filepath.Dir(big), 0o755); err != nil {
		t.Fatal(err)
	}
	const size = 3*ChunkBytes + 777 // several chunks, not page-aligned
	if err := os.WriteFile(big, make([]byte, size), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "empty"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(big)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	needCachestat(t, f)
	drop(t, f, ChunkBytes, 0)

	plan, err := NewPlan(context.Background(), []string{dir, big})
	if err != nil {
		t.Fatal(err)
	}
	if len(plan.Files) != 2 || plan.TotalBytes != size || len(plan.Skipped) != 0 {
		t.Fatalf("plan: %d files, %d bytes, skipped %v; want 2 files, %d bytes", len(plan.Files), plan.TotalBytes, plan.Skipped, size)
	}
	if want := int64(size - ChunkBytes); plan.ToReadBytes != want || plan.ResidentBytes != ChunkBytes {
		t.Errorf("plan: read %d, resident %d; want %d and %d", plan.ToReadBytes, plan.ResidentBytes, want, ChunkBytes)
	}
	var seen atomic.Int64
	read, err := plan.Warm(context.Background(), 3, func(n int64) { seen.Add(n) })
	if err != nil {
		t.Fatal(err)
	}
	if read != plan.ToReadBytes || seen.Load() != read {
		t.Errorf("Warm read %d (progress saw %d), want %d", read, seen.Load(), plan.ToReadBytes)
	}
	if r := plan.Resident(); r != size {
		t.Errorf("after Warm %d of %d bytes cached", r, size)
	}
}

func TestWarmCancelled(t *testing.T) {
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, make([]byte, 4*ChunkBytes), 0o644); err != nil {
		t.Fatal(err)
	}
	plan := &Plan{Files: []File{{Path: p, Size: 4 * ChunkBytes, Ranges: []Range{{0, 4 * ChunkBytes}}}}, ToReadBytes: 4 * ChunkBytes}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	read, err := plan.Warm(ctx, 2, nil)
	if err != nil || read != 0 {
		t.Errorf("cancelled Warm = %d, %v; want nothing read and no error", read, err)
	}
	if _, err := plan.Warm(context.Background(), 0, nil); err == nil {
		t.Error("Warm with 0 workers succeeded")
	}
}
