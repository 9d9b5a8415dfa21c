package main

import (
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/reader"
)

func newReadCmd() *cobra.Command {
	var (
		offset, length int64
		device         int
		discard        bool
		engineOnly     bool
		parallel       int
		passes         int
	)
	cmd := &cobra.Command{
		Use:   "read [--offset N] [--length N] [--device N] FILE",
		Short: "Copy a file range through the control path to stdout",
		Long: `Read a byte range of FILE (on a gdsfs mount) through the control path: the
daemon reads it into its slabs with the engine it picked for the file, and
gdsfs read copies it back from the slabs to stdout. The output equals a plain
read of the same range; a range that runs past the end of the file stops
there. Useful to check the control path end to end, and in scripts.

--device -1 (the default when the daemon serves host memory) uses shared
host memory slabs; --device N uses GPU N's slabs, copied back by CUDA IPC.
--discard reads into the slabs and throws the bytes away, printing the
throughput: the control path's own speed, file to slab. --engine-only
measures the same requests with the engine alone, in this process, on the
backing file: the difference is the cost of the ioctl hop. Both read the
range once untimed (slabs allocated, page cache warm), then --passes times
timed; a full pool (EAGAIN) is waited out and counted, not fatal.`,
		Example: `  gdsfs read /data/shard-000.tar | sha256sum
  gdsfs read --offset 4096 --length 1048576 /data/model.safetensors > head.bin
  gdsfs read --device 0 --discard --parallel 8 /data/big.bin   # file -> GPU throughput
  gdsfs read --device 0 --discard --parallel 8 --engine-only /data/big.bin   # the same, engine alone`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if offset < 0 {
				return usagef("--offset %d: give a byte offset >= 0", offset)
			}
			if length < -1 {
				return usagef("--length %d: give a byte count >= 0 (or leave it out to read to the end)", length)
			}
			if device < -1 {
				return usagef("--device %d: give -1 (host memory) or a CUDA device number", device)
			}
			if parallel < 1 || parallel > 64 {
				return usagef("--parallel %d: give 1 to 64", parallel)
			}
			if parallel > 1 && !discard {
				return usagef("--parallel needs --discard (output is written in order by one reader)")
			}
			if engineOnly && !discard {
				return usagef("--engine-only needs --discard (it measures, it does not copy)")
			}
			if passes < 1 || passes > 1000 {
				return usagef("--passes %d: give 1 to 1000", passes)
			}
			if cmd.Flags().Changed("passes") && !discard {
				return usagef("--passes needs --discard (it repeats a measurement)")
			}
			dev := int32(device)
			if !cmd.Flags().Changed("device") {
				dev = reader.DaemonDevice // decided after hello
			}
			o := reader.Options{Offset: offset, Length: length, Device: dev, Discard: discard, EngineOnly: engineOnly, Parallel: parallel, Passes: passes}
			return reader.Read(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), args[0], o)
		},
	}
	cmd.Flags().Int64Var(&offset, "offset", 0, "first byte to read")
	cmd.Flags().Int64Var(&length, "length", -1, "bytes to read (default: to the end of the file)")
	cmd.Flags().IntVar(&device, "device", -1, "slab device: -1 for shared host memory, N for the daemon's CUDA device N (gdsfs status names each with its UUID)")
	cmd.Flags().BoolVar(&discard, "discard", false, "read into the slabs only, print the throughput (nothing on stdout)")
	cmd.Flags().IntVar(&parallel, "parallel", 1, "with --discard: requests in flight at once")
	cmd.Flags().IntVar(&passes, "passes", 1, "with --discard: timed passes over the range, after one untimed warm-up pass")
	cmd.Flags().BoolVar(&engineOnly, "engine-only", false, "with --discard: skip the mount, run the engine in this process on the backing file with the same requests (the baseline of the control path's overhead)")
	return cmd
}
