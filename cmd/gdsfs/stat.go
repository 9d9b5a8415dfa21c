package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/internal/xattr"
)

func newStatCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "stat [--json] FILE",
		Short: "Show how gdsfs serves a file: engine and why, identity, index format",
		Long: `Print the user.gdsfs.info attribute of FILE (a file or directory on a
gdsfs mount): the engine the control path would use for it and why, its
alignment, size and backing identity, and the shard index format gdsfs
recognised in it, if any.`,
		Example: `  gdsfs stat /data/shard-000.tar
  gdsfs stat --json /data/model.safetensors | jq .engine`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runStat(cmd.OutOrStdout(), args[0], asJSON)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the attribute's JSON as it is")
	return cmd
}

func runStat(w io.Writer, path string, asJSON bool) error {
	v, err := xattr.Get(path, "user.gdsfs.info")
	switch {
	case errors.Is(err, syscall.ENOENT):
		return usagef("%s: no such file or directory", path)
	case errors.Is(err, syscall.ENODATA), errors.Is(err, syscall.ENOTSUP):
		return usagef("%s is not on a gdsfs mount (it has no user.gdsfs.info); mount its directory with gdsfs mount", path)
	case err != nil:
		return fmt.Errorf("read user.gdsfs.info of %s: %w", path, err)
	}
	if asJSON {
		_, err := fmt.Fprintf(w, "%s\n", v)
		return err
	}
	var info map[string]any
	if err := json.Unmarshal(v, &info); err != nil {
		return fmt.Errorf("user.gdsfs.info of %s is not JSON: %w", path, err)
	}
	fmt.Fprintf(w, "%s\n", path)
	// Known fields first, in a useful order; anything newer after them.
	order := []string{"type", "size", "engine", "reason", "format", "align", "path", "dev", "ino", "mtime_ns"}
	labels := map[string]string{"path": "backing", "reason": "why", "mtime_ns": "mtime (ns)"}
	seen := map[string]bool{}
	show := func(k string) {
		val, ok := info[k]
		if !ok {
			return
		}
		seen[k] = true
		label := k
		if l, ok := labels[k]; ok {
			label = l
		}
		if f, ok := val.(float64); ok {
			fmt.Fprintf(w, "  %-11s %d\n", label+":", int64(f))
			return
		}
		if s, ok := val.(string); ok && s == "" {
			val = "-"
		}
		fmt.Fprintf(w, "  %-11s %v\n", label+":", val)
	}
	for _, k := range order {
		show(k)
	}
	var rest []string
	for k := range info {
		if !seen[k] {
			rest = append(rest, k)
		}
	}
	sort.Strings(rest)
	for _, k := range rest {
		show(k)
	}
	return nil
}
