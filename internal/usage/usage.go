// Package usage marks the errors a user caused (a bad flag value, a path
// that is not on a mount, a device the daemon does not serve), so that the
// command line tells them from failures: gdsfs exits with its usage status
// for them. The packages behind gdsfs's subcommands (bench, reader,
// pagecache) return them; cmd/gdsfs turns them into the exit status. The
// message of each must say what is wrong and what to do.
package usage

import (
	"errors"
	"fmt"
)

// Error is an error the user caused. It wraps the error that says why.
type Error struct{ Err error }

func (e Error) Error() string { return e.Err.Error() }

// Unwrap returns the wrapped error.
func (e Error) Unwrap() error { return e.Err }

// Errorf returns an Error with a formatted message (fmt.Errorf: %w wraps).
func Errorf(format string, args ...any) error {
	return Error{fmt.Errorf(format, args...)}
}

// Wrap marks err as caused by the user; nil stays nil.
func Wrap(err error) error {
	if err == nil {
		return nil
	}
	return Error{err}
}

// Is reports whether err, or an error it wraps, is an Error.
func Is(err error) bool {
	var e Error
	return errors.As(err, &e)
}
