package handoff

import (
	"net"

	"golang.org/x/sys/unix"
)

// Peer is the kernel's word on the process at the other end of a
// connection (SO_PEERCRED, taken when it connected).
type Peer struct {
	PID      int32
	UID, GID uint32
}

// PeerOf returns the kernel's credentials of the process at the other end
// of c (SO_PEERCRED).
func PeerOf(c *net.UnixConn) (Peer, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return Peer{}, err
	}
	var cred *unix.Ucred
	var gerr error
	if err := raw.Control(func(fd uintptr) {
		cred, gerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Peer{}, err
	}
	if gerr != nil {
		return Peer{}, gerr
	}
	return Peer{PID: cred.Pid, UID: cred.Uid, GID: cred.Gid}, nil
}
