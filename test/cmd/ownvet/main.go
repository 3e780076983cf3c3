// Command ownvet is go vet without the facts of third-party packages: run
// as `go vet -vettool=bin/ownvet`, it is the Go toolchain's own vet for
// every package named and for the standard library and this repository's
// packages beneath them, and answers "no facts" at once for every other
// dependency.
//
// go vet analyses each package's dependencies too, for the facts its
// checks share across packages (which functions are printf wrappers, which
// return a context's cancel). That is a parse and a type check from source
// of every package below the one vetted: Argo CD's, Flux's and Kueue's
// trees under the consumer checkers, client-go and etcd under the test
// module, minutes of CPU from an empty build cache for nothing this
// repository wrote. What it gives up is those facts of third-party code: a
// printf wrapper of a dependency (klog.Infof, say) is not checked as one;
// the standard library's (fmt, log, testing) and this repository's are.
//
// The toolchain's vet is $TOKENBROKER_GO_VET, or vet in `go env GOTOOLDIR`.
// Its -V=full line gains a word, so that go vet's cache never mistakes an
// empty answer for the real vet's facts.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
)

// own is the prefix of this repository's import paths.
const own = "github.com/tokenbroker/tokenbroker"

func main() {
	vet, err := toolchainVet()
	if err != nil {
		fail(err)
	}
	args := os.Args[1:]
	for _, a := range args {
		if a == "-V=full" {
			out, err := exec.Command(vet, "-V=full").Output()
			if err != nil {
				fail(fmt.Errorf("%s -V=full: %w", vet, err))
			}
			fmt.Println(strings.TrimSpace(string(out)) + " ownvet-no-third-party-facts")
			return
		}
	}
	if len(args) > 0 && strings.HasSuffix(args[len(args)-1], ".cfg") {
		skip, err := thirdPartyFactsOnly(args[len(args)-1])
		if err != nil {
			fail(err)
		}
		if skip != "" {
			// An empty facts file: "no facts", which go vet caches.
			if err := os.WriteFile(skip, nil, 0o644); err != nil {
				fail(err)
			}
			return
		}
	}
	err = syscall.Exec(vet, append([]string{vet}, args...), os.Environ())
	fail(fmt.Errorf("exec %s: %w", vet, err))
}

// fail ends ownvet as go vet ends on a tool's failure.
func fail(err error) {
	fmt.Fprintln(os.Stderr, "ownvet:", err)
	os.Exit(2)
}

// thirdPartyFactsOnly reads go vet's config for one package and returns
// where its facts go if it is a third-party dependency, asked for its
// facts only; "" for everything the real vet must see.
func thirdPartyFactsOnly(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	var cfg struct {
		ImportPath string
		VetxOnly   bool
		VetxOutput string
	}
	if err := json.Unmarshal(data, &cfg); err != nil {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	if !cfg.VetxOnly || cfg.VetxOutput == "" || standard(cfg.ImportPath) ||
		cfg.ImportPath == own || strings.HasPrefix(cfg.ImportPath, own+"/") {
		return "", nil
	}
	return cfg.VetxOutput, nil
}

// standard reports whether an import path is the standard library's: its
// first element has no dot (fmt, net/http, vendor/golang.org/x/net/…).
func standard(importPath string) bool {
	first, _, _ := strings.Cut(importPath, "/")
	return !strings.Contains(first, ".")
}

func toolchainVet() (string, error) {
	if v := os.Getenv("TOKENBROKER_GO_VET"); v != "" {
		return v, nil
	}
	out, err := exec.Command("go", "env", "GOTOOLDIR").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOTOOLDIR: %w", err)
	}
	return strings.TrimSpace(string(out)) + "/vet", nil
}
