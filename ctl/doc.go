// Package ctl is gdsfs's control path as a client sees it: the wire protocol
// of the ioctls on <mount>/.gdsfs and on data files (normative text:
// docs/protocol.md) and the Go client (OpenSession, used by the CLI, tests
// and benchmarks). The daemon side is package ctlserver.
//
// ctl imports only the standard library, golang.org/x/sys/unix and
// handoff (TestClientStandsAlone): a program that reads through the control
// path links no FUSE server, cache or engine.
//
// # Wire
//
// Every command is one fixed-size little-endian buffer, _IOWR with the
// same size each way, because FUSE forwards only "restricted" ioctls whose
// size is encoded in the command number. Commands() is the one table of
// the commands (number, name, size, kind of file). wire.go gives each
// message's layout once, as named field offsets that its encoder and
// decoder both use (TestLayoutsMatchProtocolDoc checks them, and the
// command table, against docs/protocol.md); decoders check every length
// and reserved byte and return a syscall.Errno, never panic.
package ctl
