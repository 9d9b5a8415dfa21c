# gdsfs build and test entry points. `make test` is what CI runs (see README.md).
GO        ?= go
BIN       := bin/gdsfs
PYTHON    ?= /usr/bin/python3
FUZZTIME  ?= 10s
export GDSFS_BIN := $(abspath $(BIN))

.PHONY: all build test unit integration pytest fuzz lint demo bench gpu-build install clean

all: build

# CGO_ENABLED=0: one self-contained binary that dlopens libcuda/libcufile when present.
build:
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN) ./cmd/gdsfs

test: build lint unit integration pytest fuzz

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

# Unit tests with the race detector; integration/ mounts real filesystems and runs separately.
unit:
	CGO_ENABLED=1 $(GO) test -race -count=1 $$($(GO) list ./... | grep -v /integration)

integration: build
	$(GO) test -count=1 -timeout 30m ./integration/...

pytest: build
	@if [ -d python/tests ]; then $(PYTHON) -m pytest -q python/tests; fi

fuzz:
	./scripts/fuzz.sh $(FUZZTIME)

demo: build
	./scripts/demo.sh

bench: build
	$(BIN) bench

# Static binaries for the GPU machine (scripts/gpu-test.sh runs them there; nothing builds there).
gpu-build: build
	./scripts/gpu-build.sh

# The binary and the systemd unit (configure /etc/default/gdsfs; see docs/operations.md).
install: build
	install -D -m 0755 $(BIN) $(DESTDIR)/usr/local/bin/gdsfs
	install -D -m 0644 scripts/gdsfs.service $(DESTDIR)/usr/local/lib/systemd/system/gdsfs.service

clean:
	rm -rf bin build
