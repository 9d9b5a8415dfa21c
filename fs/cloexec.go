package fs

import (
	"os"
	"strconv"
	"syscall"
)

// closeFuseFdsOnExec marks every /dev/fuse descriptor of this process
// close-on-exec. go-fuse opens /dev/fuse without O_CLOEXEC when it mounts
// directly (as root), so any program this process starts afterwards
// (fusermount3, a test's CLI) would inherit the connection: it would keep
// the connection alive after the server dies, and a child blocked on the
// mount would wait for an answer forever instead of getting ENOTCONN. A
// program started between go-fuse's open and this call can still inherit
// it; nothing here starts one then.
func closeFuseFdsOnExec() error {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return err
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && target == "/dev/fuse" {
			syscall.CloseOnExec(fd)
		}
	}
	return nil
}
