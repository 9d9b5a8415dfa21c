// Package doctor checks whether and how gdsfs can serve a host (and a
// path): every probe gdsfs uses to pick its transfer engine and to mount,
// and the mount a path is on as its daemon reports it. Run returns the
// Report that gdsfs doctor prints (Print) or encodes as JSON.
package doctor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/ctlserver"
	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/internal/mountinfo"
)

// Report is what `gdsfs doctor --json` prints.
type Report struct {
	Probes   []Probe  `json:"probes"`
	Engine   string   `json:"engine"`
	Backend  string   `json:"backend"`
	Why      string   `json:"why"`
	Path     string   `json:"path,omitempty"`
	PathWhy  string   `json:"path_engine_why,omitempty"`
	CanServe bool     `json:"can_serve"`
	Hints    []string `json:"hints,omitempty"`
}

// Probe is one check: ok, or failed (fatal ones stop gdsfs from
// serving at all; the rest only rule out a faster engine or passthrough).
type Probe struct {
	cufile.Probe
	Fatal bool   `json:"fatal,omitempty"`
	Hint  string `json:"hint,omitempty"`
}

// Run runs every probe, and with path (an existing file or directory;
// empty: none) the per-file checks, and says whether gdsfs can serve.
func Run(path string) Report {
	var r Report
	eng, err := cufile.Open(cufile.Config{Engine: cufile.EngineAuto, Log: zerolog.Nop()})
	if err != nil {
		r.Probes = append(r.Probes, Probe{Probe: cufile.Probe{Name: "engines", Detail: err.Error()}, Fatal: true, Hint: "see the error above"})
	} else {
		defer eng.Close()
		rep := eng.Probe()
		for _, p := range rep.Probes {
			r.Probes = append(r.Probes, Probe{Probe: p, Hint: gpuHint(p)})
		}
		r.Engine, r.Backend, r.Why = rep.Engine, rep.Backend, rep.Why
	}
	r.Probes = append(r.Probes, fuseProbes()...)
	if path != "" {
		r.Probes = append(r.Probes, mountProbes(path)...)
	}
	if path != "" && eng != nil {
		r.Path = path
		if r.Backend == "cuda" {
			r.Probes = append(r.Probes, udevProbe(path))
		}
		if st, err := os.Stat(path); err == nil && st.Mode().IsRegular() {
			if r.Backend == "cuda" {
				r.Probes = append(r.Probes, Probe{Probe: eng.ProbeFile(path)})
			}
			f, err := os.Open(path)
			if err == nil {
				e, why := eng.Choose(f, path, 0, -1)
				f.Close()
				r.Engine, r.PathWhy = e.Name(), why
			}
		}
	}
	r.CanServe = true
	for _, p := range r.Probes {
		if !p.OK && p.Fatal {
			r.CanServe = false
		}
		if !p.OK && p.Hint != "" {
			r.Hints = append(r.Hints, p.Hint)
		}
	}
	return r
}

// gpuHint says how to fix a failed GPU probe; none of them is fatal (the
// host or posix engine serves instead).
func gpuHint(p cufile.Probe) string {
	if p.OK {
		return ""
	}
	switch p.Name {
	case "libcuda":
		return "no NVIDIA driver: gdsfs serves with the host engine; install the driver for GPU transfers"
	case "libcufile":
		return "install GPUDirect Storage (libcufile, e.g. the nvidia-gds package) for the gds engine"
	case "nvidia-fs":
		return "load nvidia-fs.ko (nvidia-gds) for peer-to-peer GDS; without it the posix engine is as fast"
	case "udev":
		return "mount /run/udev (containers: -v /run/udev:/run/udev:ro) so cuFile can register files"
	}
	return ""
}

func fuseProbes() []Probe {
	var ps []Probe
	fuse := Probe{Probe: cufile.Probe{Name: "/dev/fuse"}, Fatal: true}
	if f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0); err != nil {
		fuse.Detail = err.Error()
		if errors.Is(err, os.ErrNotExist) {
			fuse.Hint = "load the FUSE module (modprobe fuse) or pass /dev/fuse into the container (--device /dev/fuse)"
		} else {
			fuse.Hint = "give this user read/write access to /dev/fuse, or run gdsfs as root"
		}
	} else {
		f.Close()
		fuse.OK, fuse.Detail = true, "present and openable"
	}
	ps = append(ps, fuse)
	fm := Probe{Probe: cufile.Probe{Name: "fusermount3"}}
	if p, err := exec.LookPath("fusermount3"); err != nil {
		fm.Detail = "not on PATH"
		// Root mounts directly; everyone else needs the setuid helper.
		fm.Fatal = os.Geteuid() != 0
		fm.Hint = "install fuse3 (apt-get install fuse3)"
	} else {
		fm.OK, fm.Detail = true, p
	}
	ps = append(ps, fm)
	pt := Probe{Probe: cufile.Probe{Name: "kernel passthrough"}}
	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		rel := unix.ByteSliceToString(u.Release[:])
		maj, min := kernelVersion(rel)
		pt.OK = maj > 6 || (maj == 6 && min >= 9)
		pt.Detail = "kernel " + rel
		if !pt.OK {
			pt.Detail += ": FUSE passthrough needs Linux >= 6.9; plain reads go through the daemon"
			pt.Hint = "upgrade to Linux >= 6.9 for native-speed reads through the mount"
		}
	}
	return append(ps, pt)
}

