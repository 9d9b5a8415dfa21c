package main

import (
	"fmt"
	"io"

	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/reader"
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
	v, err := reader.Info(path)
	if err != nil {
		return err
	}
	if asJSON {
		_, err := fmt.Fprintf(w, "%s\n", v)
		return err
	}
	return reader.PrintInfo(w, path, v)
}
