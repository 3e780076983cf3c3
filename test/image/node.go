package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// NodeImageRef is the reference of the test harness's node image: the pod
// sandbox of its kubelet and the container of the stream tests. It is
// imported into the node's containerd, never pulled.
const NodeImageRef = "localhost/tokenbroker-test/node:v1"

// nodeProbePath is where the image holds nodeprobe; it is the entrypoint.
const nodeProbePath = "/nodeprobe"

// BuildNodeImage builds nodeprobe (./nodeprobe, for the host's
// architecture) and writes the one-layer image that holds it to out as a
// docker-archive tagged NodeImageRef, which `ctr images import` takes.
// Like the product image it is reproducible: the time in it is fixed.
func BuildNodeImage(ctx context.Context, out string) error {
	dir, err := os.MkdirTemp("", "nodeimage-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	bin := filepath.Join(dir, "nodeprobe")
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", "-s -w", "-o", bin, "./nodeprobe")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+runtime.GOARCH)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./nodeprobe: %w\n%s", err, b)
	}
	probe, err := os.ReadFile(bin)
	if err != nil {
		return err
	}
	epoch := time.Unix(0, 0).UTC()
	rootfs, err := tarOf([]tarEntry{{"tmp/", 0o1777, nil}, {nodeProbePath[1:], 0o555, probe}}, epoch)
	if err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(rootfs)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return err
	}
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	if img, err = mutate.AppendLayers(img, layer); err != nil {
		return err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Created = v1.Time{Time: epoch}
	cf.Config = v1.Config{Entrypoint: []string{nodeProbePath}, WorkingDir: "/"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	ref, err := name.NewTag(NodeImageRef)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	// Written beside out and renamed, so a reader never sees half a file.
	tmp := out + ".tmp"
	if err := tarball.WriteToFile(tmp, ref, img); err != nil {
		return err
	}
	return os.Rename(tmp, out)
}
