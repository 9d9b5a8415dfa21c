// Command gdsfs mounts a directory of datasets and checkpoints as a FUSE
// filesystem that unmodified programs read at native speed (kernel
// passthrough) and that GDS-aware loaders drive through a control path to
// put file ranges straight into GPU memory.
package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/internal/usage"
)

// Exit codes shared by every subcommand.
const (
	exitOK      = 0
	exitFailure = 1 // the operation was valid but failed
	exitUsage   = 2 // the user asked for something that cannot be done as asked
)

// usageError marks an error the user caused (bad flag, bad path, ...): it
// exits with exitUsage. Its message must say what is wrong and what to do.
// The packages behind the subcommands return the same type.
type usageError = usage.Error

// usagef returns a usageError with a formatted message.
func usagef(format string, args ...any) error { return usage.Errorf(format, args...) }

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "gdsfs",
		Short:         "GPU-direct FUSE filesystem for ML datasets and checkpoints",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return usagef("%w (see %s --help)", err, c.CommandPath())
	})
	root.AddCommand(
		// subcommands, one file each
		newMountCmd(),
		newUnmountCmd(),
		newBenchCmd(),
		newDoctorCmd(),
		newIndexCmd(),
		newReadCmd(),
		newStatCmd(),
		newStatusCmd(),
		newWarmCmd(),
	)
	return root
}

func main() {
	os.Exit(run(os.Args[1:]))
}

// run executes the CLI with args and returns the process exit code.
func run(args []string) int {
	root := newRootCmd()
	root.SetArgs(args)
	cmd, err := root.ExecuteC()
	if err == nil {
		return exitOK
	}
	var ue usageError
	if !errors.As(err, &ue) && isCobraUsageError(err) {
		// Cobra's own argument errors say what is wrong, not what to do.
		err = usagef("%w (see %s --help)", err, cmd.CommandPath())
	}
	fmt.Fprintf(os.Stderr, "gdsfs: %v\n", err)
	if errors.As(err, &ue) {
		return exitUsage
	}
	return exitFailure
}

// isCobraUsageError recognises cobra's own argument errors (unknown command,
// wrong number of arguments), which it does not type.
func isCobraUsageError(err error) bool {
	msg := err.Error()
	for _, p := range []string{"unknown command", "accepts ", "requires at least", "requires at most", "unknown flag", "unknown shorthand"} {
		if strings.Contains(msg, p) {
			return true
		}
	}
	return false
}
