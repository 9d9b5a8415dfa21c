package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/daemon"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/internal/logfile"
)

// backgroundEnv marks the re-executed daemon of `mount --background`; its
// value is the descriptor number of the pipe back to the parent.
const backgroundEnv = "GDSFS_BACKGROUND_FD"

// mountConfig is what `gdsfs mount` was asked to do but for the control
// path, whose flags are controlFlags (control.go).
type mountConfig struct {
	mountpoint   string
	source       string
	readOnly     bool
	allowOther   bool
	debug        bool
	noPass       bool
	background   bool
	attrTimeout  time.Duration
	entryTimeout time.Duration
	logLevel     string
	logFile      string
	// maxOpenPerUser is each uid's budget of the daemon's descriptors
	// (0: the default share, fs.Options.MaxOpenPerUser).
	maxOpenPerUser int64
}

func newMountCmd() *cobra.Command {
	// The control path's flags (engines, pool, index cache, slab socket,
	// metrics) are registered on the same command: cmd/gdsfs/control.go.
	var cf *controlFlags
	cmd := newMountCmdWith(func(cmd *cobra.Command, c *mountConfig) error {
		return runMount(cmd, c, cf)
	})
	cf = addControlFlags(cmd)
	return cmd
}

// newMountCmdWith builds the command with its action as a parameter, so
// tests can check flag parsing and validation without mounting.
func newMountCmdWith(action func(cmd *cobra.Command, c *mountConfig) error) *cobra.Command {
	c := &mountConfig{}
	cmd := &cobra.Command{
		Use:   "mount [flags] MOUNTPOINT",
		Short: "Serve a directory through gdsfs at MOUNTPOINT",
		Long: `Mount a gdsfs filesystem at MOUNTPOINT.

Without --source, gdsfs overmounts: it serves MOUNTPOINT's own contents
through a descriptor opened before mounting, so the directory keeps its
path and every file in it, and unmounting shows every write made through
the mount. With --source DIR it serves DIR at MOUNTPOINT.

Reads and writes use kernel FUSE passthrough (Linux >= 6.9, as root)
wherever the kernel offers it; the log says which path is used and why.
The mount runs in the foreground until SIGINT/SIGTERM or 'gdsfs unmount'.
With files still open a signal detaches the mount and serves them until
they are closed; a second SIGINT/SIGTERM aborts the connection (requests
in flight and open files fail) and the daemon exits.`,
		Example: `  gdsfs mount /data                          # make /data itself GDS-aware
  gdsfs mount --source /datasets /mnt/gds    # serve /datasets at /mnt/gds
  gdsfs mount --background --log-file /var/log/gdsfs.log /data
  gdsfs mount --read-only --allow-other /data`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c.mountpoint = args[0]
			return action(cmd, c)
		},
	}
	f := cmd.Flags()
	f.StringVar(&c.source, "source", "", "backing directory to serve (default: overmount MOUNTPOINT's own contents)")
	f.BoolVar(&c.readOnly, "read-only", false, "mount read-only")
	f.BoolVar(&c.allowOther, "allow-other", false, "let other users use the mount (the kernel still enforces the backing files' permissions)")
	f.BoolVar(&c.debug, "debug", false, "log every FUSE operation (very verbose)")
	f.BoolVar(&c.noPass, "no-passthrough", false, "serve all reads and writes in the daemon, even where the kernel offers passthrough")
	f.BoolVar(&c.background, "background", false, "detach once the mount is ready; exit 0 only then")
	f.DurationVar(&c.attrTimeout, "attr-timeout", fs.DefaultAttrTimeout, "how long the kernel caches file attributes (0 disables)")
	f.DurationVar(&c.entryTimeout, "entry-timeout", fs.DefaultEntryTimeout, "how long the kernel caches names (0 disables)")
	f.Int64Var(&c.maxOpenPerUser, "max-open-per-user", 0, "most of the daemon's descriptors one uid's open files, directories and control sessions on the mount may hold; past it that uid's opens fail with EMFILE (default 0: a quarter of what the daemon's RLIMIT_NOFILE leaves after its reserve)")
	f.StringVar(&c.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	f.StringVar(&c.logFile, "log-file", "", "append logs to this file, rotated at 64 MiB (default: stderr; with --background /var/log/gdsfs/MOUNTPOINT.log as root, $XDG_STATE_HOME/gdsfs/ otherwise)")
	return cmd
}

