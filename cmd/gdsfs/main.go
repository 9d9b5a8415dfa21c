// Command gdsfs mounts a directory of datasets and checkpoints as a FUSE
// filesystem that unmodified programs read at native speed (kernel
// passthrough) and that GDS-aware loaders drive through a control path to
// put file ranges straight into GPU memory.
package main

import (
	"errors"
	"fmt"
	"os"
	"regexp"
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
		return flagError(c, err)
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
		newProbeMountCmd(), // hidden: daemon.ProbeMount's child
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

// badFlagValue matches pflag's error for a value its type cannot parse:
// invalid argument "abc" for "--max-open-per-user" flag: strconv.ParseInt: ...
var badFlagValue = regexp.MustCompile(`^invalid argument "(.*)" for "(?:-[^,]+, )?--([^"]+)" flag: `)

// flagError turns pflag's parse errors into the CLI's one-line usage errors:
// a value the flag's type cannot take names the flag, the value and what to
// give (not strconv's words); other flag errors get the --help pointer.
func flagError(c *cobra.Command, err error) error {
	m := badFlagValue.FindStringSubmatch(err.Error())
	if m != nil {
		if f := c.Flags().Lookup(m[2]); f != nil {
			want := map[string]string{
				"int": "a whole number", "int64": "a whole number", "int32": "a whole number",
				"uint": "a whole number >= 0", "uint64": "a whole number >= 0", "uint32": "a whole number >= 0",
				"float64": "a number", "duration": "a duration such as 1s, 500ms or 2m", "bool": "true or false",
			}[f.Value.Type()]
			if want != "" {
				return usagef("--%s %q: give %s (see %s --help)", m[2], m[1], want, c.CommandPath())
			}
		}
	}
	return usagef("%w (see %s --help)", err, c.CommandPath())
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
