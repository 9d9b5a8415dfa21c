#!/usr/bin/env bash
# Builds the static binaries scripts/gpu-test.sh runs on the GPU machine (which
# has no Go): gdsfs and the GPU test binaries, CGO_ENABLED=0, into build/gpu/.
# Carry build/gpu to the GPU machine (device tool: carry ["build/gpu"]).
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/gpu
mkdir -p "$out"
export CGO_ENABLED=0 GOOS=linux GOARCH=amd64
go build -trimpath -o "$out/gdsfs" ./cmd/gdsfs
go test -c -trimpath -o "$out/cufile.test" ./cufile
go test -c -trimpath -o "$out/gpubuf.test" ./gpubuf
go test -c -trimpath -o "$out/fs.test" ./fs # BenchmarkLookup (GPU-RUN.txt)
ls -l "$out"
