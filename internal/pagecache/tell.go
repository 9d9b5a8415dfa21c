package pagecache

import "syscall"

// Asker is the user a residency question is asked for: the filesystem
// uid, and whether the user is in a group (the primary group or a
// supplementary one).
type Asker struct {
	UID     uint32
	InGroup func(gid uint32) bool // nil: in no group
}

// MayTell reports whether the kernel would tell asker the page-cache
// residency of the file of st through a descriptor (writable: open for
// writing). cachestat(2) and mincore(2) answer only for a descriptor open
// for writing, the file's owner (or a holder of CAP_FOWNER: uid 0 here),
// or a user the file's permission lets write (Linux 5.2+ for mincore,
// can_do_mincore; cachestat the same since it exists). Write permission is
// read from the mode bits in the kernel's order (owner, else group, else
// others); POSIX ACLs are not consulted, so a write granted only by an
// ACL counts as none (the answer errs towards not telling). InGroup is
// called only when the answer depends on it (the group's and others' write
// bits differ).
func MayTell(st *syscall.Stat_t, asker Asker, writable bool) bool {
	group, others := st.Mode&0o020 != 0, st.Mode&0o002 != 0
	switch {
	case writable, asker.UID == 0, st.Uid == asker.UID:
		return true
	case group == others: // membership decides nothing: not asked
		return group
	case asker.InGroup != nil && asker.InGroup(st.Gid):
		return group
	default:
		return others
	}
}
