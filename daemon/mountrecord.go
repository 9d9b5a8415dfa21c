package daemon

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/gdsfs/gdsfs/internal/mountinfo"
)

// RecordDir is where root daemons record which process serves each of
// their mounts (one file per FUSE connection), so that gdsfs unmount,
// mount, status and doctor can name a daemon that no longer answers: the
// mount itself cannot be asked then.
const RecordDir = "/run/gdsfs/mounts"

// MountRecord is what a daemon records of its mount.
type MountRecord struct {
	PID int `json:"pid"`
	// StartTime is the process's start time (field 22 of /proc/PID/stat,
	// in clock ticks since boot): with the pid it names the process even
	// after the pid is reused.
	StartTime  uint64 `json:"start_time"`
	Mountpoint string `json:"mountpoint"`
}

// RecordPath is where a root daemon records that it serves mount m.
func RecordPath(m mountinfo.Entry) string { return recordPath(RecordDir, m) }

// recordPath is the record in dir of mount m's connection. Connection
// numbers are reused only once the old connection is gone.
func recordPath(dir string, m mountinfo.Entry) string {
	return filepath.Join(dir, fmt.Sprintf("conn-%d.json", m.ConnID()))
}

// WriteMountRecord records that this process serves the FUSE mount at
// mountpoint, and returns a function that removes the record. Only root
// daemons record (RecordDir is root's); for others it does nothing.
func WriteMountRecord(mountpoint string) (remove func(), err error) {
	if os.Geteuid() != 0 {
		return func() {}, nil
	}
	ms, err := mountinfo.Read()
	if err != nil {
		return func() {}, err
	}
	m, ok := mountinfo.Topmost(ms, mountpoint)
	if !ok {
		return func() {}, fmt.Errorf("record the mount of %s: not in the mount table", mountpoint)
	}
	sweepRecords(RecordDir, ms)
	return writeRecord(RecordDir, m, os.Getpid())
}

// sweepRecords removes the records in dir of connections that are not
// among the mounts ms (daemons that crashed left them), best effort.
func sweepRecords(dir string, ms []mountinfo.Entry) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	live := map[string]bool{}
	for _, m := range ms {
		live[filepath.Base(recordPath(dir, m))] = true
	}
	for _, e := range ents {
		n := e.Name()
		if strings.HasPrefix(n, "conn-") && strings.HasSuffix(n, ".json") && !live[n] {
			os.Remove(filepath.Join(dir, n))
		}
		// A writer's temporary file, left by a crash between write and
		// rename: its writer's pid is in its name.
		if _, pid, ok := strings.Cut(n, ".json.tmp"); ok && strings.HasPrefix(n, "conn-") {
			if _, err := os.Stat("/proc/" + pid); err != nil && pid != "" {
				os.Remove(filepath.Join(dir, n))
			}
		}
	}
}

// writeRecord records in dir that process pid serves mount m.
func writeRecord(dir string, m mountinfo.Entry, pid int) (remove func(), err error) {
	nothing := func() {}
	start, err := startTime(pid)
	if err != nil {
		return nothing, err
	}
	rec := MountRecord{PID: pid, StartTime: start, Mountpoint: m.MountPoint}
	b, err := json.Marshal(rec)
	if err != nil {
		return nothing, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nothing, fmt.Errorf("record the mount of %s: %w", m.MountPoint, err)
	}
	if st, err := os.Lstat(dir); err != nil || !st.IsDir() || !trusted(st) {
		// Others could plant links (for root to write through) or
		// forged records there.
		return nothing, fmt.Errorf("record the mount of %s: %s is not a directory of root's that only root may write (%v): chmod 755 it, or remove it", m.MountPoint, dir, err)
	}
	p := recordPath(dir, m)
	tmp := p + ".tmp" + strconv.Itoa(os.Getpid())
	os.Remove(tmp) // a crashed writer's; O_EXCL then creates anew, never through a link
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err == nil {
		_, err = f.Write(append(b, '\n'))
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		os.Remove(tmp)
		return nothing, fmt.Errorf("record the mount of %s: %w", m.MountPoint, err)
	}
	if err := os.Rename(tmp, p); err != nil {
		os.Remove(tmp)
		return nothing, fmt.Errorf("record the mount of %s: %w", m.MountPoint, err)
	}
	return func() {
		// Only our own record: a later daemon may own the number now.
		if r, ok := readRecord(p); ok && r == rec {
			os.Remove(p)
		}
	}, nil
}

