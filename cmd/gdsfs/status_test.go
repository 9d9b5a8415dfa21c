package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/gdsfs/gdsfs/cache"
	"github.com/gdsfs/gdsfs/ctl"
	"github.com/gdsfs/gdsfs/status"
	"github.com/gdsfs/gdsfs/tier"
)

// gdsfs status shows the index cache's counters, the foreign ioctls apart
// from refusals and each uid's share of the pool; --watch adds the index
// cache's rates.
func TestPrintStatusIndex(t *testing.T) {
	doc := []byte(`{"daemon_pid":7,"version":"t","engine":"host","sessions":1,"leases":0,
		"pool":{"backend":"host","devices":[{"device":0,"budget_bytes":8388608,"allocated_bytes":4194304,"leased_bytes":4096,
			"slabs":1,"slabs_in_use":1,"leases":1,"uid_share_bytes":4194304,"freed_slabs":2}],
			"uids":[{"uid":10001,"sessions":1,"leased_bytes":4096,"allocated_bytes":4194304,"refused":3,"freed_slabs":2}]},
		"counters":{"reads":1,"read_ranges":1,"read_bytes":4096,"writes":0,"write_bytes":0,"foreign_ioctls":5,"errors":{"EAGAIN":2}},
		"index":{"hits":40,"misses":3,"evictions":1,"parses":3,"parse_errors":1,"budget_bytes":268435456,"used_bytes":8192}}`)
	var out bytes.Buffer
	if err := printStatus(&out, "/mnt", doc, ctl.HelloReply{}, false); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"index:    40 hits, 3 misses, 1 evictions, 3 parses (1 failed), 8.0 KiB cached of 256 MiB",
		"other:    5 ioctls of other types",
		"refused:  EAGAIN=2",
		"pool host: 4.0 KiB leased, 4.0 MiB allocated of 8.0 MiB budget, 1 slabs (1 in use), 1 leases; 4.0 MiB per uid, 2 idle slabs freed for other uids",
		"uid 10001: 1 sessions, 4.0 KiB leased, 4.0 MiB allocated, 3 allocations refused, 2 idle slabs freed for others",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("status lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "ENOTTY=") {
		t.Errorf("foreign ioctls shown as refusals:\n%s", out.String())
	}
	now := time.Now()
	prev := &status.View{At: now, Index: &cache.IndexStats{Hits: 10, Misses: 2}}
	cur := &status.View{At: now.Add(2 * time.Second), Index: &cache.IndexStats{Hits: 30, Misses: 4, Evictions: 2}}
	out.Reset()
	status.PrintRates(&out, prev, cur)
	if want := "index/s:  10 hits/s, 1 misses/s, 1 evictions/s"; !strings.Contains(out.String(), want) {
		t.Errorf("rates lack %q:\n%s", want, out.String())
	}
}

// gdsfs status names each GPU of the pool by its UUID, the name that does
// not depend on CUDA_VISIBLE_DEVICES (the daemon's device 1 may be a
// trainer's cuda:0).
func TestPrintStatusDeviceUUIDs(t *testing.T) {
	doc := []byte(`{"engine":"posix","pool":{"backend":"cuda","devices":[
		{"device":0,"uuid":"GPU-aaaaaaaa-0000-1111-2222-333333333333","budget_bytes":8388608},
		{"device":1,"uuid":"GPU-bbbbbbbb-0000-1111-2222-333333333333","budget_bytes":8388608}]}}`)
	var out bytes.Buffer
	if err := printStatus(&out, "/mnt", doc, ctl.HelloReply{}, false); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"pool device 0 (GPU-aaaaaaaa-0000-1111-2222-333333333333): 0 B leased",
		"pool device 1 (GPU-bbbbbbbb-0000-1111-2222-333333333333): 0 B leased",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("status lacks %q:\n%s", want, out.String())
		}
	}
}

// gdsfs status shows the daemon's descriptors held by open files, the
// budget, and each uid's share with its refusals.
func TestPrintStatusOpenFiles(t *testing.T) {
	doc := []byte(`{"engine":"host","pool":{"backend":"host"},
		"open_files":{"limit":1048576,"reserve":8192,"per_uid":260096,"open":12,"refused":3,
			"uids":[{"uid":0,"open":1,"refused":0},{"uid":10001,"open":11,"refused":3}]}}`)
	var out bytes.Buffer
	if err := printStatus(&out, "/mnt", doc, ctl.HelloReply{}, false); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"open files: 12 daemon descriptors held, 260096 per uid at most (--max-open-per-user), 8192 of the daemon's limit 1048576 kept for itself, 3 opens refused",
		"uid 10001: 11 open files (descriptors) of 260096, 3 opens refused",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("status lacks %q:\n%s", want, out.String())
		}
	}
}

// gdsfs status as a uid other than root prints the tier's figures it is
// given, its own pins', as its own, and no node-wide counters.
func TestPrintTierStatusOwn(t *testing.T) {
	for _, tc := range []struct {
		name, doc     string
		want, notWant []string
	}{
		{"root", `{"memory":"host","budget_bytes":8388608,"uid_share_bytes":4194304,"chunk_bytes":65536,"used_bytes":196608,"cached_bytes":150000,"files":2,"hits":4,"hit_bytes":4096}`,
			[]string{"tier:     146 KiB cached (2 files) in 192 KiB of 8.0 MiB host memory, 4.0 MiB per uid; 4 hits (4.0 KiB)"}, []string{"yours"}},
		{"uid", `{"scope":"uid","memory":"host","budget_bytes":8388608,"uid_share_bytes":4194304,"chunk_bytes":65536,"used_bytes":65536,"cached_bytes":60000,"files":1,
			"device_budget_bytes":1048576,"devices":[{"device":0,"bytes":65536,"files":1}]}`,
			[]string{"tier:     yours: 59 KiB cached (1 file) in 64 KiB of your 4.0 MiB share of the 8.0 MiB host memory (the node's figures are root's)",
				"gpu cache: 1.0 MiB per GPU; yours: device 0: 64 KiB (1 file)\n"}, []string{"hits", "evicted"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var st tier.Stats
			if err := json.Unmarshal([]byte(tc.doc), &st); err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			printTierStatus(&out, &st)
			for _, w := range tc.want {
				if !strings.Contains(out.String(), w) {
					t.Errorf("lacks %q:\n%s", w, out.String())
				}
			}
			for _, w := range tc.notWant {
				if strings.Contains(out.String(), w) {
					t.Errorf("has %q:\n%s", w, out.String())
				}
			}
		})
	}
}
