package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
)

// tableRows splits a table printed by tabwriter (columns two or more
// spaces apart) into its rows' cells, the header first.
func tableRows(s string) [][]string {
	sep := regexp.MustCompile(`\s{2,}`)
	var rows [][]string
	for _, l := range strings.Split(strings.TrimRight(s, "\n"), "\n") {
		rows = append(rows, sep.Split(strings.TrimSpace(l), -1))
	}
	return rows
}

// fastBench is `gdsfs bench` with every suite configured to take a
// second or so.
func fastBench(t *testing.T) *cobra.Command {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("bench mount mounts FUSE: needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse on this host")
	}
	dir := t.TempDir()
	fast := map[string][]string{
		"mount":   {"--dir", dir, "--size", "1MiB", "--files", "20", "--random-reads", "50", "--runs", "1"},
		"engines": {"--file", filepath.Join(dir, "engines.dat"), "--size", "4MiB", "--threads", "2", "--runs", "1", "--no-cold"},
	}
	cmd := newBenchCmd()
	for _, s := range cmd.Commands() {
		args, ok := fast[s.Name()]
		if !ok {
			t.Fatalf("suite %q has no fast configuration in this test", s.Name())
		}
		if err := s.ParseFlags(args); err != nil {
			t.Fatal(err)
		}
	}
	return cmd
}

// `gdsfs bench` runs every suite and ends with one table on stdout, a row
// per measurement with its baseline; the suites' own reports go to stderr.
func TestBenchAllEndsWithOneTable(t *testing.T) {
	cmd := fastBench(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errw bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errw)
	cmd.SetArgs(nil)
	if err := cmd.ExecuteContext(ctx); err != nil {
		t.Fatalf("gdsfs bench: %v\nstdout:\n%s\nstderr:\n%s", err, out.String(), errw.String())
	}
	t.Logf("stdout:\n%s", out.String())
	rows := tableRows(out.String())
	if want := []string{"suite", "measurement", "gdsfs", "baseline", "unit", "ratio", "note"}; fmt.Sprint(rows[0]) != fmt.Sprint(want) {
		t.Fatalf("first line %q, want the table header %q", rows[0], want)
	}
	measured := map[string]bool{}
	for _, r := range rows[1:] {
		if len(r) < 6 || r[0] == "suite" {
			t.Errorf("not a row of the one table: %q", r)
			continue
		}
		if strings.HasPrefix(r[len(r)-1], "skipped") || (r[0] == "engines" && r[1] == "cold runs") {
			continue
		}
		gdsfs, err1 := strconv.ParseFloat(r[2], 64)
		base, err2 := strconv.ParseFloat(r[3], 64)
		ratio, err3 := strconv.ParseFloat(r[5], 64)
		if err := errors.Join(err1, err2, err3); err != nil || gdsfs <= 0 || base <= 0 || ratio <= 0 {
			t.Errorf("row %q: want a gdsfs figure, a baseline and their ratio (%v)", r, err)
		}
		measured[r[0]+": "+r[1]] = true
	}
	for _, m := range []string{"mount: sequential read, warm", "mount: stat 20 files, first", "engines: host engine, warm"} {
		if !measured[m] {
			t.Errorf("no measured row %q in the table", m)
		}
	}
	// The suites' own tables went to stderr, not into the one table.
	for _, s := range []string{"== bench mount", "passthrough:", "== bench engines"} {
		if !strings.Contains(errw.String(), s) {
			t.Errorf("stderr lacks %q:\n%s", s, errw.String())
		}
	}
	if !regexp.MustCompile(`(?m)^ *host +warm +[0-9.]+ +[0-9.]+ +vs pread-slab +engine *$`).MatchString(errw.String()) {
		t.Errorf("stderr lacks bench engines' own table:\n%s", errw.String())
	}
}

// A suite run alone prints its own table to stdout, the lines
// scripts/gpu-test.sh greps among them.
func TestBenchEnginesAloneOwnTable(t *testing.T) {
	cmd := fastBench(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out, errw bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errw)
	cmd.SetArgs([]string{"engines"})
	if err := cmd.ExecuteContext(ctx); err != nil {
		t.Fatalf("gdsfs bench engines: %v\n%s", err, errw.String())
	}
	s := out.String()
	if !regexp.MustCompile(`(?m)^ *read +mode +GB/s +ratio +note *$`).MatchString(s) {
		t.Errorf("no table header in:\n%s", s)
	}
	for _, name := range []string{"pread2-memory", "pread2-slab", "host"} {
		if !regexp.MustCompile(`(?m)^ *` + name + ` +warm +[0-9.]+ `).MatchString(s) {
			t.Errorf("no %s row in:\n%s", name, s)
		}
	}
	if strings.Contains(s, "suite") {
		t.Errorf("the combined table's header in a suite's own output:\n%s", s)
	}
}
