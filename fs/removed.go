package fs

import "golang.org/x/sys/unix"

// removing returns the identity of the regular file at name in dir when
// the daemon is about to remove that name (replaces: false for a removal
// that replaces nothing, an exchange or a directory) and Options.Removed
// wants to know: one fstatat, only then. A name that another request
// replaces between this and the removal reports the wrong inode, which
// costs the hook a check of a file that is still linked (the cuFile
// sweeper still finds the right one).
func (m *mountState) removing(dir int, name string, replaces bool) (unix.Stat_t, bool) {
	var st unix.Stat_t
	if m.removedHook == nil || !replaces {
		return st, false
	}
	if err := unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return st, false
	}
	return st, true
}

// removed tells Options.Removed of the file removing stat'ed, once its
// name is gone.
func (m *mountState) removed(st unix.Stat_t, ok bool) {
	if ok {
		m.removedHook(uint64(st.Dev), st.Ino)
	}
}
