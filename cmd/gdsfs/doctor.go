package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gdsfs/gdsfs/cufile"
)

// doctorReport is what `gdsfs doctor --json` prints.
type doctorReport struct {
	Probes   []doctorProbe `json:"probes"`
	Engine   string        `json:"engine"`
	Backend  string        `json:"backend"`
	Why      string        `json:"why"`
	Path     string        `json:"path,omitempty"`
	PathWhy  string        `json:"path_engine_why,omitempty"`
	CanServe bool          `json:"can_serve"`
	Hints    []string      `json:"hints,omitempty"`
}

// doctorProbe is one check: ok, or failed (fatal ones stop gdsfs from
// serving at all; the rest only rule out a faster engine or passthrough).
type doctorProbe struct {
	cufile.Probe
	Fatal bool   `json:"fatal,omitempty"`
	Hint  string `json:"hint,omitempty"`
}

func newDoctorCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "doctor [PATH]",
		Short: "Check whether and how gdsfs can serve this host (and PATH)",
		Long: `Runs every probe gdsfs uses to pick its transfer engine (libcuda, CUDA
devices, libcufile, cuFileDriverOpen, /dev/nvidia-fs*, udev) and to mount
(/dev/fuse, fusermount3, kernel passthrough), and with PATH the per-file
checks (udev record of PATH's block device, cuFileHandleRegister) and, when
PATH is on a gdsfs mount, that mount as its daemon reports it (passthrough
on or off and why, the engine and the files it refused). Prints a
table, the verdict (which engine a read of PATH would use, and why not the
faster ones) and how to fix what fails.

Exits 0 when gdsfs can serve (a CPU-only host with the host engine counts),
1 with a hint when it cannot.`,
		Example: `  gdsfs doctor
  gdsfs doctor /data/shard-000.tar
  gdsfs doctor --json /data | jq .engine`,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			path := ""
			if len(args) == 1 {
				path = args[0]
				if _, err := os.Stat(path); err != nil {
					return usagef("PATH %q: %v; name an existing file or directory", path, err)
				}
			}
			r := runDoctor(path)
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				if err := enc.Encode(r); err != nil {
					return err
				}
			} else {
				printDoctor(out, r)
			}
			if !r.CanServe {
				return fmt.Errorf("gdsfs cannot serve on this host: %s", strings.Join(r.Hints, "; "))
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}

func runDoctor(path string) doctorReport {
	var r doctorReport
	eng, err := cufile.Open(cufile.Config{Engine: cufile.EngineAuto, Log: zerolog.Nop()})
	if err != nil {
		r.Probes = append(r.Probes, doctorProbe{Probe: cufile.Probe{Name: "engines", Detail: err.Error()}, Fatal: true, Hint: "see the error above"})
	} else {
		defer eng.Close()
		rep := eng.Probe()
		for _, p := range rep.Probes {
			r.Probes = append(r.Probes, doctorProbe{Probe: p, Hint: gpuHint(p)})
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
				r.Probes = append(r.Probes, doctorProbe{Probe: eng.ProbeFile(path)})
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

func fuseProbes() []doctorProbe {
	var ps []doctorProbe
	fuse := doctorProbe{Probe: cufile.Probe{Name: "/dev/fuse"}, Fatal: true}
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
	fm := doctorProbe{Probe: cufile.Probe{Name: "fusermount3"}}
	if p, err := exec.LookPath("fusermount3"); err != nil {
		fm.Detail = "not on PATH"
		// Root mounts directly; everyone else needs the setuid helper.
		fm.Fatal = os.Geteuid() != 0
		fm.Hint = "install fuse3 (apt-get install fuse3)"
	} else {
		fm.OK, fm.Detail = true, p
	}
	ps = append(ps, fm)
	pt := doctorProbe{Probe: cufile.Probe{Name: "kernel passthrough"}}
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
func udevProbe(path string) doctorProbe {
	p := doctorProbe{Probe: cufile.Probe{Name: "udev record"}}
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

func printDoctor(w io.Writer, r doctorReport) {
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
