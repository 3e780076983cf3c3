// Command kubebins builds the kube binaries the test harness runs
// (kube-apiserver, kube-controller-manager, kubectl) from the
// k8s.io/kubernetes release $KUBE_VERSION names (default
// testcluster.DefaultKubeVersion; one module per release in test/kube),
// stamped with that version, into bin/kube/<version> at the repository root
// (or under $TOKENBROKER_BIN_DIR, or --bin-dir). Binaries already built from
// the same go.mod, go.sum and Go
// toolchain are left alone, so running it before every test run is cheap.
//
//	cd test && go run ./cmd/kubebins                 # all of them
//	cd test && go run ./cmd/kubebins kube-apiserver  # just one
//	cd test && KUBE_VERSION=v1.35.4 go run ./cmd/kubebins
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

func main() {
	fs := flag.NewFlagSet("kubebins", flag.ContinueOnError)
	binDir := fs.String("bin-dir", "", "output directory (default $"+testcluster.BinDirEnv+", else bin/ at the repository root)")
	versions, _ := testcluster.KubeVersions()
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: kubebins [--bin-dir DIR] [name...]\n\n"+
			"Builds the pinned kube binaries the test harness needs, unless they are up to date.\n"+
			"Names: %s (default: all).\n"+
			"The release is $%s (default %s); the harness can build %s.\n\nFlags:\n",
			strings.Join(testcluster.AllBinaries(), ", "), testcluster.KubeVersionEnv, testcluster.DefaultKubeVersion, strings.Join(versions, ", "))
		fs.PrintDefaults()
	}
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := testcluster.EnsureBinaries(ctx, *binDir, fs.Args()...)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "kubebins: %v\n", err)
		os.Exit(1)
	}
}
