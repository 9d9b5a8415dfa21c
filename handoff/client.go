package handoff

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Conn is a client's connection to a Server. It is not safe for
// concurrent use.
type Conn struct {
	c *net.UnixConn
}

// Dial connects to the server at addr. When serverPID is not 0 it checks,
// by the kernel's credentials of the listening process, that the server is
// that process (the daemon's pid from HELLO): a socket name left behind by
// a daemon that exited cannot be taken over by another process to collect
// tokens or hand out memory of its choosing.
func Dial(ctx context.Context, addr string, serverPID int) (*Conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unixpacket", addr)
	if err != nil {
		return nil, fmt.Errorf("handoff: connect to the daemon's slab socket %s: %w", addr, err)
	}
	c := nc.(*net.UnixConn)
	if serverPID != 0 {
		p, err := PeerOf(c)
		if err != nil {
			c.Close()
			return nil, fmt.Errorf("handoff: credentials of %s: %w", addr, err)
		}
		if int(p.PID) != serverPID {
			c.Close()
			return nil, fmt.Errorf("handoff: %s is served by pid %d, not the daemon (pid %d): refusing it", addr, p.PID, serverPID)
		}
	}
	return &Conn{c: c}, nil
}

// Fetch asks for req's descriptor. The daemon's refusal is returned as its
// syscall.Errno (errors.Is works), wrapped with context.
func (c *Conn) Fetch(ctx context.Context, req Request) (*os.File, Reply, error) {
	if dl, ok := ctx.Deadline(); ok {
		_ = c.c.SetDeadline(dl)
	} else {
		_ = c.c.SetDeadline(time.Time{})
	}
	if _, err := c.c.Write(EncodeRequest(req)); err != nil {
		return nil, Reply{}, fmt.Errorf("handoff: send request for slab %d: %w", req.Slab, err)
	}
	buf := make([]byte, ReplyBytes+1)
	oob := make([]byte, unix.CmsgSpace(4*4)) // room for a few: more than one is a protocol error
	n, oobn, flags, _, err := c.c.ReadMsgUnix(buf, oob)
	if errors.Is(err, io.EOF) {
		return nil, Reply{}, fmt.Errorf("handoff: the daemon closed the slab socket without a reply for slab %d (too many connections of this uid at once? retry): %w", req.Slab, err)
	}
	if err != nil {
		return nil, Reply{}, fmt.Errorf("handoff: read reply for slab %d: %w", req.Slab, err)
	}
	var fds []int
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
		if perr == nil {
			for _, m := range msgs {
				if got, err := unix.ParseUnixRights(&m); err == nil {
					fds = append(fds, got...)
				}
			}
		}
	}
	closeAll := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	if flags&unix.MSG_CTRUNC != 0 {
		closeAll()
		return nil, Reply{}, fmt.Errorf("%w: reply for slab %d carried too many descriptors", ErrMalformed, req.Slab)
	}
	rep, err := DecodeReply(buf[:n])
	if err != nil {
		closeAll()
		return nil, Reply{}, err
	}
	if rep.Errno != 0 {
		closeAll()
		return nil, rep, fmt.Errorf("handoff: the daemon refused slab %d: %w", req.Slab, rep.Errno)
	}
	if len(fds) != 1 {
		closeAll()
		return nil, rep, fmt.Errorf("%w: reply for slab %d carried %d descriptors, want 1", ErrMalformed, req.Slab, len(fds))
	}
	unix.CloseOnExec(fds[0])
	return os.NewFile(uintptr(fds[0]), fmt.Sprintf("gdsfs-slab-%d", req.Slab)), rep, nil
}

// Close closes the connection.
func (c *Conn) Close() error { return c.c.Close() }

// Fetch is Dial, one Conn.Fetch and Close.
func Fetch(ctx context.Context, addr string, serverPID int, req Request) (*os.File, Reply, error) {
	c, err := Dial(ctx, addr, serverPID)
	if err != nil {
		return nil, Reply{}, err
	}
	defer c.Close()
	return c.Fetch(ctx, req)
}
