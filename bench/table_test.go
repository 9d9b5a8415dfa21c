package bench

import (
	"bytes"
	"testing"
)

func TestPrintTable(t *testing.T) {
	rows := [][]string{{"name", "GB/s", "note"}, {"posix", "8.10", "engine"}, {"pread16-slab", "-", ""}}
	for _, tc := range []struct {
		name  string
		right bool
		want  string
	}{
		{"left, the combined table", false, "" +
			"name          GB/s  note\n" +
			"posix         8.10  engine\n" +
			"pread16-slab  -     \n"},
		{"right, a suite's own", true, "" +
			"          name  GB/s    note\n" +
			"         posix  8.10  engine\n" +
			"  pread16-slab     -        \n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			printTable(&out, tc.right, rows)
			if out.String() != tc.want {
				t.Errorf("got\n%q\nwant\n%q", out.String(), tc.want)
			}
		})
	}
}
