// Package handoff hands the file descriptor of a slab's memory to a process
// that may map it, over a unix socket, and to no other process.
//
// A slab handle that travels as bytes (a legacy CUDA IPC handle, a path) is
// a bearer capability: whoever learns the bytes can try to open them. A file
// descriptor passed with SCM_RIGHTS is not: it reaches only the process the
// daemon chose to send it to, and the daemon chooses by the kernel's word on
// who is connected (SO_PEERCRED), not by anything the client says. The
// descriptor is a CUDA virtual-memory shareable handle
// (cuMemExportToShareableHandle with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
// for GPU slabs and the shared-memory file for host slabs; either way the
// physical memory behind it lives until the last process holding a
// descriptor or a mapping of it lets go, so a mapping a client made stays
// valid after the daemon frees the slab, and the daemon never hands that
// memory to anyone else (gpubuf keeps slab memory per uid for its life).
//
// # Protocol
//
// The socket is SOCK_SEQPACKET (message boundaries kept). Each request is
// one RequestBytes message (EncodeRequest): a session token and a slab id.
// Each reply is one ReplyBytes message (DecodeReply) carrying an errno, and,
// when the errno is 0, exactly one descriptor as SCM_RIGHTS ancillary data.
// A connection may carry any number of requests, one at a time. The
// connection is closed by the server on a malformed message, after
// the server's idle timeout without a request, and when the server stops.
// docs/protocol.md ("Slab descriptors") is normative.
//
// This package is the wire format and the client (Dial, Fetch); it imports
// only the standard library and golang.org/x/sys/unix, so ctl's client
// stays a leaf. The daemon's side is package handoffserver.
package handoff
