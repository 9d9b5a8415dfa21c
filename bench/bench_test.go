package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"
	"strings"
	"testing"

	"github.com/gdsfs/gdsfs/internal/usage"
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

// fakeSuite prints its own table and returns rows, or fails.
func fakeSuite(name string, rows []Result, err error) Suite {
	return Suite{
		Name: name,
		Run: func(_ context.Context, out io.Writer) ([]Result, error) {
			fmt.Fprintf(out, "own table of %s\n", name)
			return rows, err
		},
	}
}

// A failing suite does not stop the others; its failure is a row of the
// one table, and the command fails after printing it.
func TestRunBenchSuitesOneTable(t *testing.T) {
	broken := errors.New("no /dev/shm")
	suites := []Suite{
		fakeSuite("a", []Result{
			{Suite: "a", Measurement: "reads", GDSFS: 900, Baseline: 1000, Unit: "MB/s", Note: "vs direct"},
			{Suite: "a", Measurement: "cold", Unit: "MB/s", Note: "skipped: not root"},
		}, nil),
		fakeSuite("b", nil, broken),
		fakeSuite("c", []Result{{Suite: "c", Measurement: "host engine, warm", GDSFS: 3.5, Baseline: 2.5, Unit: "GB/s"}}, nil),
	}
	var out, errw bytes.Buffer
	err := RunAll(context.Background(), &out, &errw, suites)
	if !errors.Is(err, broken) {
		t.Errorf("error %v, want the failed suite's", err)
	}
	want := [][]string{
		{"suite", "measurement", "gdsfs", "baseline", "unit", "ratio", "note"},
		{"a", "reads", "900", "1000", "MB/s", "0.90", "vs direct"},
		{"a", "cold", "-", "-", "MB/s", "-", "skipped: not root"},
		{"b", "-", "-", "-", "-", "-", "failed: no /dev/shm"},
		{"c", "host engine, warm", "3.50", "2.50", "GB/s", "1.40", "-"},
	}
	if got := tableRows(out.String()); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("table:\n%s\nwant rows %q", out.String(), want)
	}
	for _, s := range []string{"== bench a", "own table of a", "== bench b", "own table of c"} {
		if !strings.Contains(errw.String(), s) {
			t.Errorf("stderr lacks %q:\n%s", s, errw.String())
		}
	}
}

// A suite's configuration is checked when it runs: bad values are usage
// errors naming the flag, before anything is measured or created.
func TestSuiteConfigErrors(t *testing.T) {
	dir := t.TempDir()
	mount := func(mod func(*MountConfig)) Suite {
		c := &MountConfig{Dir: dir, Size: "1MiB", Files: 1, RandomReads: 1, Runs: 1}
		mod(c)
		return Mount(c)
	}
	engines := func(mod func(*EnginesConfig)) Suite {
		c := &EnginesConfig{Size: "1MiB", Threads: 1, Runs: 1}
		mod(c)
		return Engines(c)
	}
	for _, tc := range []struct {
		name  string
		suite Suite
		want  string
	}{
		{"mount size", mount(func(c *MountConfig) { c.Size = "1KiB" }), `--size "1KiB": give a size of at least 1MiB`},
		{"mount runs", mount(func(c *MountConfig) { c.Runs = 0 }), "--files, --random-reads and --runs must be at least 1"},
		{"engines size", engines(func(c *EnginesConfig) { c.Size = "lots" }), `--size "lots": give a size from 1MiB to 1TiB`},
		{"engines threads", engines(func(c *EnginesConfig) { c.Threads = 300 }), "--threads 300: give 1 to 256"},
		{"engines runs", engines(func(c *EnginesConfig) { c.Runs = 0 }), "--runs 0: give 1 to 100"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			rows, err := tc.suite.Run(context.Background(), &out)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !usage.Is(err) {
				t.Errorf("Run = %v, want a usage error containing %q", err, tc.want)
			}
			if len(rows) != 0 || out.Len() != 0 {
				t.Errorf("a rejected configuration measured: %v, %q", rows, out.String())
			}
		})
	}
}
