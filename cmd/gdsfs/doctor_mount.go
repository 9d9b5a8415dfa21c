package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/cufile"
)

// containingMount returns the mount point of the filesystem path is on
// (walking up to the nearest mount point) and its type.
func containingMount(path string) (mountEntry, bool) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return mountEntry{}, false
	}
	if st, err := os.Stat(abs); err == nil && !st.IsDir() {
		abs = filepath.Dir(abs)
	}
	for d := abs; ; d = filepath.Dir(d) {
		if m, ok, err := mountAt(d); err == nil && ok {
			return m, true
		}
		if d == "/" {
			return mountEntry{}, false
		}
	}
}

// mountProbes checks the gdsfs mount PATH is on, as its daemon reports it
// (STATUS): that it answers, whether kernel passthrough serves plain I/O,
// and which engine serves control-path reads and what it refused. None of
// them is fatal: the host itself can still serve.
func mountProbes(path string) []doctorProbe {
	m, ok := containingMount(path)
	if !ok || m.FSType != "fuse.gdsfs" {
		return nil
	}
	p := doctorProbe{Probe: cufile.Probe{Name: "gdsfs mount"}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := ctl.OpenSession(m.MountPoint)
	if err != nil {
		p.Detail = fmt.Sprintf("%s: %v", m.MountPoint, err)
		p.Hint = "the daemon of " + m.MountPoint + " does not answer: see its log (gdsfs status names it), or remount it"
		return []doctorProbe{p}
	}
	defer cl.Close()
	doc, err := cl.Status(ctx)
	var st ctlserver.Stats
	if err == nil {
		err = json.Unmarshal(doc, &st)
	}
	if err != nil {
		p.Detail = fmt.Sprintf("%s: status: %v", m.MountPoint, err)
		p.Hint = "the daemon of " + m.MountPoint + " does not report its status: upgrade gdsfs or remount"
		return []doctorProbe{p}
	}
	p.OK = true
	p.Detail = fmt.Sprintf("%s: daemon pid %d, version %s", m.MountPoint, st.DaemonPID, st.Version)
	if st.LogFile != "" {
		p.Detail += ", log " + st.LogFile
	}
	ps := []doctorProbe{p}
	if pt := st.Passthrough; pt != nil {
		pp := doctorProbe{Probe: cufile.Probe{Name: "mount passthrough", OK: pt.Enabled, Detail: pt.Why}}
		if !pt.Enabled {
			pp.Hint = "plain reads of " + m.MountPoint + " go through the daemon: mount as root on Linux >= 6.9 without --no-passthrough for native speed"
		}
		ps = append(ps, pp)
	}
	eng := doctorProbe{Probe: cufile.Probe{Name: "mount engine", OK: true, Detail: st.Engine}}
	if st.EngineWhy != "" {
		eng.Detail += ": " + st.EngineWhy
	}
	ps = append(ps, eng)
	for _, r := range st.Refusals {
		ps = append(ps, doctorProbe{
			Probe: cufile.Probe{Name: "mount refusals", Detail: fmt.Sprintf("%d files on %s: %s", r.Files, r.Filesystem, r.Cause)},
			Hint:  "cuFile refuses files of " + r.Filesystem + ": run gdsfs doctor FILE on one of them for the per-file checks",
		})
	}
	return ps
}
