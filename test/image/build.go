package main

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// The image's fixed shape. The Deployments of deploy/ and the chart rely on
// each of these (runAsUser 65532, args without the binary's name).
const (
	// UID and GID of the image's user, distroless's "nonroot".
	nonroot = 65532
	// Where the binary lives; the entrypoint is its absolute path and
	// PATH names its directory, so `podman exec CTR tokenbroker version`
	// works too.
	binaryPath = "/usr/local/bin/tokenbroker"
	// What the OCI labels name as the source.
	sourceURL = "https://github.com/tokenbroker/tokenbroker"
)

// Options say what to build. Everything that reaches the image digest is
// in here or in the commit: no clock, no host user, no host path.
type Options struct {
	// ModuleDir is the repository root (the main module).
	ModuleDir string
	// Repository and Version make the reference REPOSITORY:VERSION.
	Repository string
	Version    string
	// Platforms are os/arch pairs, e.g. linux/amd64.
	Platforms []v1.Platform
	// Revision and Created go into the labels; Created is the commit time.
	Revision string
	Created  time.Time
	// Env is added to the environment of `go build` (a test sets GOCACHE).
	Env []string
	// Log receives progress lines; nil discards them.
	Log io.Writer
}

// Result is what Build made.
type Result struct {
	Index v1.ImageIndex
	// Images and Binaries are in the order of Options.Platforms.
	Images   []v1.Image
	Binaries []string
}

// Build cross-compiles tokenbroker for every platform into binDir and
// assembles the multi-platform OCI index from them.
func Build(ctx context.Context, o Options, binDir string) (*Result, error) {
	if len(o.Platforms) == 0 {
		return nil, errors.New("no platforms")
	}
	res := &Result{}
	for _, p := range o.Platforms {
		bin := filepath.Join(binDir, p.OS+"-"+p.Architecture, "tokenbroker")
		if err := goBuild(ctx, o, p, bin); err != nil {
			return nil, err
		}
		img, err := platformImage(o, p, bin)
		if err != nil {
			return nil, fmt.Errorf("%s/%s: %w", p.OS, p.Architecture, err)
		}
		res.Images = append(res.Images, img)
		res.Binaries = append(res.Binaries, bin)
	}
	res.Index = indexOf(o, res.Images)
	return res, nil
}

// indexOf is the OCI image index of the platforms' images (in the order of
// o.Platforms), annotated with the labels.
func indexOf(o Options, images []v1.Image) v1.ImageIndex {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for i, img := range images {
		p := o.Platforms[i]
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add:        img,
			Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: p.OS, Architecture: p.Architecture, Variant: p.Variant}},
		})
	}
	return mutate.Annotations(idx, labels(o)).(v1.ImageIndex)
}

// goBuild builds a static binary: no cgo, paths trimmed, the version in
// main.version and the commit in the build information (buildvcs), symbol
// tables stripped. The Go toolchain's builds are reproducible given the
// same toolchain, sources and flags.
func goBuild(ctx context.Context, o Options, p v1.Platform, out string) error {
	ldflags := "-s -w -X main.version=" + o.Version
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-buildvcs=true", "-ldflags", ldflags, "-o", out, "./cmd/tokenbroker")
	cmd.Dir = o.ModuleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+p.OS, "GOARCH="+p.Architecture, "GOFLAGS=-mod=readonly")
	if p.Variant != "" && p.Architecture == "arm" {
		cmd.Env = append(cmd.Env, "GOARM="+strings.TrimPrefix(p.Variant, "v"))
	}
	cmd.Env = append(cmd.Env, o.Env...)
	if o.Log != nil {
		fmt.Fprintf(o.Log, "go build %s/%s\n", p.OS, p.Architecture)
	}
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build for %s/%s: %w\n%s", p.OS, p.Architecture, err, b)
	}
	return nil
}

// labels are the OCI annotations of the index and the labels of every
// image's configuration.
func labels(o Options) map[string]string {
	return map[string]string{
		"org.opencontainers.image.source":      sourceURL,
		"org.opencontainers.image.revision":    o.Revision,
		"org.opencontainers.image.version":     o.Version,
		"org.opencontainers.image.created":     o.Created.UTC().Format(time.RFC3339),
		"org.opencontainers.image.title":       "tokenbroker",
		"org.opencontainers.image.description": "Short-lived kubeconfigs between Kubernetes clusters over mutual TLS: the broker, the agent and the credential plugin",
	}
}