// runMount validates, then mounts in this process or in a background
// daemon.
func runMount(cmd *cobra.Command, c *mountConfig, cf *controlFlags) error {
	child := os.Getenv(backgroundEnv)
	var report *os.File
	if child != "" {
		fd, err := strconv.Atoi(child)
		if err != nil {
			return fmt.Errorf("%s=%q: not a descriptor", backgroundEnv, child)
		}
		report = os.NewFile(uintptr(fd), "background-report")
		os.Unsetenv(backgroundEnv)
	}
	err := mountForeground(cmd, c, cf, report)
	if report != nil && err != nil {
		reportFailure(report, err)
	}
	return err
}

// prepareMount checks every argument and cleans up a stale mount of the
// same path (daemon.PrepareMountpoint), making mountpoint and source
// absolute.
func prepareMount(c *mountConfig, log zerolog.Logger) error {
	if _, err := zerolog.ParseLevel(c.logLevel); err != nil || c.logLevel == "" {
		return usagef("--log-level %q: use debug, info, warn or error", c.logLevel)
	}
	for _, d := range []struct {
		flag string
		v    time.Duration
	}{{"--attr-timeout", c.attrTimeout}, {"--entry-timeout", c.entryTimeout}} {
		if d.v < 0 {
			return usagef("%s %s: give a duration >= 0 such as 1s (0 disables the cache)", d.flag, d.v)
		}
	}
	if c.maxOpenPerUser < 0 {
		return usagef("--max-open-per-user %d: give a number of descriptors, or 0 for the default share", c.maxOpenPerUser)
	}
	var err error
	c.mountpoint, c.source, err = daemon.PrepareMountpoint(c.mountpoint, c.source, c.allowOther, log)
	return err
}

