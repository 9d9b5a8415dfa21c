package bench

import (
	"bytes"
	"io"
	"os"
	"sync"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/schollz/progressbar/v3"
)

// WithProgress runs a suite's measure with its report going to out.
// When errw is a terminal, a spinner with the suite's name and elapsed time
// runs on it meanwhile (suites run for minutes and print nothing between
// their first line and their table); measure then writes through a
// clearingWriter, which clears the spinner line before each line of output,
// so the two never mix even when out is the same terminal. Off a terminal
// nothing is added.
func WithProgress(errw io.Writer, name string, out io.Writer, measure func(out io.Writer) error) error {
	f, ok := errw.(*os.File)
	if !ok || !isatty.IsTerminal(f.Fd()) {
		return measure(out)
	}
	cw := &clearingWriter{bar: newSpinner(f, "bench "+name), w: out}
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
	err := measure(cw)
	close(stop)
	<-done
	_ = cw.bar.Finish()
	cw.flush()
	return err
}

// newSpinner is the spinner of WithProgress on w. It redraws only when
// clearingWriter.tick advances it: the library's own redraw timer (on by
// default for a spinner) draws without the lock clearingWriter holds
// around Clear, and raced with it.
func newSpinner(w io.Writer, description string) *progressbar.ProgressBar {
	return progressbar.NewOptions(-1,
		progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription(description),
		progressbar.OptionSpinnerType(14),
		progressbar.OptionSetSpinnerChangeInterval(0),
		progressbar.OptionSetElapsedTime(true),
		progressbar.OptionClearOnFinish(),
		progressbar.OptionThrottle(100*time.Millisecond),
	)
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
