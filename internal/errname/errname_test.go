package errname

import (
	"syscall"
	"testing"
)

// TestOf: the names STATUS's counters.errors has always used (ctl's old
// table), EAGAIN and EOPNOTSUPP rather than their aliases, and a number
// for what has no name.
func TestOf(t *testing.T) {
	tests := []struct {
		e    syscall.Errno
		want string
	}{
		{syscall.ENOTTY, "ENOTTY"}, {syscall.EINVAL, "EINVAL"}, {syscall.EPROTO, "EPROTO"},
		{syscall.EPERM, "EPERM"}, {syscall.ERANGE, "ERANGE"}, {syscall.E2BIG, "E2BIG"},
		{syscall.EAGAIN, "EAGAIN"}, {syscall.ENODEV, "ENODEV"}, {syscall.ENOENT, "ENOENT"},
		{syscall.ENODATA, "ENODATA"}, {syscall.EBADF, "EBADF"}, {syscall.EROFS, "EROFS"},
		{syscall.EINTR, "EINTR"}, {syscall.EIO, "EIO"}, {syscall.ENOSPC, "ENOSPC"},
		{syscall.EDQUOT, "EDQUOT"}, {syscall.EFBIG, "EFBIG"}, {syscall.EOPNOTSUPP, "EOPNOTSUPP"},
		{syscall.EACCES, "EACCES"},
		{0, "errno0"}, {255, "errno255"},
	}
	for _, tc := range tests {
		if got := Of(tc.e); got != tc.want {
			t.Errorf("Of(%d) = %q, want %q", int(tc.e), got, tc.want)
		}
	}
}
