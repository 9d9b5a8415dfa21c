package main

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/reader"
)

func newIndexCmd() *cobra.Command {
	var asJSON, local bool
	cmd := &cobra.Command{
		Use:   "index [--json] [--local] FILE",
		Short: "Print the shard index gdsfs keeps for a file (tar, MDS, safetensors, torch zip, npy)",
		Long: `Print where every sample, tensor or record of FILE lives, as the daemon
indexed it: WebDataset tar samples and their fields, MDS shard samples and
column values (or an MDS index.json's shard list), safetensors tensors,
torch.save zip records, or an .npy header. Offsets and lengths are absolute
byte ranges of the file; the names in the first column are what a
read-by-name request accepts (docs/index-format.md).

The index is read from the user.gdsfs.index attribute of FILE on a gdsfs
mount; an index larger than an attribute can hold is paged through the
control file. --local parses FILE in this process instead, for files that
are not on a mount (and to see why a file has no index).`,
		Example: `  gdsfs index /data/shard-000000.tar
  gdsfs index --json /data/model.safetensors | jq '.tensors[] | select(.dtype == "BF16") | .name'
  gdsfs index --local ./shard.00000.mds`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			var doc []byte
			var err error
			if local {
				doc, err = reader.LocalIndex(args[0])
			} else {
				doc, err = reader.Index(ctx, args[0])
			}
			if err != nil {
				return err
			}
			w := cmd.OutOrStdout()
			if asJSON {
				_, err := fmt.Fprintf(w, "%s\n", doc)
				return err
			}
			return reader.PrintIndex(w, doc)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the index JSON as it is")
	cmd.Flags().BoolVar(&local, "local", false, "parse FILE here instead of asking the daemon")
	return cmd
}
