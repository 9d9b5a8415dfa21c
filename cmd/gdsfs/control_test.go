package main

import (
	"bytes"
	"errors"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"
)

// --meta-cache is the index cache's size flag; --index-cache still works,
// hidden and deprecated; both at once is a usage error.
func TestMetaCacheFlag(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		value    string
		flag     string
		usageErr bool
	}{
		{nil, "256MiB", "meta-cache", false},
		{[]string{"--meta-cache", "1GiB"}, "1GiB", "meta-cache", false},
		{[]string{"--index-cache", "64MiB"}, "64MiB", "index-cache", false},
		{[]string{"--index-cache", "64MiB", "--meta-cache", "1GiB"}, "", "", true},
	} {
		var cf *controlFlags
		var flag string
		var ferr error
		cmd := &cobra.Command{Use: "mount", RunE: func(cmd *cobra.Command, _ []string) error {
			flag, ferr = metaCacheFlag(cmd)
			return nil
		}}
		cf = addControlFlags(cmd)
		var stderr bytes.Buffer
		cmd.SetErr(&stderr)
		cmd.SetArgs(tc.args)
		if err := cmd.Execute(); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		var ue usageError
		switch {
		case tc.usageErr:
			if !errors.As(ferr, &ue) {
				t.Errorf("%v: %v, want a usage error", tc.args, ferr)
			}
		case ferr != nil || flag != tc.flag || cf.indexCache != tc.value:
			t.Errorf("%v: flag %q value %q err %v; want %q %q", tc.args, flag, cf.indexCache, ferr, tc.flag, tc.value)
		}
	}
	cmd := &cobra.Command{Use: "mount"}
	addControlFlags(cmd)
	usage := cmd.UsageString()
	if !strings.Contains(usage, "--meta-cache") || strings.Contains(usage, "--index-cache") {
		t.Errorf("mount usage should show --meta-cache and hide --index-cache:\n%s", usage)
	}
}

// --residency says who may learn a file's page-cache residency from the
// engine named; anything but owners or readers is a usage error.
func TestResidencyFlag(t *testing.T) {
	for _, tc := range []struct {
		args     []string
		readers  bool
		usageErr bool
	}{
		{nil, false, false},
		{[]string{"--residency", "owners"}, false, false},
		{[]string{"--residency", "readers"}, true, false},
		{[]string{"--residency", "everyone"}, false, true},
	} {
		var cfgErr error
		var readers bool
		cmd := &cobra.Command{Use: "mount"}
		cf := addControlFlags(cmd)
		cmd.RunE = func(cmd *cobra.Command, _ []string) error {
			cfg, err := cf.config(cmd, &mountConfig{mountpoint: "/m"}, zerolog.Nop())
			cfgErr, readers = err, cfg.ResidencyToReaders
			return nil
		}
		cmd.SetArgs(tc.args)
		if err := cmd.Execute(); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		var ue usageError
		switch {
		case tc.usageErr:
			if !errors.As(cfgErr, &ue) || !strings.Contains(cfgErr.Error(), "--residency") {
				t.Errorf("%v: %v, want a usage error naming --residency", tc.args, cfgErr)
			}
		case cfgErr != nil || readers != tc.readers:
			t.Errorf("%v: readers %v err %v; want %v", tc.args, readers, cfgErr, tc.readers)
		}
	}
}
