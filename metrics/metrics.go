package metrics

import (
	"net/http"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// namespace prefixes every family.
const namespace = "gdsfs"

// latencyBuckets spans a page-cache FUSE op (tens of microseconds) to a
// multi-GiB control-path read from a cold disk (seconds).
var latencyBuckets = prometheus.ExponentialBuckets(20e-6, 4, 11) // 20µs .. ~21s

// Metrics records what one gdsfs daemon does. The zero value is not
// usable; call New. A nil *Metrics is a valid no-op recorder, so callers
// can hold one unconditionally.
type Metrics struct {
	reg *prometheus.Registry

	fuseOps      *prometheus.CounterVec
	fuseErrors   *prometheus.CounterVec
	fuseDuration *prometheus.HistogramVec

	ctlRequests *prometheus.CounterVec
	ctlErrors   *prometheus.CounterVec
	ctlDuration *prometheus.HistogramVec

	bytes          *prometheus.CounterVec
	sessionsOpened prometheus.Counter
	sessions       prometheus.Gauge

	state *stateCollector

	tierOnce sync.Once
	tier     *tierCollector // registered by SetTier (tier.go)
}

// New returns a registry holding every gdsfs family plus the Go runtime
// and process collectors (go_goroutines, process_open_fds,
// process_resident_memory_bytes, ...).
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		fuseOps: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "fuse", Name: "ops_total",
			Help: "FUSE operations served by the daemon, by op (ops served by kernel passthrough never reach the daemon).",
		}, []string{"op"}),
		fuseErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "fuse", Name: "errors_total",
			Help: "FUSE operations that returned an error, by op and errno name.",
		}, []string{"op", "errno"}),
		fuseDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: "fuse", Name: "op_duration_seconds",
			Help:    "Time the daemon spent serving a FUSE operation, by op.",
			Buckets: latencyBuckets,
		}, []string{"op"}),
		ctlRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "control", Name: "requests_total",
			Help: "Control-path requests (ioctls and virtual xattrs), by command.",
		}, []string{"command"}),
		ctlErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "control", Name: "errors_total",
			Help: "Control-path requests refused or failed, by command and errno name.",
		}, []string{"command", "errno"}),
		ctlDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: "control", Name: "request_duration_seconds",
			Help:    "Time the daemon spent serving a control-path request, by command.",
			Buckets: latencyBuckets,
		}, []string{"command"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "bytes_total",
			Help: "Bytes moved by the daemon between backing files and memory, by engine and direction (read: file to memory).",
		}, []string{"engine", "direction"}),
		sessionsOpened: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "control", Name: "sessions_opened_total",
			Help: "Control sessions opened (opens of .gdsfs).",
		}),
		sessions: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Subsystem: "control", Name: "sessions",
			Help: "Control sessions alive (opens of .gdsfs whose last descriptor is not yet closed).",
		}),
		state: newStateCollector(),
	}
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.fuseOps, m.fuseErrors, m.fuseDuration,
		m.ctlRequests, m.ctlErrors, m.ctlDuration,
		m.bytes, m.sessionsOpened, m.sessions, m.state,
	)
	return m
}

// ObserveFUSE records one FUSE operation: its op name (as go-fuse's
// RawFileSystem spells it: "Lookup", "Read", "Ioctl", ...), how long the
// daemon took and its result (0 for success).
func (m *Metrics) ObserveFUSE(op string, d time.Duration, errno syscall.Errno) {
	if m == nil {
		return
	}
	op = bounded(fuseOps, op)
	m.fuseOps.WithLabelValues(op).Inc()
	m.fuseDuration.WithLabelValues(op).Observe(d.Seconds())
	if errno != 0 {
		m.fuseErrors.WithLabelValues(op, ErrnoName(errno)).Inc()
	}
}

// ObserveControl records one control-path request: its command as
// docs/protocol.md names it ("READ", "RELEASE", ...; "xattr:index" for a
// virtual xattr), how long it took and its result (0 for success).
func (m *Metrics) ObserveControl(command string, d time.Duration, errno syscall.Errno) {
	if m == nil {
		return
	}
	command = bounded(controlCommands, command)
	m.ctlRequests.WithLabelValues(command).Inc()
	m.ctlDuration.WithLabelValues(command).Observe(d.Seconds())
	if errno != 0 {
		m.ctlErrors.WithLabelValues(command, ErrnoName(errno)).Inc()
	}
}

// AddBytes records n bytes moved by engine ("host", "posix", "gds",
// "gds-compat", "fuse") in direction "read" (file to memory) or "write".
func (m *Metrics) AddBytes(engine, direction string, n int64) {
	if m == nil || n <= 0 {
		return
	}
	m.bytes.WithLabelValues(bounded(engines, engine), bounded(directions, direction)).Add(float64(n))
}

// SessionOpened counts a new control session (an open of .gdsfs).
func (m *Metrics) SessionOpened() {
	if m != nil {
		m.sessionsOpened.Inc()
		m.sessions.Inc()
	}
}

// SessionClosed counts the end of a control session.
func (m *Metrics) SessionClosed() {
	if m != nil {
		m.sessions.Dec()
	}
}

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

// Gather returns the current value of every family, for `gdsfs status`
// and tests that read figures without HTTP.
func (m *Metrics) Gather() (Snapshot, error) {
	mfs, err := m.reg.Gather()
	if err != nil {
		return nil, err
	}
	return snapshotOf(mfs), nil
}
