package ctl

import (
	"os/exec"
	"strings"
	"testing"
)

// leafDeps are the only packages outside the standard library the client
// may link: a program that reads through the control path must not link a
// FUSE server, the daemon's caches or its engines.
var leafDeps = map[string]bool{
	"github.com/gdsfs/gdsfs/ctl":     true,
	"github.com/gdsfs/gdsfs/handoff": true,
	"golang.org/x/sys/unix":          true,
	// The engines' names (constants; it imports nothing: -deps would list it).
	"github.com/gdsfs/gdsfs/internal/engname": true,
}

// TestClientStandsAlone: ctl's import graph (tests excluded) is the
// standard library, x/sys and handoff: no go-fuse, ristretto, zerolog,
// cache, gpubuf, cufile or fs. It asks the go tool, so it runs wherever the
// package is built from source.
func TestClientStandsAlone(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool on PATH to list the imports with")
	}
	out, err := exec.Command(goTool, "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			t.Fatalf("go list -deps: %v: %s", err, ee.Stderr)
		}
		t.Fatalf("go list -deps: %v", err)
	}
	var seen int
	for _, p := range strings.Fields(string(out)) {
		seen++
		if !leafDeps[p] {
			t.Errorf("ctl imports %s (directly or not): the client package may import only the standard library, golang.org/x/sys/unix and handoff; move what needs it to ctlserver", p)
		}
	}
	if seen == 0 {
		t.Fatal("go list -deps listed nothing, not even ctl itself")
	}
}
