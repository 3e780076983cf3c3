# tokenbroker — see README.md. Everything needed is built from Go modules.
SHELL := /bin/bash
GO ?= go
BIN := $(CURDIR)/bin
export TOKENBROKER_BIN_DIR := $(BIN)
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION)
# The image: REPOSITORY:RELEASE is what `make image` tags and what the chart
# (appVersion) and the kustomize bases (images: newTag) deploy by default; the
# release is the chart's appVersion, and a test checks that they agree.
IMAGE_REPOSITORY ?= ghcr.io/tokenbroker/tokenbroker
RELEASE := $(shell sed -n 's/^appVersion: *//p' deploy/helm/tokenbroker/Chart.yaml)
IMAGE_PLATFORMS ?= linux/amd64,linux/arm64
IMAGE_DIR := $(CURDIR)/dist/image
HOST_ARCH := $(shell $(GO) env GOARCH)
# The SBOM generator, built from the Go module proxy like helm.
CYCLONEDX_GOMOD_VERSION := v1.10.0
# Requests per measurement and concurrency levels for `make bench`.
BENCH_N ?= 1000
BENCH_C ?= 1,8,32
# Requests per as-shipped Vault row of `make bench`: client-go's default
# limiter holds Vault's Kubernetes secrets engine to about 5 requests/s.
VAULT_SHIPPED_N ?= 50
# Live-lease levels for `make bench-scale` (the empty cluster is measured first).
SCALE_LEASES ?= 1000,10000,50000
# Issuances timed at each level of `make bench-scale`.
SCALE_N ?= 500
# The broker's --gc-interval in `make bench-scale`: each level's measurements
# run between two GC passes, so it must exceed them.
SCALE_GC_INTERVAL ?= 30s
# Targets of the one agent `make bench-agent` measures, and the broker
# processes that serve them.
AGENT_TARGETS ?= 100
AGENT_BROKERS ?= 4
# The Kubernetes release the harness builds and runs: one of test/kube/<version>
# (test/testcluster.DefaultKubeVersion when unset). `make test-compat` runs the
# integration tier on the oldest supported release, COMPAT_KUBE_VERSION.
KUBE_VERSION ?=
ifneq ($(KUBE_VERSION),)
export KUBE_VERSION
endif
COMPAT_KUBE_VERSION ?= v1.35.4
# What `make test-compat` runs besides test/integration: the e2e tests of the
# agent, client certificates (CSR signing, RBAC revocation), tenant selectors
# and their admission policy, per-peer limits, revocation and the audit join.
COMPAT_E2E := TestBrokerEndToEnd|TestAgentKeepsKubeconfigsFreshAcrossTwoClusters|TestClientCertificateKubeconfigs|TestTenantGrants|TestTenantLabelAdmissionPolicy|TestPerPeerLimitsAgainstARealAPIServer|TestAWatchOpenedBeforeARevocationOutlivesItUntilTheAPIServerEndsIt|TestAuditJoin
# The node's binaries (make kube-node) and the tests that need a node
# (make test-node, files tagged "node").
NODE_BINARIES := kubelet kube-scheduler
NODE_TESTS := ^TestNode
# Time per fuzz target for `make fuzz` (.ci/run fuzzes each for 2s).
FUZZTIME ?= 30s
# go vet as make check runs it: the toolchain's vet through bin/ownvet,
# which skips the facts of third-party dependencies (test/cmd/ownvet). The
# tests run with -vet=off: make check has vetted them, with every analyzer
# (go test's own vet runs a subset, and recomputes every dependency's
# facts for its flags and again for -race).
VET = TOKENBROKER_GO_VET=$$($(GO) env GOTOOLDIR)/vet $(GO) vet -vettool=$(BIN)/ownvet
# The e2e package is the suite's longest (about 15 minutes of tests): it
# runs as two processes beside the rest of the test module, the tests of
# E2E_SLOW in one (the longest, about half of the package's time) and
# every other in the second (a new test lands there), so that both cores
# are busy while tests wait on their API servers (docs/testing.md).
E2E_SLOW := TestMemoryStaysUnderTheShippedLimit|TestTenThousandIssuances|TestClientCertificateKubeconfigs|TestClientGoPicksUpATokenFileTheAgentRotates|TestPerPeerLimitsAgainstARealAPIServer|TestLeasesCommandShowsWhoHoldsACredentialAndRevokesIt
# promtool, built from the Go module proxy at the Prometheus version that
# test/promqlcheck pins (one Prometheus for the PromQL parser and the rule tests),
# without the service discoveries (remove_all_sd: check rules and test rules
# discover nothing, and the cloud SDKs are minutes of a cold build).
PROMTOOL_VERSION = $(shell cd test/promqlcheck && $(GO) list -m -f '{{.Version}}' github.com/prometheus/prometheus)
# helm for the chart in deploy/helm, built from the Go module proxy.
HELM_VERSION := v3.19.5
CHARTS := deploy/helm/tokenbroker deploy/helm/tokenbroker-agent
# The consumer checkers of `make conformance`, each a nested module pinned to
# one consumer's release (test/conformance/consumers, docs/testing.md).
CONSUMERS := admiralty argocd flux kargo clusterprofile multikueue

