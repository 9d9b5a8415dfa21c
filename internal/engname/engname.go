// Package engname holds the transfer engines' names as docs/protocol.md
// (section 5) spells them: the names ctl's engine codes stand for, cufile's
// engines report and metrics labels bytes with.
package engname

// The engines' names.
const (
	None  = "none" // no engine moved the bytes (code 0)
	Host  = "host"
	Posix = "posix"
	GDS   = "gds"
	// GDSCompat is the gds engine's name when cuFile runs in compat mode
	// (no nvidia-fs): POSIX reads inside libcufile, then a copy.
	GDSCompat = "gds-compat"
	// Tier is the daemon's memory tier (PIN): a copy from its memory.
	Tier = "tier"
)
