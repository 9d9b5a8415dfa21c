package metrics

import (
	"context"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
)

func TestRecordingBoundsLabels(t *testing.T) {
	m := New()
	m.ObserveFUSE("Read", time.Millisecond, 0)
	m.ObserveFUSE("Read", time.Millisecond, syscall.EIO)
	m.ObserveFUSE("NoSuchOp", time.Millisecond, syscall.Errno(4095))
	m.ObserveControl("READ", time.Millisecond, syscall.EAGAIN)
	m.ObserveControl("../../etc", time.Millisecond, 0)
	m.AddBytes("host", "read", 4096)
	m.AddBytes("host", "read", 4096)
	m.AddBytes("warp-drive", "sideways", 1)
	m.AddBytes("host", "write", -5) // ignored: never decreases a counter
	s, err := m.Gather()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		labels []string
		want   float64
	}{
		{"gdsfs_fuse_ops_total", []string{"op", "Read"}, 2},
		{"gdsfs_fuse_errors_total", []string{"op", "Read", "errno", "EIO"}, 1},
		{"gdsfs_fuse_ops_total", []string{"op", "other"}, 1},
		{"gdsfs_fuse_errors_total", []string{"op", "other", "errno", "other"}, 1},
		{"gdsfs_fuse_op_duration_seconds_count", []string{"op", "Read"}, 2},
		{"gdsfs_control_requests_total", []string{"command", "READ"}, 1},
		{"gdsfs_control_errors_total", []string{"command", "READ", "errno", "EAGAIN"}, 1},
		{"gdsfs_control_requests_total", []string{"command", "other"}, 1},
		{"gdsfs_bytes_total", []string{"engine", "host", "direction", "read"}, 8192},
		{"gdsfs_bytes_total", []string{"engine", "other", "direction", "other"}, 1},
	}
	for _, tt := range tests {
		got, ok := s.Get(tt.name, tt.labels...)
		if !ok || got != tt.want {
			t.Errorf("%s = %v (present %v), want %v", Series(tt.name, tt.labels...), got, ok, tt.want)
		}
	}
	if _, ok := s.Get("gdsfs_bytes_total", "engine", "host", "direction", "write"); ok {
		t.Errorf("a negative AddBytes created a series")
	}
	if got := s.Sum("gdsfs_fuse_ops_total"); got != 3 {
		t.Errorf("Sum(gdsfs_fuse_ops_total) = %v, want 3", got)
	}
}

func TestNilMetricsIsNoop(t *testing.T) {
	var m *Metrics
	m.ObserveFUSE("Read", time.Second, syscall.EIO)
	m.ObserveControl("READ", time.Second, 0)
	m.AddBytes("host", "read", 1)
	m.SessionOpened()
	m.SessionClosed()
	m.SetPool(func() gpubuf.Stats { return gpubuf.Stats{} })
	m.SetIndex(nil)
	m.SetPassthrough(nil)
	m.SetOpenFiles(nil)
}

func TestErrnoName(t *testing.T) {
	tests := []struct {
		e    syscall.Errno
		want string
	}{
		{syscall.EIO, "EIO"}, {syscall.EAGAIN, "EAGAIN"}, {syscall.ENOTTY, "ENOTTY"},
		{syscall.ENOSPC, "ENOSPC"}, {syscall.ENOTCONN, "ENOTCONN"}, {syscall.Errno(9999), "other"},
	}
	for _, tt := range tests {
		if got := ErrnoName(tt.e); got != tt.want {
			t.Errorf("ErrnoName(%d) = %q, want %q", tt.e, got, tt.want)
		}
	}
}