.PHONY: all build kube kube-node node-image test-node test-node-run devnode kube-compat test-compat compat-integration compat-e2e image-run-test image-digest-test helm promtool alerts-test localcluster dev test check chart-lint unit integration integration-rest e2e-slow e2e-rest conformance conformance-bins bench bench-agent bench-scale fuzz image image-ref image-test clean help

all: build

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

build: ## build bin/tokenbroker
	$(GO) build -buildvcs=auto -ldflags '$(LDFLAGS)' -o $(BIN)/tokenbroker ./cmd/tokenbroker

kube: ## build kube-apiserver, kube-controller-manager and kubectl of KUBE_VERSION (default the newest supported) into bin/kube/<version> (minutes the first time, then cached)
	cd test && $(GO) run ./cmd/kubebins

helm: ## build bin/helm (the pinned HELM_VERSION) from the Go module proxy unless it is there
	@if ! $(GO) version -m $(BIN)/helm 2>/dev/null | grep -Eq '^\s+mod\s+helm\.sh/helm/v3\s+$(HELM_VERSION)\s'; then \
	  echo "building helm $(HELM_VERSION)"; \
	  GOBIN=$(BIN) $(GO) install -ldflags '-X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION)' helm.sh/helm/v3/cmd/helm@$(HELM_VERSION); \
	fi

promtool: ## build bin/promtool (the Prometheus version test/promqlcheck pins) from the Go module proxy unless it is there
	@v=$(PROMTOOL_VERSION); if ! $(GO) version -m $(BIN)/promtool 2>/dev/null | grep -Eq "^\s+mod\s+github.com/prometheus/prometheus\s+$$v\s"; then \
	  echo "building promtool $$v"; \
	  GOBIN=$(BIN) $(GO) install -tags remove_all_sd github.com/prometheus/prometheus/cmd/promtool@$$v; \
	fi

