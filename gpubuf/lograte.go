package gpubuf

import (
	"sync"
	"time"
)

// limiterKeys bounds the keys a limiter remembers: a key idle for a whole
// period is forgotten when the table is full, so a storm of distinct keys
// (uids) costs memory proportional to this, not to the keys ever seen.
const limiterKeys = 1024

// limiter rate-limits repeated log lines: for each key (one kind of line:
// a refusal for one uid on one device), the first line of a period is let
// through and the rest are counted; the next line let through carries that
// count ("N similar suppressed"). A refused Alloc answers at once, so a
// client retrying EAGAIN in a loop would otherwise log thousands of lines
// a second.
type limiter struct {
	every time.Duration
	now   func() time.Time

	mu   sync.Mutex
	keys map[string]*limiterKey // GUARDED_BY(mu)
}

type limiterKey struct {
	last       time.Time // when a line was last let through
	suppressed uint64    // lines held back since
}

func newLimiter(every time.Duration, now func() time.Time) *limiter {
	return &limiter{every: every, now: now, keys: map[string]*limiterKey{}}
}

// allow reports whether a line of key may be logged now and, if so, how
// many lines of key were suppressed since the last one let through.
func (l *limiter) allow(key string) (bool, uint64) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	k := l.keys[key]
	if k == nil {
		if len(l.keys) >= limiterKeys {
			l.forgetIdle(now)
		}
		if len(l.keys) >= limiterKeys {
			// Every key is busy: count the line against nobody rather
			// than grow without bound or flood the log.
			return false, 0
		}
		l.keys[key] = &limiterKey{last: now}
		return true, 0
	}
	if now.Sub(k.last) < l.every {
		k.suppressed++
		return false, 0
	}
	n := k.suppressed
	k.last, k.suppressed = now, 0
	return true, n
}

// forgetIdle drops keys whose last line is a period old (a count they
// held back is lost). LOCKS_REQUIRED(l.mu)
func (l *limiter) forgetIdle(now time.Time) {
	for key, k := range l.keys {
		if now.Sub(k.last) >= l.every {
			delete(l.keys, key)
		}
	}
}
