package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/daemon"
	"github.com/gdsfs/gdsfs/doctor"
	"github.com/gdsfs/gdsfs/internal/mountinfo"
)

func newDoctorCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "doctor [PATH]",
		Short: "Check whether and how gdsfs can serve this host (and PATH)",
		Long: `Runs every probe gdsfs uses to pick its transfer engine (libcuda, CUDA
devices, libcufile, cuFileDriverOpen, /dev/nvidia-fs*, udev) and to mount
(/dev/fuse, fusermount3, kernel passthrough), and with PATH the per-file
checks (udev record of PATH's block device, cuFileHandleRegister) and, when
PATH is on a gdsfs mount, that mount as its daemon reports it (passthrough
on or off and why, the engine and the files it refused). Prints a
table, the verdict (which engine a read of PATH would use, and why not the
faster ones) and how to fix what fails.

Exits 0 when gdsfs can serve (a CPU-only host with the host engine counts),
1 with a hint when it cannot.`,
		Example: `  gdsfs doctor
  gdsfs doctor /data/shard-000.tar
  gdsfs doctor --json /data | jq .engine`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			path := ""
			if len(args) == 1 {
				path = args[0]
				// A hung daemon would hang the stat below: probe it, bounded, first.
				if err := daemon.CheckAnswers(cmd.Context(), path); err != nil {
					return err
				}
				if _, err := os.Stat(path); err != nil {
					if why := mountinfo.Unreachable(path, err); why != "" {
						return usagef("%s", why)
					}
					return usagef("PATH %q: %v; name an existing file or directory", path, err)
				}
			}
			r := doctor.Run(path)
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				if err := enc.Encode(r); err != nil {
					return err
				}
			} else {
				doctor.Print(out, r)
			}
			if !r.CanServe {
				return fmt.Errorf("cannot serve on this host: %s", strings.Join(fatalHints(r), "; "))
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}

// fatalHints are the hints of the failed probes that stop gdsfs from
// serving (the verdict's reason), without those that only rule out a
// faster engine (no NVIDIA driver, no passthrough), which the table shows.
func fatalHints(r doctor.Report) []string {
	var out []string
	for _, p := range r.Probes {
		if p.OK || !p.Fatal {
			continue
		}
		h := p.Hint
		if h == "" {
			h = p.Name + ": " + p.Detail
		}
		out = append(out, h)
	}
	return out
}
