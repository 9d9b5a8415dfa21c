package main

import (
	"bytes"
	"io"
	"os"
	"sync"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/schollz/progressbar/v3"
	"github.com/spf13/cobra"
)

// addBenchProgress wraps every suite of `gdsfs bench` so that on a
// terminal a spinner with the suite's name and elapsed time runs on stderr
// while it measures (suites run for minutes and print nothing between
// their first line and their table). The suite's own output clears the
// spinner line before it is written, so the two never mix. Off a terminal
// nothing changes.
func addBenchProgress(bench *cobra.Command) {
	for _, s := range bench.Commands() {
		run := s.RunE
		if run == nil {
			continue
		}
		s.RunE = func(c *cobra.Command, args []string) error {
			f, ok := c.ErrOrStderr().(*os.File)
			if !ok || !isatty.IsTerminal(f.Fd()) {
				return run(c, args)
			}
			bar := progressbar.NewOptions(-1,
				progressbar.OptionSetWriter(f),
				progressbar.OptionSetDescription("bench "+c.Name()),
				progressbar.OptionSpinnerType(14),
				progressbar.OptionSetElapsedTime(true),
				progressbar.OptionClearOnFinish(),
				progressbar.OptionThrottle(100*time.Millisecond),
			)
			cw := &clearingWriter{bar: bar, w: c.OutOrStdout()}
			stop, done := make(chan struct{}), make(chan struct{})
			go func() {
				defer close(done)
				tick := time.NewTicker(200 * time.Millisecond)
				defer tick.Stop()
				for {
					select {
					case <-stop:
						return
					case <-tick.C:
						cw.tick()
					}
				}
			}()
			c.SetOut(cw)
			err := run(c, args)
			close(stop)
			<-done
			_ = bar.Finish()
			cw.flush()
			return err
		}
	}
}

// clearingWriter passes the suite's output on in whole lines, each
// after clearing the spinner, under one lock with the spinner's redraws
// so a line is never drawn over (tables are written cell by cell).
type clearingWriter struct {
	bar *progressbar.ProgressBar
	w   io.Writer

	mu      sync.Mutex
	partial []byte // GUARDED_BY(mu): output after the last newline
}

func (c *clearingWriter) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.partial = append(c.partial, p...)
	i := bytes.LastIndexByte(c.partial, '\n')
	if i < 0 {
		return len(p), nil
	}
	_ = c.bar.Clear()
	if _, err := c.w.Write(c.partial[:i+1]); err != nil {
		return 0, err
	}
	c.partial = append(c.partial[:0], c.partial[i+1:]...)
	return len(p), nil
}

// tick advances the spinner.
func (c *clearingWriter) tick() {
	c.mu.Lock()
	defer c.mu.Unlock()
	_ = c.bar.Add(1)
}

// flush writes what is left after the last newline.
func (c *clearingWriter) flush() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.partial) > 0 {
		_, _ = c.w.Write(c.partial)
		c.partial = nil
	}
}
