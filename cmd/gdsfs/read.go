package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/ctl"
)

// readChunkBytes is the size of one range `gdsfs read` asks for, and
// readBatch how many ranges go in one READ.
const (
	readChunkBytes = 8 << 20
	readBatch      = 4
)

func newReadCmd() *cobra.Command {
	var (
		offset, length int64
		device         int
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
host memory slabs.`,
		Example: `  gdsfs read /data/shard-000.tar | sha256sum
  gdsfs read --offset 4096 --length 1048576 /data/model.safetensors > head.bin`,
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
			dev := int32(device)
			if !cmd.Flags().Changed("device") {
				dev = -2 // the daemon's kind: decided after hello
			}
			return runRead(cmd.Context(), cmd.OutOrStdout(), args[0], offset, length, dev)
		},
	}
	cmd.Flags().Int64Var(&offset, "offset", 0, "first byte to read")
	cmd.Flags().Int64Var(&length, "length", -1, "bytes to read (default: to the end of the file)")
	cmd.Flags().IntVar(&device, "device", -1, "slab device: -1 for shared host memory, N for CUDA device N")
	return cmd
}

// findMount returns the root of the gdsfs mount that holds path: the
// nearest directory above it with a control file.
func findMount(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", usagef("%s: %v", path, err)
	}
	dir := filepath.Dir(abs)
	for {
		st, err := os.Stat(filepath.Join(dir, ctl.ControlName))
		if err == nil && st.Mode().IsRegular() {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", usagef("%s is not on a gdsfs mount (no %s above it); mount its directory with gdsfs mount", path, ctl.ControlName)
		}
		dir = parent
	}
}

func runRead(ctx context.Context, w io.Writer, path string, offset, length int64, device int32) error {
	if ctx == nil {
		ctx = context.Background()
	}
	mp, err := findMount(path)
	if err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return usagef("open %s: %v", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", path, err)
	}
	if !st.Mode().IsRegular() {
		return usagef("%s is not a regular file; gdsfs read reads files", path)
	}
	if offset > st.Size() {
		return usagef("--offset %d is past the end of %s (%d bytes)", offset, path, st.Size())
	}
	end := st.Size()
	if length >= 0 && length < end-offset {
		end = offset + length
	}
	cl, err := ctl.OpenSession(mp)
	if err != nil {
		return err
	}
	defer cl.Close()
	h := cl.Hello()
	if device == -2 {
		device = ctl.HostDevice
		if h.Caps&ctl.CapHostSlabs == 0 {
			device = 0
		}
	}
	chunk := int64(readChunkBytes)
	if h.MaxLease > 0 {
		chunk = min(chunk, int64(h.MaxLease)/readBatch)
	}
	chunk = max(chunk, ctl.AlignBytes)

	// One batch is read ahead while the previous one is written out.
	type batch struct {
		leases []ctl.Lease
		err    error
	}
	ahead := make(chan batch, 1)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		defer close(ahead)
		for off := offset; off < end; {
			var ranges []ctl.Range
			for len(ranges) < readBatch && off < end {
				n := min(chunk, end-off)
				ranges = append(ranges, ctl.Range{Offset: uint64(off), Length: uint64(n)})
				off += n
			}
			ls, err := cl.Read(ctx, f, device, ranges)
			select {
			case ahead <- batch{ls, err}:
			case <-stop:
				return
			}
			if err != nil {
				return
			}
		}
	}()
	for b := range ahead {
		if b.err != nil {
			return readError(path, b.err)
		}
		short := false
		for _, l := range b.leases {
			data, err := cl.Bytes(ctx, l)
			if err != nil {
				return readError(path, err)
			}
			if _, err := w.Write(data); err != nil {
				return fmt.Errorf("write output: %w", err)
			}
			short = short || l.Valid < l.Length
		}
		ids := make([]uint64, 0, len(b.leases))
		for _, l := range b.leases {
			if l.ID != 0 {
				ids = append(ids, l.ID)
			}
		}
		if err := cl.Release(ctx, ids...); err != nil {
			return readError(path, err)
		}
		if short {
			// The file shrank while it was read: stop at its new end,
			// as a plain read would.
			return nil
		}
	}
	return nil
}

// readError explains the errnos a user can act on.
func readError(path string, err error) error {
	switch {
	case errors.Is(err, syscall.EAGAIN):
		return fmt.Errorf("%w (the daemon's buffer pool is full: retry later, or mount with a larger --host-pool/--gpu-pool)", err)
	case errors.Is(err, syscall.ENODEV):
		return usageError{fmt.Errorf("%w (the daemon has no slabs on that --device; gdsfs status shows what it serves)", err)}
	}
	return fmt.Errorf("read %s: %w", path, err)
}
