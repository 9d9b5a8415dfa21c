package main

import (
	"context"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/daemon"
	"github.com/gdsfs/gdsfs/internal/mountinfo"
	"github.com/gdsfs/gdsfs/status"
)

// watchFlags are `gdsfs status --watch`, its interval, and --metrics.
type watchFlags struct {
	on      bool
	every   time.Duration
	metrics string // HOST:PORT or URL of the daemon's --metrics-addr
}

func addWatchFlags(cmd *cobra.Command, w *watchFlags) {
	cmd.Flags().BoolVarP(&w.on, "watch", "w", false, "refresh until interrupted, with rates since the previous refresh")
	cmd.Flags().DurationVar(&w.every, "interval", 2*time.Second, "refresh interval of --watch")
	cmd.Flags().StringVar(&w.metrics, "metrics", "", "also show FUSE, passthrough and per-engine byte figures from the daemon's --metrics-addr (HOST:PORT)")
}

// runStatusWatch shows the status (once, or every interval with --watch;
// package status) until SIGINT/SIGTERM (exit 0) or until the daemon stops
// answering (an error).
func runStatusWatch(ctx context.Context, w io.Writer, mp string, wf watchFlags) error {
	if wf.on && wf.every < 100*time.Millisecond {
		return usagef("--interval %s: give at least 100ms, such as 2s", wf.every)
	}
	// A hung daemon would hang the stat below: probe it, bounded, first.
	if err := daemon.CheckAnswers(ctx, mp); err != nil {
		return err
	}
	if st, err := os.Stat(filepath.Join(mp, ctl.ControlName)); err != nil || !st.Mode().IsRegular() {
		if why := mountinfo.Unreachable(mp, err); why != "" {
			return usagef("%s", why)
		}
		return usagef("%s is not a gdsfs mountpoint (no %s in it); give the directory gdsfs mount was given", mp, ctl.ControlName)
	}
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	cl, err := ctl.OpenSession(mp)
	if err != nil {
		return err
	}
	defer cl.Close()
	show := func(w io.Writer, mp string, doc []byte, h ctl.HelloReply) error {
		return printStatus(w, mp, doc, h, false)
	}
	return status.Watch(ctx, w, cl, mp, status.Options{Watch: wf.on, Every: wf.every, Metrics: wf.metrics}, show)
}
