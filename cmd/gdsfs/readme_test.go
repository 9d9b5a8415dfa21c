package main

import (
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// TestREADMEMountFlags: README.md's `gdsfs mount` flag table names every
// flag gdsfs mount has and no other, and a default the table gives as a
// value (1s, 8MiB, owners) is the flag's own.
func TestREADMEMountFlags(t *testing.T) {
	text, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	sec := string(text)
	start := strings.Index(sec, "## Mounting")
	if start < 0 {
		t.Fatal("README.md has no \"## Mounting\" section")
	}
	sec = sec[start+len("## Mounting"):]
	if end := strings.Index(sec, "\n## "); end >= 0 {
		sec = sec[:end]
	}
	flagName := regexp.MustCompile("`--([a-z-]+)")
	table := map[string]string{} // flag -> the row's default cell
	for _, line := range strings.Split(sec, "\n") {
		if !strings.HasPrefix(line, "| `--") {
			continue
		}
		cells := regexp.MustCompile(`[^\\]\|`).Split(line[1:], -1)
		if len(cells) < 3 {
			t.Fatalf("README.md flag row without a default and a meaning: %s", line)
		}
		for _, m := range flagName.FindAllStringSubmatch(cells[0], -1) {
			table[m[1]] = strings.TrimSpace(cells[1])
		}
	}
	if len(table) == 0 {
		t.Fatal("README.md's Mounting section has no flag table")
	}
	cmd := newMountCmd()
	var missing []string
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Name == "help" || f.Hidden || f.Deprecated != "" {
			return // deprecated aliases (--index-cache) are hidden from --help too
		}
		def, ok := table[f.Name]
		if !ok {
			missing = append(missing, "--"+f.Name)
			return
		}
		delete(table, f.Name)
		switch f.DefValue {
		case "", "0", "false", "[]":
		default:
			if !strings.Contains(def, f.DefValue) {
				t.Errorf("README.md gives --%s the default %q; gdsfs mount's is %q", f.Name, def, f.DefValue)
			}
		}
	})
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("gdsfs mount flags missing from README.md's flag table: %s", strings.Join(missing, ", "))
	}
	for name := range table {
		t.Errorf("README.md's flag table names --%s, which gdsfs mount does not have", name)
	}
}