alerts-test: promtool ## promtool test rules: every alert the charts ship (test/alerts/*.test.yaml), and promtool check rules
	@set -e; d=$$(mktemp -d); trap 'rm -rf "$$d"' EXIT; \
	for c in $(CHARTS); do \
	  { echo "groups:"; cat $$c/files/alerts.yaml; } > "$$d/$$(basename $$c).rules.yaml"; \
	  $(BIN)/promtool check rules "$$d/$$(basename $$c).rules.yaml"; \
	done; \
	cp test/alerts/*.test.yaml "$$d/"; \
	$(BIN)/promtool test rules "$$d"/*.test.yaml

localcluster: ## build bin/localcluster, the harness as a command
	cd test && $(GO) build -o $(BIN)/localcluster ./cmd/localcluster

ifeq ($(NODE),)
dev: build kube localcluster ## start a local cluster, a dev PKI and a broker with a demo policy (Ctrl-C stops everything); NODE=1: the broker as a Pod from its chart on a node (root), and a Pod to exec into
	$(BIN)/localcluster --controller-manager --kubeconfig-out $(CURDIR)/.dev/admin.kubeconfig -- $(BIN)/tokenbroker dev --dir $(CURDIR)/.dev --kubeconfig $(CURDIR)/.dev/admin.kubeconfig
else
dev: kube localcluster kube-node node-image helm devnode
	@test -f $(IMAGE_DIR)/tokenbroker-$(RELEASE)-linux-$(HOST_ARCH).tar || { echo "no image in $(IMAGE_DIR): run make image first (IMAGE_PLATFORMS=linux/$(HOST_ARCH) is enough)"; exit 1; }
	$(BIN)/localcluster --controller-manager --node --import-image $(IMAGE_DIR)/tokenbroker-$(RELEASE)-linux-$(HOST_ARCH).tar \
	  --kubeconfig-out $(CURDIR)/.dev/admin.kubeconfig -- $(BIN)/devnode --dir $(CURDIR)/.dev --image $(IMAGE_REPOSITORY):$(RELEASE) --helm $(BIN)/helm
endif

devnode: ## build bin/devnode, the demo of make dev NODE=1
	cd test && $(GO) build -o $(BIN)/devnode ./cmd/devnode

test: check chart-lint alerts-test unit integration ## the whole suite: static checks, unit tests, tests against a real kube-apiserver, e2e

check: ## gofmt, and go vet (through bin/ownvet: without third-party packages' facts) on every module, test files included
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '^vendor/')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	cd test && $(GO) build -o $(BIN)/ownvet ./cmd/ownvet
	$(VET) ./...
	@# The consumers' shared check package is vetted where the test module
	@# compiles it anyway (its own go.mod would compile a seventh client-go).
	cd test && $(VET) ./... github.com/tokenbroker/tokenbroker/test/conformance/consumers/check/... && $(VET) -tags node ./testcluster/ ./e2e/
	cd test/promqlcheck && $(VET) ./...
	cd test/image && $(VET) ./...
	@set -e; for m in $(CONSUMERS); do (cd test/conformance/consumers/$$m && $(VET) ./...); done

chart-lint: helm alerts-test ## helm lint --strict of the broker's and the agent's chart, with their defaults and each ci/ values file; the charts' alerts evaluated
	@set -e; for c in $(CHARTS); do \
	  $(BIN)/helm lint --strict $$c; \
	  for f in $$c/ci/*-values.yaml; do $(BIN)/helm lint --strict $$c -f $$f; done; \
	done

unit: ## unit tests with the race detector; every fuzz target's seed corpus and saved inputs run as test cases (make fuzz fuzzes)
	$(GO) test -race -short -count=1 -vet=off ./...
	cd test/image && $(GO) test -short -count=1 -vet=off ./...

integration: build kube helm localcluster conformance-bins ## integration and e2e tests against a real kube-apiserver (conformance included): the test module, its e2e package in two processes beside the rest
	@# The e2e test binary compiled once, not by both of its processes at once.
	cd test && $(GO) test -c -vet=off -o /dev/null ./e2e/
	$(MAKE) --no-print-directory -j3 -Otarget integration-rest e2e-slow e2e-rest

integration-rest: ## (part of integration) every package of the test module but e2e
	cd test && $(GO) test -count=1 -vet=off -timeout 20m $$($(GO) list ./... | grep -v '/test/e2e$$')

e2e-slow: ## (part of integration) the e2e tests of E2E_SLOW
	cd test && $(GO) test -count=1 -vet=off -timeout 20m -run '^($(E2E_SLOW))$$' ./e2e/

e2e-rest: ## (part of integration) every other e2e test
	cd test && $(GO) test -count=1 -vet=off -timeout 20m -skip '^($(E2E_SLOW))$$' ./e2e/

kube-node: ## build the node's kubelet and kube-scheduler of KUBE_VERSION into bin/kube/<version> (cached)
	cd test && $(GO) run ./cmd/kubebins $(NODE_BINARIES)

node-image: ## build bin/node-image.tar, the image of the harness's node (its pod sandbox and stream-test container), with test/image
	cd test/image && $(GO) run . -node-image $(BIN)/node-image.tar

test-node: build kube kube-node node-image helm ## the tests that need a node (kubelet, containerd, runc: root and Debian packages; make image first): Pods, streams, workload identity from a Pod, the charts, make dev NODE=1
	$(MAKE) test-node-run

test-node-run: ## (part of test-node) its tests alone, with everything they need built (.ci/run runs it beside make test-compat)
	@test -f $(IMAGE_DIR)/digest || { echo "no image in $(IMAGE_DIR): run make image first"; exit 1; }
	cd test && TOKENBROKER_IMAGE_DIR=$(IMAGE_DIR) $(GO) test -tags node -count=1 -vet=off -timeout 20m -run '$(NODE_TESTS)' ./testcluster/ ./e2e/

kube-compat: ## build the kube binaries of COMPAT_KUBE_VERSION, the oldest supported release, into bin/kube/<version> (cached)
	cd test && KUBE_VERSION=$(COMPAT_KUBE_VERSION) $(GO) run ./cmd/kubebins

test-compat: build helm localcluster kube-compat ## the integration tier on the oldest supported Kubernetes (COMPAT_KUBE_VERSION, built into bin/kube/<version>): compat-integration and compat-e2e side by side
	$(MAKE) -j2 -Otarget compat-integration compat-e2e

compat-integration: ## (part of test-compat) test/integration against COMPAT_KUBE_VERSION
	cd test && KUBE_VERSION=$(COMPAT_KUBE_VERSION) $(GO) test -count=1 -vet=off -timeout 20m ./integration/...

compat-e2e: ## (part of test-compat) the e2e tests of COMPAT_E2E against COMPAT_KUBE_VERSION
	cd test && KUBE_VERSION=$(COMPAT_KUBE_VERSION) $(GO) test -count=1 -vet=off -timeout 20m -run '^($(COMPAT_E2E))$$' ./e2e/

conformance-bins: ## build the consumer checkers (Argo CD, Flux, cluster-inventory-api, Kueue's controllers, and the Admiralty and Kargo mirrors) into bin/
	@set -e; for m in $(CONSUMERS); do \
	  echo "building bin/conformance-$$m"; \
	  (cd test/conformance/consumers/$$m && $(GO) build -ldflags '-s -w' -o $(BIN)/conformance-$$m .); \
	done

conformance: build kube conformance-bins ## load the agent's Secrets with each consumer's own code against real API servers; MultiKueue end to end with Kueue's controllers
	cd test && $(GO) test -count=1 -vet=off -timeout 15m -run 'TestConsumersLoadTheAgentsSecretsWithTheirOwnCode|TestConsumersReachTheTargetThroughTheLeaseGateway|TestClusterProfileAccessProviderWithClusterInventoryAPI|TestEveryAgentConfigInTheDocsIsAcceptedByTheLoader|TestMultiKueueDispatches' -v ./e2e/

bench: build kube ## measure the broker against direct API server calls and Vault's Kubernetes secrets engine, then the agent (bench-agent); prints tables, writes bench/results.json
	$(GO) test -vet=off -run '^$$' -bench . -benchmem ./...
	cd test && $(GO) run ./cmd/bench -n $(BENCH_N) -c $(BENCH_C) -vault-shipped-n $(VAULT_SHIPPED_N) -out $(CURDIR)/bench/results.json
	$(MAKE) bench-agent

bench-agent: build kube ## one agent with AGENT_TARGETS targets: RSS, time to every Secret, API server and broker calls per refresh cycle; writes "agent" in bench/results.json
	cd test && $(GO) run ./cmd/bench -agent-targets $(AGENT_TARGETS) -agent-brokers $(AGENT_BROKERS) -out $(CURDIR)/bench/results.json

bench-scale: build kube ## fill a harness with SCALE_LEASES live leases; issuance, broker memory, GC pass, GET /v1/leases and `tokenbroker leases` at each level; sets "scale" in bench/results.json
	cd test && $(GO) run ./cmd/bench -scale $(SCALE_LEASES) -n $(SCALE_N) -gc-interval $(SCALE_GC_INTERVAL) -out $(CURDIR)/bench/results.json

fuzz: ## run every fuzz target of the root module for FUZZTIME (default 30s) each
	@set -e; for f in $$(find . -path ./test -prune -o -name '*_test.go' -print | xargs grep -l '^func Fuzz' | sort); do \
	  for t in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$f); do \
	    echo "fuzz $$(dirname $$f) $$t ($(FUZZTIME))"; \
	    if ! out=$$($(GO) test -vet=off -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$(dirname $$f) 2>&1); then \
	      echo "$$out"; \
	      echo "$$out" | grep -q 'context deadline exceeded' && ! echo "$$out" | grep -q 'Failing input written' || exit 1; \
	      echo "  $$t: the fuzzing engine missed its own deadline (no failing input): once more"; \
	      $(GO) test -vet=off -run '^$$' -fuzz "^$$t$$" -fuzztime $(FUZZTIME) $$(dirname $$f); \
	    else echo "$$out"; fi; \
	  done; \
	done

image: ## build the container image (linux/amd64, linux/arm64) without a container engine into dist/image, with an SBOM
	cd test/image && $(GO) run . -module-dir $(CURDIR) -out $(IMAGE_DIR) -repository $(IMAGE_REPOSITORY) -version $(RELEASE) -platforms $(IMAGE_PLATFORMS)
	@# The OCI layout as one file (every platform): podman load, ctr import, docker load (25+).
	tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=ustar --mode='a+rX,u+w,go-w' \
	  -C $(IMAGE_DIR)/oci -cf $(IMAGE_DIR)/tokenbroker-$(RELEASE).oci.tar .
	@if ! $(GO) version -m $(BIN)/cyclonedx-gomod 2>/dev/null | grep -Eq '^\s+mod\s+github.com/CycloneDX/cyclonedx-gomod\s+$(CYCLONEDX_GOMOD_VERSION)\s'; then \
	  echo "building cyclonedx-gomod $(CYCLONEDX_GOMOD_VERSION)"; \
	  GOBIN=$(BIN) $(GO) install github.com/CycloneDX/cyclonedx-gomod/cmd/cyclonedx-gomod@$(CYCLONEDX_GOMOD_VERSION); \
	fi
	@set -e; for p in $$(echo $(IMAGE_PLATFORMS) | tr ',' ' '); do \
	  os=$${p%%/*}; arch=$${p#*/}; \
	  $(BIN)/cyclonedx-gomod bin -json -noserial -notimestamp -version $(RELEASE) \
	    -output $(IMAGE_DIR)/tokenbroker-$(RELEASE)-$$os-$$arch.sbom.cdx.json $(IMAGE_DIR)/$$os-$$arch/tokenbroker; \
	  echo "SBOM $(IMAGE_DIR)/tokenbroker-$(RELEASE)-$$os-$$arch.sbom.cdx.json"; \
	done