// kernelVersion parses "6.18.0-foo" into 6, 18.
func kernelVersion(rel string) (int, int) {
	parts := strings.SplitN(rel, ".", 3)
	if len(parts) < 2 {
		return 0, 0
	}
	maj, _ := strconv.Atoi(parts[0])
	digits := strings.IndexFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' })
	if digits >= 0 {
		parts[1] = parts[1][:digits]
	}
	min, _ := strconv.Atoi(parts[1])
	return maj, min
}

// udevProbe checks the udev record cuFile needs to classify PATH's block
// device (/run/udev/data/b<major>:<minor>).
func udevProbe(path string) Probe {
	p := Probe{Probe: cufile.Probe{Name: "udev record"}}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		p.Detail = err.Error()
		return p
	}
	maj, min := unix.Major(st.Dev), unix.Minor(st.Dev)
	rec := fmt.Sprintf("/run/udev/data/b%d:%d", maj, min)
	b, err := os.ReadFile(rec)
	switch {
	case err != nil:
		p.Detail = fmt.Sprintf("%s: %v (device %d:%d is not a udev-known block device: cuFile will refuse files here)", rec, err, maj, min)
		p.Hint = "cuFile needs udev's record of the backing block device; the posix engine serves without it"
	case !strings.Contains(string(b), "ID_FS_TYPE="):
		p.Detail = rec + " has no ID_FS_TYPE"
		p.Hint = "run udevadm trigger so udev records the filesystem type"
	default:
		p.OK, p.Detail = true, rec
	}
	return p
}

// Print writes r as gdsfs doctor's table, verdict and hints.
func Print(w io.Writer, r Report) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROBE\tRESULT\tDETAIL")
	for _, p := range r.Probes {
		res := "ok"
		switch {
		case !p.OK && p.Fatal:
			res = "FAIL"
		case !p.OK:
			res = "no"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", p.Name, res, p.Detail)
	}
	tw.Flush()
	fmt.Fprintln(w)
	if r.Path != "" && r.PathWhy != "" {
		fmt.Fprintf(w, "verdict: a read of %s uses the %s engine: %s\n", r.Path, r.Engine, r.PathWhy)
	} else {
		fmt.Fprintf(w, "verdict: engine %s, %s memory: %s\n", r.Engine, r.Backend, r.Why)
	}
	if r.CanServe {
		fmt.Fprintln(w, "gdsfs can serve on this host.")
	}
	for _, h := range r.Hints {
		fmt.Fprintf(w, "hint: %s\n", h)
	}
}

// mountProbes checks the gdsfs mount PATH is on, as its daemon reports it
// (STATUS): that it answers, whether kernel passthrough serves plain I/O,
// and which engine serves control-path reads and what it refused. None of
// them is fatal: the host itself can still serve.
func mountProbes(path string) []Probe {
	m, ok := mountinfo.Containing(path)
	if !ok || m.FSType != mountinfo.GDSFSType {
		return nil
	}
	p := Probe{Probe: cufile.Probe{Name: "gdsfs mount"}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := ctl.OpenSession(m.MountPoint)
	if err != nil {
		p.Detail = fmt.Sprintf("%s: %v", m.MountPoint, err)
		p.Hint = "the daemon of " + m.MountPoint + " does not answer: see its log (gdsfs status names it), or remount it"
		if why := mountinfo.Unreachable(m.MountPoint, err); why != "" {
			// Nothing on this mount can be served to this user: the verdict for PATH.
			p.Hint, p.Fatal = why, true
		}
		return []Probe{p}
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
		return []Probe{p}
	}
	p.OK = true
	p.Detail = fmt.Sprintf("%s: daemon pid %d, version %s", m.MountPoint, st.DaemonPID, st.Version)
	if st.LogFile != "" {
		p.Detail += ", log " + st.LogFile
	}
	ps := []Probe{p}
	if pt := st.Passthrough; pt != nil {
		pp := Probe{Probe: cufile.Probe{Name: "mount passthrough", OK: pt.Enabled, Detail: pt.Why}}
		if !pt.Enabled {
			pp.Hint = "plain reads of " + m.MountPoint + " go through the daemon: mount as root on Linux >= 6.9 without --no-passthrough for native speed"
		}
		ps = append(ps, pp)
	}
	eng := Probe{Probe: cufile.Probe{Name: "mount engine", OK: true, Detail: st.Engine}}
	if st.EngineWhy != "" {
		eng.Detail += ": " + st.EngineWhy
	}
	ps = append(ps, eng)
	for _, r := range st.Refusals {
		ps = append(ps, Probe{
			Probe: cufile.Probe{Name: "mount refusals", Detail: fmt.Sprintf("%d files on %s: %s", r.Files, r.Filesystem, r.Cause)},
			Hint:  "cuFile refuses files of " + r.Filesystem + ": run gdsfs doctor FILE on one of them for the per-file checks",
		})
	}
	return ps
}