// platformImage is one platform's image: a single layer with the binary
// and the passwd and group files that name UID/GID 65532, on no base image.
func platformImage(o Options, p v1.Platform, bin string) (v1.Image, error) {
	binary, err := os.ReadFile(bin)
	if err != nil {
		return nil, err
	}
	rootfs, err := layerTar(binary, o.Created)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(rootfs)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   v1.Time{Time: o.Created},
			CreatedBy: "test/image: tokenbroker " + o.Version + " (CGO_ENABLED=0 go build -trimpath)",
			Comment:   "the static tokenbroker binary, /etc/passwd and /etc/group",
		},
	})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Variant = p.OS, p.Architecture, p.Variant
	cf.Created = v1.Time{Time: o.Created}
	cf.Author = sourceURL
	cf.Config = v1.Config{
		Entrypoint: []string{binaryPath},
		Env:        []string{"PATH=/usr/local/bin"},
		User:       strconv.Itoa(nonroot) + ":" + strconv.Itoa(nonroot),
		WorkingDir: "/",
		Labels:     labels(o),
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, err
	}
	return mutate.Annotations(img, labels(o)).(v1.Image), nil
}

// layerTar is the root file system: directories, the binary (root-owned,
// read and execute only) and the user database. Every header is fixed but
// for the commit time, so the same binary gives the same bytes.
func layerTar(binary []byte, mtime time.Time) ([]byte, error) {
	passwd := "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/nonexistent:/sbin/nologin\n"
	group := "root:x:0:\nnonroot:x:65532:\n"
	entries := []tarEntry{
		{"etc/", 0o755, nil},
		{"etc/group", 0o444, []byte(group)},
		{"etc/passwd", 0o444, []byte(passwd)},
		{"tmp/", 0o1777, nil},
		{"usr/", 0o755, nil},
		{"usr/local/", 0o755, nil},
		{"usr/local/bin/", 0o755, nil},
		{strings.TrimPrefix(binaryPath, "/"), 0o555, binary},
	}
	return tarOf(entries, mtime)
}

// tarEntry is one file or directory (name ending in "/") of a layer.
type tarEntry struct {
	name string
	mode int64
	body []byte
}

// tarOf writes entries as an uncompressed layer, root-owned, every header
// fixed but for mtime.
func tarOf(entries []tarEntry, mtime time.Time) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{
			Name:    e.name,
			Mode:    e.mode,
			ModTime: mtime.UTC().Truncate(time.Second),
			Format:  tar.FormatPAX,
		}
		if strings.HasSuffix(e.name, "/") {
			h.Typeflag = tar.TypeDir
		} else {
			h.Typeflag = tar.TypeReg
			h.Size = int64(len(e.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.body); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// Write puts the outputs in dir, replacing what a previous build left:
//
//	oci/                                      the OCI layout: index.json names the multi-platform index
//	tokenbroker-VERSION-OS-ARCH.tar           one docker-archive per platform, tagged REPOSITORY:VERSION
//	OS-ARCH/tokenbroker                       the binaries (the SBOM is generated from them)
//	digest                                    the index digest, sha256:...
func Write(res *Result, o Options, dir string) (v1.Hash, error) {
	ref, err := name.NewTag(o.Repository + ":" + o.Version)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("image reference: %w", err)
	}
	ociDir := filepath.Join(dir, "oci")
	if err := os.RemoveAll(ociDir); err != nil {
		return v1.Hash{}, err
	}
	p, err := layout.Write(ociDir, empty.Index)
	if err != nil {
		return v1.Hash{}, err
	}
	// ref.name as docker save and skopeo write it (the tag), and the full
	// name under the key containerd and Docker read on import.
	if err := p.AppendIndex(res.Index, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": o.Version,
		"io.containerd.image.name":          ref.String(),
	})); err != nil {
		return v1.Hash{}, err
	}
	for i, img := range res.Images {
		pl := o.Platforms[i]
		file := filepath.Join(dir, fmt.Sprintf("tokenbroker-%s-%s-%s.tar", o.Version, pl.OS, pl.Architecture))
		if err := tarball.WriteToFile(file, ref, img); err != nil {
			return v1.Hash{}, err
		}
	}
	digest, err := res.Index.Digest()
	if err != nil {
		return v1.Hash{}, err
	}
	return digest, os.WriteFile(filepath.Join(dir, "digest"), []byte(digest.String()+"\n"), 0o644)
}
