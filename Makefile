# tokenbroker — see README.md. Everything needed is built from Go modules.
SHELL := /bin/bash
GO ?= go
BIN := $(CURDIR)/bin
export TOKENBROKER_BIN_DIR := $(BIN)
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION)
# Requests per measurement and concurrency levels for `make bench`.
BENCH_N ?= 1000
BENCH_C ?= 1,8,32
# Time per fuzz target for `make fuzz`.
FUZZTIME ?= 30s

.PHONY: all build kube localcluster dev test check unit integration bench fuzz clean help

all: build

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

build: ## build bin/tokenbroker
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/tokenbroker ./cmd/tokenbroker

kube: ## build kube-apiserver, kube-controller-manager and kubectl from the pinned k8s.io/kubernetes (minutes the first time, then cached)
	cd test && $(GO) run ./cmd/kubebins

localcluster: ## build bin/localcluster, the harness as a command
	cd test && $(GO) build -o $(BIN)/localcluster ./cmd/localcluster

dev: build kube localcluster ## start a local cluster, a dev PKI and a broker with a demo policy (Ctrl-C stops everything)
	$(BIN)/localcluster --kubeconfig-out $(CURDIR)/.dev/admin.kubeconfig -- $(BIN)/tokenbroker dev --dir $(CURDIR)/.dev --kubeconfig $(CURDIR)/.dev/admin.kubeconfig

test: check unit integration ## the whole suite: static checks, unit tests, tests against a real kube-apiserver, e2e

check: ## gofmt and go vet on both modules
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '^vendor/')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	cd test && $(GO) vet ./...

unit: ## unit tests with the race detector, and each fuzz target briefly
	$(GO) test -race -short -count=1 ./...
	$(MAKE) fuzz FUZZTIME=3s

integration: build kube localcluster ## integration and e2e tests against a real kube-apiserver
	cd test && $(GO) test -count=1 -timeout 20m ./...

bench: build kube ## measure the broker against direct API server calls; prints a table, writes bench/results.json
	$(GO) test -run '^$$' -bench . -benchmem ./...
	cd test && $(GO) run ./cmd/bench -n $(BENCH_N) -c $(BENCH_C) -out $(CURDIR)/bench/results.json

fuzz: ## run every fuzz target for FUZZTIME (default 30s) each
	@set -e; for pkg in $$($(GO) list ./...); do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg | grep '^Fuzz'); do \
	    echo "fuzz $$pkg $$f ($(FUZZTIME))"; \
	    $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$pkg; \
	  done; \
	done

clean: ## remove build outputs and the dev directory
	rm -rf $(BIN) .dev