// removeRecordOf removes the record in dir of mount m's connection once
// m was aborted and detached: the daemon it names no longer serves that
// connection, and a later mount that gets the number must not be taken
// for it (a stopped daemon would not remove it itself).
func removeRecordOf(dir string, m mountinfo.Entry) {
	p := recordPath(dir, m)
	if r, ok := readRecord(p); ok && r.Mountpoint == m.MountPoint {
		os.Remove(p)
	}
}

// trusted reports whether a record file or directory with info st can
// only have been written by root or this user: owned by one of them, not
// a link, and writable by no one else. Only what a root daemon (or this
// user's own) wrote is believed.
func trusted(st os.FileInfo) bool {
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !ok || st.Mode()&os.ModeSymlink != 0 || st.Mode().Perm()&0o022 != 0 {
		return false
	}
	return sys.Uid == 0 || int(sys.Uid) == os.Geteuid()
}

// readRecord reads the record at p; a record in a directory, or a file,
// that others may write is none (trusted).
func readRecord(p string) (MountRecord, bool) {
	if st, err := os.Lstat(filepath.Dir(p)); err != nil || !st.IsDir() || !trusted(st) {
		return MountRecord{}, false
	}
	f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return MountRecord{}, false
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() || !trusted(st) {
		return MountRecord{}, false
	}
	b, err := io.ReadAll(io.LimitReader(f, 4096))
	if err != nil {
		return MountRecord{}, false
	}
	var r MountRecord
	if json.Unmarshal(b, &r) != nil || r.PID <= 0 {
		return MountRecord{}, false
	}
	return r, true
}

// ProcState is what a process is doing, as /proc says.
type ProcState int

// The states of a daemon process that matter to its mount.
const (
	// ProcGone: no such process (or the pid now names another one).
	ProcGone ProcState = iota
	// ProcRunning: alive and not stopped (running, sleeping, in I/O).
	ProcRunning
	// ProcStopped: stopped by a signal (SIGSTOP, SIGTSTP) or a tracer.
	ProcStopped
	// ProcZombie: it exited, or is exiting but one of its threads is
	// stuck in the kernel (a daemon waiting for its own FUSE answer).
	ProcZombie
)

func (s ProcState) String() string {
	switch s {
	case ProcRunning:
		return "running"
	case ProcStopped:
		return "stopped"
	case ProcZombie:
		return "a zombie"
	}
	return "gone"
}

// recordedDaemon names the process recorded as serving mount m and what it is
// doing: pid 0 when no daemon recorded it (a daemon of another uid, or an
// older version).
func recordedDaemon(m mountinfo.Entry) (pid int, state ProcState) {
	return recordedDaemonIn(RecordDir, m)
}

// recordedDaemonIn is recordedDaemon with the records in dir.
func recordedDaemonIn(dir string, m mountinfo.Entry) (pid int, state ProcState) {
	r, ok := readRecord(recordPath(dir, m))
	if !ok || r.Mountpoint != m.MountPoint {
		return 0, ProcGone
	}
	start, err := startTime(r.PID)
	if err != nil || start != r.StartTime {
		return r.PID, ProcGone
	}
	return r.PID, procState(r.PID)
}

// procStat returns the fields of /proc/PID/stat after the command name.
func procStat(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	// pid (comm) STATE ...: comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	return strings.Fields(string(b[i+1:])), nil
}

// startTime is process pid's start time (field 22 of /proc/PID/stat).
func startTime(pid int) (uint64, error) {
	f, err := procStat(pid)
	if err != nil {
		return 0, err
	}
	if len(f) < 20 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	return strconv.ParseUint(f[19], 10, 64)
}

// procState reads process pid's state. A daemon that was killed while
// one of its threads waited for its own FUSE answer cannot exit: its
// leader shows as a zombie, or (when the stuck thread is the leader) the
// SIGKILL stays pending on it.
func procState(pid int) ProcState {
	f, err := procStat(pid)
	if err != nil || len(f) == 0 {
		return ProcGone
	}
	switch f[0] {
	case "Z", "X":
		return ProcZombie
	}
	if killPending(pid) {
		return ProcZombie
	}
	if f[0] == "T" || f[0] == "t" {
		return ProcStopped
	}
	return ProcRunning
}

// killPending reports whether a SIGKILL is pending on process pid (its
// own or its thread group's pending set, /proc/PID/status).
func killPending(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false
	}
	return sigPending(string(b), syscall.SIGKILL)
}

// sigPending reports whether /proc/PID/status text st has sig in its
// SigPnd or ShdPnd mask.
func sigPending(st string, sig syscall.Signal) bool {
	for _, l := range strings.Split(st, "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok || (k != "SigPnd" && k != "ShdPnd") {
			continue
		}
		mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		if err == nil && mask&(1<<(uint(sig)-1)) != 0 {
			return true
		}
	}
	return false
}
