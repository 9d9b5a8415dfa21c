package ctlserver

import (
	"encoding/json"
	"syscall"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/fs"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/tier"
)

// Stats is the document of user.gdsfs.stats and STATUS.
type Stats struct {
	DaemonPID uint32       `json:"daemon_pid"`
	Version   string       `json:"version"`
	Engine    string       `json:"engine"`
	Sessions  int          `json:"sessions"`
	Leases    int          `json:"leases"`
	Pool      gpubuf.Stats `json:"pool"`
	Counters  CounterStats `json:"counters"`
	// Index is the shard-index cache's figures; absent when the mount
	// serves no indexes (or its Indexer keeps none).
	Index *cache.IndexStats `json:"index,omitempty"`
	// LogFile is the daemon's log file; absent when it logs to stderr.
	LogFile string `json:"log_file,omitempty"`
	// EngineWhy says why Engine serves by default.
	EngineWhy string `json:"engine_why,omitempty"`
	// DirectWriteMinBytes is the smallest 4 KiB-aligned WRITE body the
	// posix and host engines write with O_DIRECT; absent (0) when they
	// write through the page cache (--direct-io never).
	DirectWriteMinBytes int64 `json:"direct_write_min_bytes,omitempty"`
	// Refusals counts files an engine refused, per cause and filesystem.
	Refusals []EngineRefusal `json:"engine_refusals,omitempty"`
	// Passthrough is the mount's kernel passthrough state; absent before
	// the mount is up.
	Passthrough *PassthroughState `json:"passthrough,omitempty"`
	// Tier is the memory tier's figures; absent without one.
	Tier *tier.Stats `json:"tier,omitempty"`
	// OpenFiles is the daemon's descriptors held by each uid's opens on
	// the mount and their budget; absent before the mount is up.
	OpenFiles *fs.OpenStats `json:"open_files,omitempty"`
}

// EngineRefusal counts the files an engine was refused for, for one cause
// on one filesystem (cuFile refuses all files of a filesystem alike).
type EngineRefusal struct {
	Filesystem string `json:"filesystem"`
	Cause      string `json:"cause"`
	Files      int64  `json:"files"`
}

// PassthroughState says whether the kernel reads and writes backing files
// itself, and why (or why not).
type PassthroughState struct {
	Enabled bool   `json:"enabled"`
	Why     string `json:"why"`
}

// Mounted gives the server the running mount, whose passthrough state
// STATUS reports; the CLI calls it once the mount is ready.
func (s *Server) Mounted(m *fs.Server) { s.mount.Store(m) }

// indexStatser is the optional part of an Indexer that reports its cache
// figures (*cache.Indexes has it).
type indexStatser interface{ Stats() cache.IndexStats }

// StatsFor returns the snapshot uid may see: root sees everything; any
// other uid sees its own sessions and per-uid figures, and only totals of
// everyone else's (who uses the node, and how much, is not its business).
func (s *Server) StatsFor(uid uint32) Stats {
	st := s.Stats()
	if uid == 0 {
		return st
	}
	own := st.Pool.Sessions[:0:0]
	for _, ss := range st.Pool.Sessions {
		if ss.UID == uid {
			own = append(own, ss)
		}
	}
	st.Pool.Sessions = own
	uids := st.Pool.UIDs[:0:0]
	for _, u := range st.Pool.UIDs {
		if u.UID == uid {
			uids = append(uids, u)
		}
	}
	st.Pool.UIDs = uids
	st.Tier = s.tierStats(uid)
	st.Counters.Readaheads, st.Counters.ReadaheadBytes, st.Counters.ReadaheadDropped = 0, 0, 0
	s.ra.count(&st.Counters, uid)
	if st.OpenFiles != nil {
		ownOpens := st.OpenFiles.UIDs[:0:0]
		for _, u := range st.OpenFiles.UIDs {
			if u.UID == uid {
				ownOpens = append(ownOpens, u)
			}
		}
		st.OpenFiles.UIDs = ownOpens
	}
	return st
}

// Stats returns a snapshot of the control path's figures, every uid's
// included (see StatsFor).
func (s *Server) Stats() Stats {
	st := Stats{DaemonPID: s.pid, Version: s.opts.Version, LogFile: s.opts.LogFile, Engine: s.opts.Engine, EngineWhy: s.opts.EngineWhy,
		DirectWriteMinBytes: s.opts.DirectWriteMinBytes,
		Pool:                s.opts.Pool.Stats(), Counters: s.counters.snapshot()}
	s.ra.count(&st.Counters, 0)
	if s.opts.Refusals != nil {
		st.Refusals = s.opts.Refusals()
	}
	if m := s.mount.Load(); m != nil {
		on, why := m.Passthrough()
		st.Passthrough = &PassthroughState{Enabled: on, Why: why}
		of := m.OpenStats()
		st.OpenFiles = &of
	}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		st.Sessions += len(sh.sessions)
		sh.mu.Unlock()
	}
	uuids := s.uuids()
	for i, d := range st.Pool.Devices {
		st.Leases += d.Leases
		if uuids != nil && d.Device >= 0 && d.Device < len(uuids) {
			st.Pool.Devices[i].UUID = uuids[d.Device]
		}
	}
	st.Tier = s.tierStats(0)
	if x, ok := s.opts.Indexes.(indexStatser); ok {
		is := x.Stats()
		st.Index = &is
	}
	return st
}

func (s *Server) statsJSON(uid uint32) ([]byte, syscall.Errno) {
	b, err := json.Marshal(s.StatsFor(uid))
	if err != nil {
		s.opts.Log.Error().Err(err).Msg("BUG: ctl: encode stats")
		return nil, syscall.EIO
	}
	return b, 0
}
