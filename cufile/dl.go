package cufile

import (
	"fmt"

	"github.com/ebitengine/purego"
)

// rtldNodelete keeps a library mapped even if someone dlcloses it: libcufile
// uses thread_local storage and crashes when unloaded (cuCIM #158). gdsfs
// never calls Dlclose; the flag guards against the loader doing it for us.
const rtldNodelete = 0x01000

// library is a dlopened shared library.
type library struct {
	name   string
	handle uintptr
}

func openLibrary(name, hint string) (*library, error) {
	h, err := purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL|rtldNodelete)
	if err != nil {
		return nil, &LibraryError{Lib: name, Hint: hint, Err: err}
	}
	return &library{name: name, handle: h}, nil
}

// bind resolves each name into the matching pointer of fns. A name with
// alternatives ("a|b") takes the first one found. optional names may be
// missing (their pointer stays 0).
func (l *library) bind(fns map[string]*uintptr, optional map[string]bool) error {
	for names, p := range fns {
		var last error
		for _, n := range splitAlternatives(names) {
			sym, err := purego.Dlsym(l.handle, n)
			if err == nil && sym != 0 {
				*p = sym
				last = nil
				break
			}
			last = err
		}
		if *p == 0 && !optional[names] {
			return &LibraryError{Lib: l.name, Hint: "the library is too old for gdsfs", Err: fmt.Errorf("symbol %s: %v", names, last)}
		}
	}
	return nil
}

func splitAlternatives(s string) []string {
	var out []string
	start := 0
	for i := 0; i < len(s); i++ {
		if s[i] == '|' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return append(out, s[start:])
}
