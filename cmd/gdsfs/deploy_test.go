package main

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// gdsfsInvocations finds the gdsfs command lines of the deployment files:
// the DaemonSet's YAML lists ([/usr/local/bin/gdsfs, unmount, ...], and the
// container's command + args) and the systemd unit's Exec lines, with
// GDSFS_OPTS as README.md's example sets it.
func gdsfsInvocations(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	yaml, err := os.ReadFile("../../scripts/k8s/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	list := regexp.MustCompile(`(?m)^\s*(?:-\s*)?(?:exec: \{)?(command|args): \[([^\]]*)\]`)
	sawArgs := false
	for _, m := range list.FindAllStringSubmatch(string(yaml), -1) {
		var words []string
		for _, w := range strings.Split(m[2], ",") {
			words = append(words, strings.TrimSpace(w))
		}
		switch {
		case m[1] == "args":
			sawArgs = true
			out["daemonset.yaml args: "+m[2]] = words
		case len(words) > 1 && strings.HasSuffix(words[0], "/gdsfs"):
			out["daemonset.yaml command: "+m[2]] = words[1:]
		}
	}
	if !sawArgs {
		t.Fatal("scripts/k8s/daemonset.yaml: no container args found")
	}
	unit, err := os.ReadFile("../../scripts/gdsfs.service")
	if err != nil {
		t.Fatal(err)
	}
	env := strings.NewReplacer("$GDSFS_OPTS", "--allow-other --metrics-addr 127.0.0.1:9477", "${GDSFS_MOUNTPOINT}", "/data")
	for _, l := range strings.Split(string(unit), "\n") {
		if !strings.HasPrefix(l, "Exec") {
			continue
		}
		_, cmdline, _ := strings.Cut(l, "=")
		f := strings.Fields(env.Replace(strings.TrimPrefix(cmdline, "-")))
		if len(f) > 1 && strings.HasSuffix(f[0], "/gdsfs") {
			out["gdsfs.service: "+l] = f[1:]
		}
	}
	return out
}

// TestDeployFilesUseRealFlags: every gdsfs command line the systemd unit
// and the Kubernetes DaemonSet run names a subcommand and flags that exist
// and parse.
func TestDeployFilesUseRealFlags(t *testing.T) {
	inv := gdsfsInvocations(t)
	if len(inv) < 5 {
		t.Fatalf("found only %d gdsfs command lines in the deployment files: %v", len(inv), inv)
	}
	for where, args := range inv {
		root := newRootCmd()
		sub, rest, err := root.Find(args)
		if err != nil || sub == root {
			t.Errorf("%s: no gdsfs subcommand in %v (%v)", where, args, err)
			continue
		}
		if err := sub.ParseFlags(rest); err != nil {
			t.Errorf("%s: %v", where, err)
			continue
		}
		if err := cobra.ExactArgs(1)(sub, sub.Flags().Args()); err != nil {
			t.Errorf("%s: %v", where, err)
		}
	}
}
