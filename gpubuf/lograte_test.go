package gpubuf

import (
	"fmt"
	"testing"
	"time"
)

// TestLimiter drives the log rate limiter with an injected clock: each
// step advances the clock, then asks for a key.
func TestLimiter(t *testing.T) {
	type step struct {
		after      time.Duration // clock advance before the call
		key        string
		ok         bool
		suppressed uint64
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"first line passes", []step{{0, "a", true, 0}}},
		{"repeats within the period are counted", []step{
			{0, "a", true, 0}, {time.Second, "a", false, 0}, {time.Second, "a", false, 0},
			{8 * time.Second, "a", true, 2}, {0, "a", false, 0},
		}},
		{"a quiet period reports nothing suppressed", []step{
			{0, "a", true, 0}, {time.Hour, "a", true, 0},
		}},
		{"keys are independent", []step{
			{0, "a", true, 0}, {0, "b", true, 0}, {0, "a", false, 0}, {0, "b", false, 0},
			{0, "b", false, 0}, {10 * time.Second, "b", true, 2}, {0, "a", true, 1},
			{0, "c", true, 0}, {0, "a", false, 0}, {0, "b", false, 0},
		}},
		{"exactly one period later passes", []step{
			{0, "a", true, 0}, {10*time.Second - 1, "a", false, 0}, {1, "a", true, 1},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			now := time.Unix(0, 0)
			l := newLimiter(10*time.Second, func() time.Time { return now })
			for i, s := range tc.steps {
				now = now.Add(s.after)
				ok, n := l.allow(s.key)
				if ok != s.ok || n != s.suppressed {
					t.Errorf("step %d (%q): allow = %v, %d; want %v, %d", i, s.key, ok, n, s.ok, s.suppressed)
				}
			}
		})
	}
}

// TestLimiterKeysAreBounded: a storm of distinct keys keeps at most
// limiterKeys of them; keys idle for a period make room for new ones.
func TestLimiterKeysAreBounded(t *testing.T) {
	now := time.Unix(0, 0)
	l := newLimiter(time.Second, func() time.Time { return now })
	for i := range limiterKeys + 10 {
		ok, _ := l.allow(fmt.Sprint(i))
		if want := i < limiterKeys; ok != want {
			t.Fatalf("key %d: allow %v, want %v", i, ok, want)
		}
	}
	if len(l.keys) != limiterKeys {
		t.Fatalf("%d keys remembered, want %d", len(l.keys), limiterKeys)
	}
	now = now.Add(time.Second)
	if ok, _ := l.allow("new"); !ok {
		t.Error("a new key after every other key went idle was refused")
	}
	if len(l.keys) != 1 {
		t.Errorf("%d keys after the idle ones were forgotten, want 1", len(l.keys))
	}
}
