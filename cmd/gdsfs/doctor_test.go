package main

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/doctor"
)

func TestDoctorJSON(t *testing.T) {
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse on this host")
	}
	f := t.TempDir() + "/data"
	if err := os.WriteFile(f, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := newDoctorCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs([]string{"--json", f})
	if err := cmd.Execute(); err != nil {
		t.Fatalf("doctor failed on a host that can serve: %v\n%s", err, out.String())
	}
	var r doctor.Report
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatalf("doctor --json output does not parse: %v\n%s", err, out.String())
	}
	if !r.CanServe || r.Engine == "" || r.Why == "" || r.Path != f || r.PathWhy == "" {
		t.Errorf("report %+v: want can_serve with an engine and reasons for the host and the file", r)
	}
	names := map[string]bool{}
	for _, p := range r.Probes {
		names[p.Name] = true
	}
	for _, want := range []string{"libcuda", "/dev/fuse", "fusermount3", "kernel passthrough"} {
		if !names[want] {
			t.Errorf("probe %q missing from %v", want, names)
		}
	}
}

func TestDoctorTable(t *testing.T) {
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skip("no /dev/fuse on this host")
	}
	cmd := newDoctorCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetArgs(nil)
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"PROBE", "RESULT", "/dev/fuse", "verdict: engine", "gdsfs can serve"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
}

func TestDoctorBadPathIsUsageError(t *testing.T) {
	if code := run([]string{"doctor", "/nonexistent/gdsfs-doctor"}); code != exitUsage {
		t.Errorf("exit code %d, want %d", code, exitUsage)
	}
}

// TestDoctorVerdictNamesOnlyBlockers: the error line of a host gdsfs
// cannot serve names what stops it, not the hints for a faster engine.
func TestDoctorVerdictNamesOnlyBlockers(t *testing.T) {
	r := doctor.Report{Probes: []doctor.Probe{
		{Probe: cufile.Probe{Name: "libcuda", Detail: "not loadable"}, Hint: "no NVIDIA driver: install it"},
		{Probe: cufile.Probe{Name: "/dev/fuse", Detail: "permission denied"}, Fatal: true, Hint: "give this user access to /dev/fuse"},
		{Probe: cufile.Probe{Name: "fusermount3", Detail: "missing"}, Fatal: true},
		{Probe: cufile.Probe{Name: "kernel", OK: true}, Fatal: true, Hint: "unused"},
	}}
	got := strings.Join(fatalHints(r), "; ")
	if want := "give this user access to /dev/fuse; fusermount3: missing"; got != want {
		t.Errorf("fatalHints = %q, want %q", got, want)
	}
}
