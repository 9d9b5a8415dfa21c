// Package bench measures gdsfs against the direct access it must be judged
// against: suites of benchmarks, each a value (Suite) with a configuration
// struct, run one at a time or all together into one table (RunAll).
//
// A suite writes its own report and table to the writer it is given and
// returns one Result per measurement for the combined table: a gdsfs figure
// and its baseline in the same unit, higher is better. Suites run for
// minutes; WithProgress shows a spinner on a terminal meanwhile. The
// configurations' zero values are not usable: cmd/gdsfs sets them from
// `gdsfs bench` flags (their defaults are the flags'), and a suite's Run
// checks its configuration first, returning usage errors (internal/usage)
// that name the flag.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
)

// Suite is one suite of `gdsfs bench`.
type Suite struct {
	// Name is the suite's subcommand and its name in the combined table.
	Name string
	// Description says in one line what the suite measures.
	Description string
	// Run checks the suite's configuration, measures, writes the suite's
	// own report and table to out and returns its rows for the combined
	// table (also those measured before a failure, with the error).
	Run func(ctx context.Context, out io.Writer) ([]Result, error)
}

// Result is one row of the combined table of `gdsfs bench`: a figure of
// gdsfs and the figure of the baseline it is judged against, in the same
// unit (higher is better). A zero figure was not measured.
type Result struct {
	Suite       string
	Measurement string
	GDSFS       float64
	Baseline    float64
	Unit        string
	// Note names the baseline and says whether a goal was met, or why
	// nothing was measured.
	Note string
}

// Ratio is GDSFS/Baseline, or 0 when either is missing.
func (r Result) Ratio() float64 {
	if r.GDSFS <= 0 || r.Baseline <= 0 {
		return 0
	}
	return r.GDSFS / r.Baseline
}

// RunOne runs one suite, its report and table to out, under a spinner on
// errw when that is a terminal.
func RunOne(ctx context.Context, out, errw io.Writer, s Suite) error {
	if ctx == nil {
		ctx = context.Background()
	}
	return WithProgress(errw, s.Name, out, func(out io.Writer) error {
		_, err := s.Run(ctx, out)
		return err
	})
}

// RunAll runs every suite, their reports to errw, and prints the combined
// table to out. A suite that fails does not stop the others: its failure is
// a row of the table, and the error is returned after it.
func RunAll(ctx context.Context, out, errw io.Writer, suites []Suite) error {
	if ctx == nil {
		ctx = context.Background()
	}
	var all []Result
	var errs []error
	for _, s := range suites {
		fmt.Fprintf(errw, "== bench %s\n", s.Name)
		var rows []Result
		err := WithProgress(errw, s.Name, errw, func(w io.Writer) error {
			var err error
			rows, err = s.Run(ctx, w)
			return err
		})
		all = append(all, rows...)
		if err != nil {
			all = append(all, Result{Suite: s.Name, Measurement: "-", Note: "failed: " + err.Error()})
			errs = append(errs, fmt.Errorf("bench %s: %w", s.Name, err))
		}
		if ctx.Err() != nil {
			break // interrupted: show what was measured
		}
	}
	PrintResults(out, all)
	return errors.Join(errs...)
}

// PrintResults prints the combined table.
func PrintResults(out io.Writer, rows []Result) {
	figure := func(v float64) string {
		switch {
		case v <= 0:
			return "-"
		case v >= 100:
			return fmt.Sprintf("%.0f", v)
		default:
			return fmt.Sprintf("%.2f", v)
		}
	}
	table := [][]string{{"suite", "measurement", "gdsfs", "baseline", "unit", "ratio", "note"}}
	for _, r := range rows {
		ratio := "-"
		if q := r.Ratio(); q > 0 {
			ratio = fmt.Sprintf("%.2f", q)
		}
		table = append(table, []string{r.Suite, r.Measurement, figure(r.GDSFS), figure(r.Baseline), orDash(r.Unit), ratio, orDash(r.Note)})
	}
	printTable(out, false, table)
}

// goalWord says whether a goal was met, for the notes of the combined table.
func goalWord(met bool) string {
	if met {
		return "met"
	}
	return "NOT met"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
