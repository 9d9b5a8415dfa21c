package daemon

import (
	"context"

	"github.com/dustin/go-humanize"

	"github.com/gdsfs/gdsfs/cufile"
	"github.com/gdsfs/gdsfs/gpubuf"
	"github.com/gdsfs/gdsfs/metrics"
	"github.com/gdsfs/gdsfs/tier"
)

// openTier builds the memory tier (Config.TierBytes): pinned host memory
// when the slabs are CUDA memory (hits are DMA copies), anonymous memory
// with the host backend. Its memory is the daemon's alone, and goes with
// it: a restarted daemon starts with an empty tier.
func (d *Daemon) openTier(context.Context) error {
	if d.cfg.TierBytes == 0 {
		if d.cfg.GPUCacheBytes != 0 {
			return configErrorf("--gpu-cache caches pinned files: give --tier-budget too")
		}
		return nil
	}
	pinning := "none"
	cfg := tier.Config{BudgetBytes: d.cfg.TierBytes, UIDShareBytes: d.tierShare(), ChunkBytes: d.cfg.TierChunkBytes, Log: d.cfg.Log}
	if d.engines.TierPinned() {
		a := tier.FuncAllocator{Kind: "pinned", New: d.engines.TierAlloc, Free: d.engines.TierFree}
		pinning = "cuMemHostAlloc"
		if d.engines.TierSealed() {
			a.Seal = d.engines.TierSeal // registered once filled (cufile/hostreg.go)
			pinning = "cuMemHostRegister once filled"
		}
		cfg.Alloc = a
		if d.cfg.GPUCacheBytes != 0 {
			cfg.DeviceBytes, cfg.DeviceAlloc = d.cfg.GPUCacheBytes, deviceAlloc{d.engines}
		}
	} else if d.cfg.GPUCacheBytes != 0 {
		return configErrorf("--gpu-cache needs GPU slabs; this daemon serves %s memory", d.engines.Backend().Name())
	}
	t, err := tier.New(cfg)
	if err != nil {
		return err
	}
	d.tier = t
	d.push("free memory tier", t.Close)
	st := t.Stats()
	d.cfg.Log.Info().Str("memory", st.Memory).Str("budget", humanize.IBytes(uint64(st.BudgetBytes))).
		Str("uid_share", humanize.IBytes(uint64(st.UIDShareBytes))).Str("gpu_cache", humanize.IBytes(uint64(st.DeviceBudgetBytes))).
		Str("pinning", pinning).Msg("memory tier")
	return nil
}

// deviceAlloc is the device tier's memory: cuMemAlloc through the engines.
type deviceAlloc struct{ e *cufile.Engines }

func (a deviceAlloc) AllocDevice(device int, n int64) (tier.DeviceMemory, error) {
	return a.e.AllocDevice(device, n)
}

// tierShare is the most of the tier one uid may hold: --uid-share's
// fraction of the tier budget, or its size, or gpubuf's default fraction.
func (d *Daemon) tierShare() int64 {
	b := d.cfg.TierBytes
	switch {
	case d.cfg.UIDShareFraction != 0:
		return max(int64(float64(b)*d.cfg.UIDShareFraction), 1)
	case d.cfg.UIDShareBytes != 0:
		return min(d.cfg.UIDShareBytes, b)
	}
	return max(int64(float64(b)*gpubuf.DefaultUIDShare), 1)
}

// Tier is the memory tier, nil without Config.TierBytes.
func (d *Daemon) Tier() *tier.Tier { return d.tier }

// tierMetrics has every scrape read the tier's figures.
func (d *Daemon) tierMetrics(m *metrics.Metrics) {
	if d.tier == nil {
		return
	}
	m.SetTier(d.tier.Stats)
}
