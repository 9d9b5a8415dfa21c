package pinwarm

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/internal/usage"
)

// TestErr: every PIN errno becomes one line naming the file and what to
// do; the ones the user fixes by where the file lives are usage errors.
func TestErr(t *testing.T) {
	r := ctl.PinReply{Budget: 8 << 30, Used: 6 << 30, Yours: 1 << 30, Share: 2 << 30}
	for _, tc := range []struct {
		err   error
		want  string
		usage bool
	}{
		{syscall.ENOTTY, "f is not on a gdsfs mount", true},
		{syscall.EOPNOTSUPP, "mount it with --tier-budget SIZE", true},
		{syscall.E2BIG, "one user may hold 2.0 GiB of its 8.0 GiB (you hold 1.0 GiB)", false},
		{syscall.ENOSPC, "the tier is full (its 8.0 GiB budget) with pins of users holding no more than you would (you hold 1.0 GiB)", false},
		{syscall.ESTALE, "f changed while it was being pinned", false},
		{syscall.EPERM, "pinned by another user", false},
		{syscall.EACCES, "you can pin only files you may read", false},
		{syscall.EBADF, "you can pin only files you may read", false},
		{syscall.EIO, "f: pin: input/output error", false},
		{errors.New("odd"), "f: odd", false},
	} {
		err := Err("f", tc.err, r)
		if !strings.Contains(err.Error(), tc.want) || usage.Is(err) != tc.usage || strings.Contains(err.Error(), "\n") {
			t.Errorf("Err(%v) = %q (usage %v), want %q (usage %v)", tc.err, err, usage.Is(err), tc.want, tc.usage)
		}
	}
}

// TestPlanMemoryAndFits: a plan needs whole pages of what the tier lacks,
// and one that cannot fit the caller's share is refused before any PIN.
func TestPlanMemoryAndFits(t *testing.T) {
	for _, tc := range []struct {
		name  string
		files []File
		share uint64
		need  int64
		want  string // "" fits
	}{
		{"empty", nil, 0, 0, ""},
		{"held already", []File{{"a", 1 << 20, 1 << 20}}, 0, 0, ""},
		{"pages", []File{{"a", 1, 0}, {"b", 4097, 0}}, 3 * 4096, 3 * 4096, ""},
		{"one too big", []File{{"a", 8192, 0}}, 4096, 8192, "a needs 8.0 KiB"},
		{"many too big", []File{{"a", 4096, 0}, {"b", 4096, 0}}, 4096, 8192, "these files need 8.0 KiB"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &Plan{Files: tc.files, Last: ctl.PinReply{Share: tc.share}}
			if got := p.Memory(); got != tc.need {
				t.Errorf("Memory = %d, want %d", got, tc.need)
			}
			err := p.CheckFits()
			if (err == nil) != (tc.want == "") || err != nil && !strings.Contains(err.Error(), tc.want) {
				t.Errorf("CheckFits = %v, want %q", err, tc.want)
			}
		})
	}
}

// TestNewPlanOffAMount: a file not on a gdsfs mount fails the plan with a
// usage error; a path that does not exist is skipped, not fatal.
func TestNewPlanOffAMount(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := NewPlan(context.Background(), []string{p}); !usage.Is(err) || !strings.Contains(err.Error(), "is not on a gdsfs mount") {
		t.Fatalf("NewPlan(%s) = %v, want a usage error: not on a gdsfs mount", p, err)
	}
	plan, err := NewPlan(context.Background(), []string{filepath.Join(dir, "gone")})
	if err != nil || len(plan.Skipped) != 1 || len(plan.Files) != 0 {
		t.Fatalf("NewPlan(gone) = %+v, %v, want one skipped and no error", plan, err)
	}
}

// TestFillRefusesBadInput: no workers, or an extent size of 0 from the
// daemon (which would never advance), is an error, not a hang.
func TestFillRefusesBadInput(t *testing.T) {
	p := &Plan{Files: []File{{"a", 10, 0}}, Total: 10, Chunk: 4096}
	if _, err := p.Fill(context.Background(), 0, nil); err == nil {
		t.Error("Fill with 0 workers: no error")
	}
	p.Chunk = 0
	if _, err := p.Fill(context.Background(), 1, nil); err == nil {
		t.Error("Fill with extent size 0: no error")
	}
}
