package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/dustin/go-humanize"
	"github.com/mattn/go-isatty"
	"github.com/spf13/cobra"

	"github.com/gdsfs/gdsfs/ctl"
)

// watchFlags are `gdsfs status --watch` and its interval.
type watchFlags struct {
	on    bool
	every time.Duration
}

func addWatchFlags(cmd *cobra.Command, w *watchFlags) {
	cmd.Flags().BoolVarP(&w.on, "watch", "w", false, "refresh until interrupted, with rates since the previous refresh")
	cmd.Flags().DurationVar(&w.every, "interval", 2*time.Second, "refresh interval of --watch")
}

// runStatusWatch shows the status every interval, with read and write
// rates computed from the counters, until SIGINT/SIGTERM (exit 0) or
// until the daemon stops answering (an error).
func runStatusWatch(ctx context.Context, w io.Writer, mp string, every time.Duration) error {
	if every < 100*time.Millisecond {
		return usagef("--interval %s: give at least 100ms, such as 2s", every)
	}
	if st, err := os.Stat(filepath.Join(mp, ctl.ControlName)); err != nil || !st.Mode().IsRegular() {
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
	clear := ""
	if f, ok := w.(*os.File); ok && isatty.IsTerminal(f.Fd()) {
		clear = "\x1b[H\x1b[2J" // home, erase screen
	}
	var prev ctl.CounterStats
	var prevAt time.Time
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		doc, err := cl.Status(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return fmt.Errorf("status of %s: %w", mp, err)
		}
		var st ctl.Stats
		if err := json.Unmarshal(doc, &st); err != nil {
			return fmt.Errorf("status of %s is not the expected JSON: %w", mp, err)
		}
		var b bytes.Buffer
		b.WriteString(clear)
		now := time.Now()
		fmt.Fprintf(&b, "%s  (every %s, Ctrl-C to stop)\n", now.Format(time.TimeOnly), every)
		if err := printStatus(&b, mp, doc, cl.Hello(), false); err != nil {
			return err
		}
		if !prevAt.IsZero() {
			c, dt := st.Counters, now.Sub(prevAt).Seconds()
			fmt.Fprintf(&b, "rates:    %.0f reads/s %s/s, %.0f writes/s %s/s\n",
				float64(c.Reads-prev.Reads)/dt, humanize.IBytes(uint64(float64(c.ReadBytes-prev.ReadBytes)/dt)),
				float64(c.Writes-prev.Writes)/dt, humanize.IBytes(uint64(float64(c.WriteBytes-prev.WriteBytes)/dt)))
		}
		if clear == "" {
			b.WriteString("\n")
		}
		if _, err := w.Write(b.Bytes()); err != nil {
			return err
		}
		prev, prevAt = st.Counters, now
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
