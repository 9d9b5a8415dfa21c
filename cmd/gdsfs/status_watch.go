package main

import (
	"context"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

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
	show := func(w io.Writer, mp string, doc []byte, h ctl.HelloReply) error {
		return printStatus(w, mp, doc, h, false)
	}
	// The watch's requests run on a thread of their own that blocks
	// SIGINT and SIGTERM: a request to a daemon that stops answering holds
	// its thread in the kernel, and a signal the kernel gave that thread
	// (it picks any thread that does not block it, the first one before
	// others) would reach no handler. So Ctrl-C always reaches a thread
	// that runs Go's handler.
	done := make(chan error, 1)
	go func() {
		// Locked and never unlocked: the thread, with its mask, ends
		// with this goroutine.
		runtime.LockOSThread()
		blockStopSignals()
		done <- status.Watch(ctx, w, cl, mp, status.Options{Watch: wf.on, Every: wf.every, Metrics: wf.metrics}, show)
	}()
	select {
	case err := <-done:
		cl.Close()
		return err
	case <-ctx.Done():
	}
	// Stopped by a signal: the watch ends at the daemon's next answer. A
	// daemon that stopped answering meanwhile would keep it, and this
	// command, waiting: probe it, bounded, and name it instead. A second
	// signal ends the command at once.
	stop()
	for {
		select {
		case err := <-done:
			cl.Close()
			return err
		case <-time.After(watchGrace):
		}
		if err := daemon.CheckAnswers(context.Background(), mp); err != nil {
			return err // cl stays open: closing it would wait for the daemon too
		}
	}
}

// watchGrace is how long a stopped watch waits for the daemon's answer
// before it probes the daemon.
const watchGrace = 500 * time.Millisecond

// blockStopSignals blocks SIGINT and SIGTERM on the calling thread (the
// process's other threads take them). A failure leaves the mask as it
// was: Ctrl-C then works as before, unless it lands on a stuck request.
func blockStopSignals() {
	var set unix.Sigset_t
	for _, sig := range []unix.Signal{unix.SIGINT, unix.SIGTERM} {
		n := uint(sig) - 1
		set.Val[n/64] |= 1 << (n % 64)
	}
	_ = unix.PthreadSigmask(unix.SIG_BLOCK, &set, nil)
}