func TestStateCallbacks(t *testing.T) {
	m := New()
	var uids []gpubuf.UIDStats
	for i := 0; i < MaxUIDLabels+5; i++ {
		uids = append(uids, gpubuf.UIDStats{UID: uint32(1000 + i), Sessions: 1, LeasedBytes: int64(4096 * (i + 1)),
			AllocatedBytes: 1 << 20, Refused: uint64(i), FreedSlabs: 1})
	}
	m.SetPool(func() gpubuf.Stats {
		return gpubuf.Stats{Backend: gpubuf.HostBackendName, Devices: []gpubuf.DeviceStats{
			{Device: 0, BudgetBytes: 1 << 30, AllocatedBytes: 64 << 20, LeasedBytes: 8 << 20, Slabs: 1, Leases: 3, UIDShareBytes: 512 << 20, FreedSlabs: 4},
		}, UIDs: uids}
	})
	m.SetIndex(func() cache.IndexStats { return cache.IndexStats{Hits: 7, Misses: 2, Evictions: 1, UsedBytes: 100} })
	m.SetPassthrough(func() Passthrough {
		return Passthrough{Enabled: true, PassthroughStats: fs.PassthroughStats{Passthrough: 5, Daemon: 1}}
	})
	var opens []fs.UIDOpenStats
	for i := range MaxUIDLabels + 2 {
		opens = append(opens, fs.UIDOpenStats{UID: uint32(2000 + i), Open: int64(i + 1), Refused: 1})
	}
	m.SetOpenFiles(func() fs.OpenStats {
		return fs.OpenStats{Limit: 1 << 20, Reserve: 8192, PerUID: 260096, UIDs: opens}
	})
	m.SessionOpened()
	m.SessionOpened()
	m.SessionClosed()
	s, err := m.Gather()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		labels []string
		want   float64
	}{
		{"gdsfs_pool_budget_bytes", []string{"device", "host"}, 1 << 30},
		{"gdsfs_pool_in_use_bytes", []string{"device", "host"}, 8 << 20},
		{"gdsfs_pool_free_bytes", []string{"device", "host"}, 1<<30 - 8<<20},
		{"gdsfs_pool_leases", []string{"device", "host"}, 3},
		{"gdsfs_pool_uid_in_use_bytes", []string{"uid", "1036"}, 4096 * 37},
		// The five smallest holders are summed: uids 1000..1004.
		{"gdsfs_pool_uid_in_use_bytes", []string{"uid", "other"}, 4096 * (1 + 2 + 3 + 4 + 5)},
		{"gdsfs_pool_uid_sessions", []string{"uid", "other"}, 5},
		{"gdsfs_pool_uid_share_bytes", []string{"device", "host"}, 512 << 20},
		{"gdsfs_pool_freed_slabs_total", []string{"device", "host"}, 4},
		{"gdsfs_pool_uid_allocated_bytes", []string{"uid", "1036"}, 1 << 20},
		{"gdsfs_pool_uid_refused_total", []string{"uid", "1036"}, 36},
		{"gdsfs_pool_uid_refused_total", []string{"uid", "other"}, 0 + 1 + 2 + 3 + 4},
		{"gdsfs_pool_uid_freed_slabs_total", []string{"uid", "other"}, 5},
		{"gdsfs_index_cache_hits_total", nil, 7},
		{"gdsfs_index_cache_evictions_total", nil, 1},
		{"gdsfs_fuse_passthrough_enabled", nil, 1},
		{"gdsfs_fuse_opens_total", []string{"mode", "daemon"}, 1},
		{"gdsfs_control_sessions", nil, 1},
		{"gdsfs_control_sessions_opened_total", nil, 2},
		{"gdsfs_fuse_nofile_limit", nil, 1 << 20},
		{"gdsfs_fuse_open_files_reserve", nil, 8192},
		{"gdsfs_fuse_open_files_uid_budget", nil, 260096},
		{"gdsfs_fuse_open_files", []string{"uid", "2033"}, 34},
		// The two smallest holders are summed: uids 2000 and 2001.
		{"gdsfs_fuse_open_files", []string{"uid", "other"}, 1 + 2},
		{"gdsfs_fuse_open_files_refused_total", []string{"uid", "other"}, 2},
	}
	for _, tt := range tests {
		got, ok := s.Get(tt.name, tt.labels...)
		if !ok || got != tt.want {
			t.Errorf("%s = %v (present %v), want %v", Series(tt.name, tt.labels...), got, ok, tt.want)
		}
	}
	n := 0
	for k := range s {
		if strings.HasPrefix(k, "gdsfs_pool_uid_in_use_bytes{") {
			n++
		}
	}
	if n != MaxUIDLabels+1 {
		t.Errorf("%d uid series, want %d (MaxUIDLabels + other)", n, MaxUIDLabels+1)
	}
	// A CUDA pool's devices are labelled by ordinal.
	m = New()
	m.SetPool(func() gpubuf.Stats {
		return gpubuf.Stats{Backend: "cuda", Devices: []gpubuf.DeviceStats{{Device: 0, AllocatedBytes: 1}, {Device: 1, BudgetBytes: 1 << 30, AllocatedBytes: 0}}}
	})
	if s, err = m.Gather(); err != nil {
		t.Fatal(err)
	}
	if got, ok := s.Get("gdsfs_pool_allocated_bytes", "device", "1"); !ok || got != 0 {
		t.Errorf("gdsfs_pool_allocated_bytes{device=1} = %v (present %v), want 0", got, ok)
	}
}

