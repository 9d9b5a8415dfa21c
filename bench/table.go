package bench

import (
	"io"
	"strings"
	"text/tabwriter"
)

// printTable is the one table printer of package bench: rows of cells, the
// header first, columns two spaces apart. A suite's own table (right: its
// figures aligned on their last digit) terminates the last cell of each row
// too, so that the last column aligns as well; the combined table is
// left-aligned.
func printTable(out io.Writer, right bool, rows [][]string) {
	flags, end := uint(0), "\n"
	if right {
		flags, end = tabwriter.AlignRight, "\t\n"
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', flags)
	for _, r := range rows {
		io.WriteString(tw, strings.Join(r, "\t")+end)
	}
	tw.Flush()
}
