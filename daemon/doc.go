// Package daemon is gdsfs's composition root: Start builds one daemon from
// a plain Config, in this order, each part on the ones before it:
//
//  1. the metrics listener (Config.MetricsAddr), bound first so that a bad
//     or busy address fails before anything is probed;
//  2. the transfer engines (cufile.Open: probes the GPU and GDS stack once
//     and picks the slab memory backend);
//  3. the buffer pool (gpubuf) on that backend, its budget per device
//     from the Config or the free memory;
//  4. the shard-index cache (cache.Indexes);
//  5. the slab socket (handoffserver) and the control server (ctlserver.Server) over
//     the pool, the engines' chooser (Engines.Choose, wrapped by
//     Config.WrapEngines and the metrics) and the indexes;
//  6. the metrics server, reading the pool, index and passthrough figures
//     at scrape time;
//  7. the FUSE mount (fs.Mount), its control path and operations recorded
//     by metrics/instrument when metrics are on.
//
// Close undoes exactly what Start built, in reverse (unmount first, the
// engines after the pool that uses their memory), and so does a Start that
// fails part way. Nothing here reads flags or the environment: cmd/gdsfs
// parses `gdsfs mount`'s flags into a Config and maps a *ConfigError to its
// usage exit code; tests start daemons the same way.
package daemon
