package walk

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"testing"
)

func TestFiles(t *testing.T) {
	dir := t.TempDir()
	for _, p := range []string{"a", "sub/b", "sub/deeper/c"} {
		full := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(p), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("a", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing")
	tests := []struct {
		name     string
		paths    []string
		want     []string
		skipped  int
		stopWith error
		wantErr  bool
	}{
		{name: "a tree, symlinks left out", paths: []string{dir}, want: []string{"a", "sub/b", "sub/deeper/c"}},
		{name: "a file reached twice counts once", paths: []string{filepath.Join(dir, "a"), dir}, want: []string{"a", "sub/b", "sub/deeper/c"}},
		{name: "a missing path is skipped", paths: []string{missing, filepath.Join(dir, "sub")}, want: []string{"sub/b", "sub/deeper/c"}, skipped: 1},
		{name: "fn's error stops the walk", paths: []string{dir}, stopWith: errors.New("stop"), wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			skipped, err := Files(context.Background(), tt.paths, func(p string) error {
				if tt.stopWith != nil {
					return tt.stopWith
				}
				rel, _ := filepath.Rel(dir, p)
				got = append(got, rel)
				return nil
			})
			if (err != nil) != tt.wantErr || (tt.stopWith != nil && !errors.Is(err, tt.stopWith)) {
				t.Fatalf("err = %v, want error %v", err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			sort.Strings(got)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("files = %v, want %v", got, tt.want)
			}
			if len(skipped) != tt.skipped {
				t.Errorf("skipped = %v, want %d", skipped, tt.skipped)
			}
		})
	}
}

func TestFilesStopsWhenCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := Files(ctx, []string{t.TempDir()}, func(string) error { return nil })
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}