// mountForeground mounts in this process and serves until unmounted. With
// report (the --background daemon), it tells the parent once the mount is
// ready.
func mountForeground(cmd *cobra.Command, c *mountConfig, cf *controlFlags, report *os.File) error {
	logOut := io.Writer(os.Stderr)
	perm := os.FileMode(0o644)
	if c.background && c.logFile == "" {
		// A background daemon's log must be findable: by default it goes
		// where `gdsfs status` and the mount's one line of output say.
		p, err := logfile.DefaultPath(c.mountpoint, os.Geteuid())
		if err != nil {
			return usagef("%v", err)
		}
		c.logFile, perm = p, 0o600
	}
	if c.logFile != "" {
		abs, err := filepath.Abs(c.logFile)
		if err != nil {
			return usagef("--log-file %s: %v", c.logFile, err)
		}
		f, err := logfile.Open(abs, logfile.RotateBytes, perm)
		if err != nil {
			return usagef("--log-file %s: %v; give another --log-file", abs, err)
		}
		defer f.Close()
		c.logFile, logOut = abs, f
	}
	log, err := newLogger(logOut, c.logLevel)
	if err != nil {
		return err
	}
	if err := prepareMount(c, log); err != nil {
		return err
	}
	if report == nil {
		noteHidden(cmd.ErrOrStderr(), c)
	}
	if c.background && report == nil {
		return startBackground(c)
	}

	cfg, err := cf.config(cmd, c, log)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(cmd.Context(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	d, err := daemon.Start(ctx, cfg)
	var ce *daemon.ConfigError
	if errors.As(err, &ce) {
		return usageError{Err: err}
	}
	if err != nil {
		return err
	}
	if report != nil {
		fmt.Fprintln(report, "ok")
		report.Close()
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-done:
			return
		}
		// The first signal unmounts, lazily while files are open, which
		// are then served until closed; a second one aborts the
		// connection, so the daemon ends even with requests stuck.
		again := make(chan os.Signal, 1)
		signal.Notify(again, syscall.SIGINT, syscall.SIGTERM)
		defer signal.Stop(again)
		log.Info().Msg("signal received, unmounting")
		unmountOnSignal(d, log)
		select {
		case <-again:
			log.Warn().Msg("second signal: aborting the FUSE connection; requests in flight and open files on the mount fail")
			if err := d.Abort(); err != nil {
				log.Error().Err(err).Msg("abort failed; kill -9 ends the daemon")
			}
		case <-done:
		}
	}()
	d.Wait()
	close(done)
	log.Info().Str("mountpoint", c.mountpoint).Msg("unmounted")
	if err := d.Close(); err != nil {
		return fmt.Errorf("close control path: %w", err)
	}
	return nil
}

// unmountOnSignal unmounts; if files are still open it detaches lazily:
// the daemon ends once they are closed, or at a second signal (Abort).
func unmountOnSignal(d *daemon.Daemon, log zerolog.Logger) {
	err := d.Unmount()
	if err == nil {
		return
	}
	log.Warn().Err(err).Msg("unmount failed, detaching lazily")
	if err := d.UnmountLazy(); err != nil {
		log.Error().Err(err).Msg("lazy unmount failed")
	}
}

// flagTimeout maps the flag's "0 disables" to fs.Options' "negative
// disables".
func flagTimeout(d time.Duration) time.Duration {
	if d <= 0 {
		return -1
	}
	return d
}

// startBackground re-executes gdsfs as a daemon in a new session and waits
// for it to report the mount ready (or why it failed).
func startBackground(c *mountConfig) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find gdsfs executable: %w", err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("background pipe: %w", err)
	}
	defer r.Close()
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		w.Close()
		return fmt.Errorf("open %s: %w", os.DevNull, err)
	}
	defer null.Close()
	child := exec.Command(exe, os.Args[1:]...)
	child.Env = append(os.Environ(), backgroundEnv+"=3")
	child.ExtraFiles = []*os.File{w}
	child.Stdin, child.Stdout, child.Stderr = null, null, null
	child.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := child.Start(); err != nil {
		w.Close()
		return fmt.Errorf("start background daemon: %w", err)
	}
	w.Close()
	// Reap the child if it exits while we wait, and let it run on after.
	go child.Wait()
	line, _ := bufio.NewReader(r).ReadString('\n')
	line = strings.TrimSpace(line)
	switch {
	case line == "ok":
		fmt.Fprintf(os.Stdout, "gdsfs: mounted %s in the background (daemon pid %d); log: %s\n", c.mountpoint, child.Process.Pid, c.logFile)
		return nil
	case strings.HasPrefix(line, "usage "):
		return usagef("%s", strings.TrimPrefix(line, "usage "))
	case strings.HasPrefix(line, "error "):
		return errors.New(strings.TrimPrefix(line, "error "))
	}
	return fmt.Errorf("the background daemon exited before the mount was ready; see %s, or run without --background to see why", c.logFile)
}

func reportFailure(w io.Writer, err error) {
	kind := "error"
	var ue usageError
	if errors.As(err, &ue) {
		kind = "usage"
	}
	msg := strings.ReplaceAll(err.Error(), "\n", "; ")
	fmt.Fprintf(w, "%s %s\n", kind, msg)
}

// newLogger builds the root logger: console format on a terminal, JSON
// otherwise.
func newLogger(w io.Writer, level string) (zerolog.Logger, error) {
	lvl, err := zerolog.ParseLevel(level)
	if err != nil || level == "" {
		return zerolog.Nop(), usagef("--log-level %q: use debug, info, warn or error", level)
	}
	if f, ok := w.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
		w = zerolog.ConsoleWriter{Out: f, TimeFormat: time.TimeOnly}
	}
	return zerolog.New(w).Level(lvl).With().Timestamp().Logger(), nil
}

// noteHidden tells the user, on the terminal, that mounting --source over
// a directory with entries of its own hides them while mounted (as
// mount(8) does, silently). Without --source gdsfs serves them.
func noteHidden(w io.Writer, c *mountConfig) {
	if c.source == "" {
		return
	}
	d, err := os.Open(c.mountpoint)
	if err != nil {
		return
	}
	defer d.Close()
	names, _ := d.Readdirnames(1000)
	if len(names) == 0 {
		return
	}
	n := fmt.Sprint(len(names))
	if len(names) == 1000 {
		n = "1000 or more"
	}
	fmt.Fprintf(w, "gdsfs: note: %s is not empty: its %s entries are hidden while it is mounted (leave --source out to serve them instead)\n", c.mountpoint, n)
}
