# gdsfs build and test entry points. `make test` is what CI runs (see README.md).
# A Go new enough for go.mod: the first on PATH, else the one install-deps.sh
# fetched (scripts/find-go.sh says why when there is none). Its directory goes
# first on PATH so that scripts run by make use the same Go.
GO        ?= $(shell ./scripts/find-go.sh || echo go)
ifneq ($(findstring /,$(GO)),)
export PATH := $(dir $(GO)):$(PATH)
endif
BIN       := bin/gdsfs
PYTHON    ?= /usr/bin/python3
FUZZTIME  ?= 10s
# staticcheck runs from the Go module proxy at this version (no install step).
STATICCHECK ?= v0.8.2
export GDSFS_BIN := $(abspath $(BIN))

.PHONY: all build test unit integration pytest pycheck fuzz lint demo bench bench-dataset gpu-build install install-check wheel clean

all: build

# CGO_ENABLED=0: one self-contained binary that dlopens libcuda/libcufile when present.
build:
	CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN) ./cmd/gdsfs

test: build lint pycheck unit integration pytest bench-dataset fuzz install-check

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@if git grep -n -E '^(<<<<<<< |>>>>>>> )' -- ':!*.bin'; then echo "merge conflict markers left in the files above"; exit 1; fi
	$(GO) vet ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK) ./...

# Unit tests with the race detector; integration/ mounts real filesystems and runs separately.
unit:
	CGO_ENABLED=1 $(GO) test -race -count=1 $$($(GO) list ./... | grep -v /integration)

integration: build
	$(GO) test -count=1 -timeout 30m ./integration/...

pytest: build
	@if [ -d python/tests ]; then $(PYTHON) -m pytest -q python/tests; fi

# The Python package ships py.typed: it type-checks (mypy, settings in
# python/pyproject.toml) and lints (flake8, settings in python/setup.cfg).
pycheck:
	$(PYTHON) -m mypy --config-file python/pyproject.toml python/gdsfs
	$(PYTHON) -m flake8 --config python/setup.cfg python/gdsfs python/tests

fuzz:
	./scripts/fuzz.sh $(FUZZTIME)

demo: build
	./scripts/demo.sh

# Platform wheels (dist/gdsfs-*-py3-none-linux_{x86_64,aarch64}.whl) with the
# static binary and the Python package; `gdsfs` is their console script.
wheel:
	./scripts/build-wheel.sh

# The README's install routes, checked as a new user takes them (install-deps
# with Go hidden from PATH; the wheel in a fresh venv running the demo).
install-check:
	./scripts/check-install.sh

bench: build
	$(BIN) bench

# The per-sample path of GDSShardDataset on the host engine (issue 15): samples/s per sample size
# vs a plain tarfile loader, and the daemon's per-range cost; printed for review, never asserted.
# A few seconds; scripts/bench-dataset.py --profile --compare DIR for the full picture.
bench-dataset: build
	$(PYTHON) scripts/bench-dataset.py --quick
	$(GO) test -run '^$$' -bench ServerReadSmallSamples -benchtime 200x ./ctlserver

# Static binaries for the GPU machine (scripts/gpu-test.sh runs them there; nothing builds there).
gpu-build: build
	./scripts/gpu-build.sh

# The binary and the systemd unit (configure /etc/default/gdsfs; see docs/operations.md).
install: build
	install -D -m 0755 $(BIN) $(DESTDIR)/usr/local/bin/gdsfs
	install -D -m 0644 scripts/gdsfs.service $(DESTDIR)/usr/local/lib/systemd/system/gdsfs.service

clean:
	rm -rf bin build dist