image-ref: ## print the image reference that make image tags
	@echo $(IMAGE_REPOSITORY):$(RELEASE)

image-test: image-run-test image-digest-test ## run the image as the charts deploy it (podman, runc) against a real kube-apiserver, and check that a second build gives the same digest

image-run-test: build kube helm ## (part of image-test) the image run as the charts deploy it, and its layout loaded by podman and crane
	@test -f $(IMAGE_DIR)/digest || { echo "no image in $(IMAGE_DIR): run make image first"; exit 1; }
	cd test && TOKENBROKER_IMAGE_DIR=$(IMAGE_DIR) TOKENBROKER_IMAGE_REF=$(IMAGE_REPOSITORY):$(RELEASE) $(GO) test -count=1 -vet=off -timeout 15m -run '^TestImage' -v ./e2e/
	cd test/image && TOKENBROKER_IMAGE_DIR=$(IMAGE_DIR) TOKENBROKER_IMAGE_VERSION=$(RELEASE) $(GO) test -count=1 -vet=off -timeout 20m -skip '^TestTwoBuildsOfTheCommitGiveTheSameDigest$$' -v .

image-digest-test: ## (part of image-test) build the image again, linux/amd64 from an empty build cache, and compare the digests with make image's
	@test -f $(IMAGE_DIR)/digest || { echo "no image in $(IMAGE_DIR): run make image first"; exit 1; }
	cd test/image && TOKENBROKER_IMAGE_DIR=$(IMAGE_DIR) TOKENBROKER_IMAGE_VERSION=$(RELEASE) $(GO) test -count=1 -vet=off -timeout 20m -run '^TestTwoBuildsOfTheCommitGiveTheSameDigest$$' -v .

clean: ## remove build outputs, the image and the dev directory
	rm -rf $(BIN) dist .dev
