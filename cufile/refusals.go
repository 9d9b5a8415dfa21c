package cufile

import (
	"fmt"
	"os"
	"sort"
	"sync"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// Refusal counts the files one engine was refused for, per cause and
// filesystem: cuFile refuses every file of a filesystem for the same reason
// (5027 without the udev record, no nvidia-fs), so one log line per cause
// says it all and the count says how often.
type Refusal struct {
	Filesystem string `json:"filesystem"` // "dev MAJOR:MINOR" of the backing files
	Cause      string `json:"cause"`
	Files      int64  `json:"files"`
}

type refusalKey struct {
	dev   uint64
	cause string
}

// refusals logs the first refusal of each (filesystem, cause) and counts
// the rest.
type refusals struct {
	log zerolog.Logger

	mu     sync.Mutex
	counts map[refusalKey]int64 // GUARDED_BY(mu)
}

func newRefusals(log zerolog.Logger) *refusals {
	return &refusals{log: log, counts: make(map[refusalKey]int64)}
}

// note records that f (at path) was refused for err; msg and hint are
// logged on the first refusal of its filesystem and cause only.
func (r *refusals) note(f *os.File, path string, err error, msg, hint string) {
	var dev uint64
	if f != nil {
		var st unix.Stat_t
		if unix.Fstat(int(f.Fd()), &st) == nil {
			dev = st.Dev
		}
	}
	k := refusalKey{dev, err.Error()}
	r.mu.Lock()
	r.counts[k]++
	first := r.counts[k] == 1
	r.mu.Unlock()
	if first {
		r.log.Warn().Str("path", path).Str("filesystem", devName(dev)).Err(err).Str("hint", hint).
			Msg(msg + " (logged once per cause and filesystem; gdsfs status counts the files)")
	}
}

// list returns the counts, most files first.
func (r *refusals) list() []Refusal {
	r.mu.Lock()
	out := make([]Refusal, 0, len(r.counts))
	for k, n := range r.counts {
		out = append(out, Refusal{Filesystem: devName(k.dev), Cause: k.cause, Files: n})
	}
	r.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].Files != out[j].Files {
			return out[i].Files > out[j].Files
		}
		return out[i].Filesystem+out[i].Cause < out[j].Filesystem+out[j].Cause
	})
	return out
}

func devName(dev uint64) string {
	return fmt.Sprintf("dev %d:%d", unix.Major(dev), unix.Minor(dev))
}

// refusalHint says what usually fixes a cuFile refusal.
func refusalHint(err error) string {
	if fe, ok := err.(*FileError); ok && fe.Code == fileHandleNotRegistered {
		return "cuFile could not register files of this filesystem: it needs a supported filesystem and the udev record of its block device (/run/udev/data/b<major>:<minor> with ID_FS_TYPE); run gdsfs doctor PATH"
	}
	return "run gdsfs doctor PATH for cuFile's view of the file"
}
