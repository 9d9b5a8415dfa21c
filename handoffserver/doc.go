// Package handoffserver is the daemon's side of package handoff: it serves
// slab descriptors over the unix socket whose protocol handoff defines
// (docs/protocol.md, "Slab descriptors").
//
// # Who gets what
//
// The server reads the peer's credentials once per connection and passes
// them, with each request, to a Source (ctlserver's Server is the daemon's): the
// source checks that the token names a live session of the peer's uid that
// holds a lease in the slab, and returns a new descriptor, which the server
// sends and closes. A token of another uid, a forged token, a slab without
// a lease of the session: an errno, no descriptor.
//
// # Limits
//
// At most Options.MaxConnsPerUID connections per uid and Options.MaxConns
// in all are served at once; a connection beyond either is closed at once.
// A client that dies mid-request leaves nothing behind: its connection
// reads EOF (or the send fails), and the server's copy of the descriptor is
// closed after every send, successful or not.
package handoffserver