func TestQuantile(t *testing.T) {
	m := New()
	if q := m.Quantile("gdsfs_fuse_op_duration_seconds", 0.5, "op", "Read"); !math.IsNaN(q) {
		t.Errorf("quantile of an empty histogram = %v, want NaN", q)
	}
	for i := 0; i < 100; i++ {
		m.ObserveFUSE("Read", 100*time.Microsecond, 0)
	}
	q := m.Quantile("gdsfs_fuse_op_duration_seconds", 0.99, "op", "Read")
	// 100µs falls in the (80µs, 320µs] bucket.
	if q < 80e-6 || q > 320e-6 {
		t.Errorf("p99 = %v, want within the bucket (80µs, 320µs]", q)
	}
}

func TestServeScrapeAndShutdown(t *testing.T) {
	m := New()
	m.AddBytes("posix", "read", 12345)
	l, err := Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Serve(ctx, l) }()

	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET /metrics: %s", resp.Status)
	}
	s, err := ParseText(strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := s.Get("gdsfs_bytes_total", "engine", "posix", "direction", "read"); v != 12345 {
		t.Errorf("scraped gdsfs_bytes_total{posix,read} = %v, want 12345", v)
	}
	for _, fam := range []string{"go_goroutines", "process_open_fds", "process_resident_memory_bytes"} {
		if _, ok := s.Get(fam); !ok {
			t.Errorf("scrape lacks %s", fam)
		}
	}
	if resp, err := http.Get("http://" + addr + "/nope"); err == nil {
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET /nope: %s, want 404", resp.Status)
		}
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Serve after cancel: %v", err)
		}
	case <-time.After(shutdownGrace + 3*time.Second):
		t.Fatal("Serve did not return after its context was cancelled")
	}
	if resp, err := http.Get("http://" + addr + "/metrics"); err == nil {
		resp.Body.Close()
		t.Errorf("server still answers after shutdown")
	}
}

func TestListenRejectsBadAddress(t *testing.T) {
	for _, addr := range []string{"", "localhost", "127.0.0.1:", "127.0.0.1:99999", "no.such.host.invalid:9000"} {
		if l, err := Listen(addr); err == nil {
			l.Close()
			t.Errorf("Listen(%q) succeeded, want an error", addr)
		}
	}
}

// FuzzParseText checks that any scrape text (gdsfs status reads whatever
// answers on --metrics-addr) gives a snapshot or an error, never a panic.
func FuzzParseText(f *testing.F) {
	m := New()
	m.ObserveFUSE("Read", time.Millisecond, syscall.EIO)
	m.AddBytes("host", "read", 1)
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	f.Add(rec.Body.String())
	f.Add("# TYPE x counter\nx_total 1\n")
	f.Add("# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 3\nh_sum 4\nh_count 3\n")
	f.Add("x{a=\"b\"} NaN\n")
	f.Fuzz(func(t *testing.T, text string) {
		s, err := ParseText(strings.NewReader(text))
		if err == nil && s == nil {
			t.Fatal("nil snapshot without an error")
		}
	})
}
