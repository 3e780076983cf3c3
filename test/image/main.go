// Command image builds tokenbroker's container image without a container
// engine and without a base image: one layer holding the static binary and
// the user database for UID/GID 65532, assembled with go-containerregistry
// into a multi-platform OCI index. The same commit always gives the same
// digest: the binary is built with -trimpath, and the only time in the
// image is the commit time.
//
// `make image` runs it from this directory:
//
//	go run . -module-dir ../.. -out ../../dist/image -repository ghcr.io/tokenbroker/tokenbroker -version v0.1.0
//
// It is a module of its own so that go-containerregistry stays out of the
// main module and out of the test harness's module (whose dependencies pin
// the kube binaries the harness builds).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	moduleDir := fs.String("module-dir", "../..", "the repository root (the main module)")
	out := fs.String("out", "../../dist/image", "output directory")
	repository := fs.String("repository", "ghcr.io/tokenbroker/tokenbroker", "image repository")
	version := fs.String("version", "", "image tag and main.version (required)")
	platforms := fs.String("platforms", "linux/amd64,linux/arm64", "comma-separated os/arch list")
	nodeImage := fs.String("node-image", "", "build only the test harness's node image ("+NodeImageRef+") into this docker-archive file")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: image -version VERSION [flags]\n       image -node-image FILE\n\n"+
			"Builds the tokenbroker image for every platform into an OCI layout, one\n"+
			"docker-archive tarball per platform, the binaries and the index digest.\n"+
			"The labels take the revision and the creation time from the commit\n"+
			"(SOURCE_DATE_EPOCH overrides the time).\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *nodeImage != "" {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
		defer stop()
		return BuildNodeImage(ctx, *nodeImage)
	}
	if *version == "" {
		fs.Usage()
		return errors.New("-version is required")
	}
	pls, err := parsePlatforms(*platforms)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	rev, created, dirty, err := commitInfo(ctx, *moduleDir)
	if err != nil {
		return err
	}
	if dirty {
		fmt.Fprintf(os.Stderr, "image: warning: the work tree has uncommitted changes; the image is not reproducible from %s\n", rev)
	}
	o := Options{
		ModuleDir:  *moduleDir,
		Repository: *repository,
		Version:    *version,
		Platforms:  pls,
		Revision:   rev,
		Created:    created,
		Log:        os.Stderr,
	}
	start := time.Now()
	res, err := Build(ctx, o, *out)
	if err != nil {
		return err
	}
	digest, err := Write(res, o, *out)
	if err != nil {
		return err
	}
	fmt.Printf("%s:%s@%s\n", o.Repository, o.Version, digest)
	for i, img := range res.Images {
		size, err := compressedSize(img)
		if err != nil {
			return err
		}
		d, _ := img.Digest()
		fmt.Printf("  %s/%s %s %.1f MiB compressed\n", pls[i].OS, pls[i].Architecture, d, float64(size)/(1<<20))
	}
	fmt.Printf("built in %s into %s (revision %s, created %s)\n", time.Since(start).Round(100*time.Millisecond), *out, rev, created.UTC().Format(time.RFC3339))
	return nil
}

func parsePlatforms(s string) ([]v1.Platform, error) {
	var out []v1.Platform
	for _, f := range strings.Split(s, ",") {
		p, err := v1.ParsePlatform(strings.TrimSpace(f))
		if err != nil || p.OS == "" || p.Architecture == "" {
			return nil, fmt.Errorf("platform %q: want os/arch such as linux/amd64", f)
		}
		out = append(out, *p)
	}
	return out, nil
}

// commitInfo reads HEAD's revision and commit time, and whether the work
// tree differs from it. SOURCE_DATE_EPOCH, when set, replaces the time.
func commitInfo(ctx context.Context, dir string) (rev string, created time.Time, dirty bool, err error) {
	git := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, "git", args...)
		cmd.Dir = dir
		b, err := cmd.Output()
		if err != nil {
			return "", fmt.Errorf("git %s: %w", strings.Join(args, " "), err)
		}
		return strings.TrimSpace(string(b)), nil
	}
	if rev, err = git("rev-parse", "HEAD"); err != nil {
		return
	}
	ct, err := git("log", "-1", "--format=%ct", "HEAD")
	if err != nil {
		return
	}
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		ct = s
	}
	secs, err := strconv.ParseInt(ct, 10, 64)
	if err != nil {
		return rev, created, dirty, fmt.Errorf("commit time %q: %w", ct, err)
	}
	created = time.Unix(secs, 0).UTC()
	// As the go command decides vcs.modified: untracked files count.
	status, err := git("status", "--porcelain")
	return rev, created, status != "", err
}

func compressedSize(img v1.Image) (int64, error) {
	layers, err := img.Layers()
	if err != nil {
		return 0, err
	}
	var n int64
	for _, l := range layers {
		s, err := l.Size()
		if err != nil {
			return 0, err
		}
		n += s
	}
	return n, nil
}
