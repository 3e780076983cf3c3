package main

import (
	"archive/tar"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	gcrname "github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/stretchr/testify/require"
)

var commitTime = time.Date(2026, 11, 25, 3, 18, 53, 0, time.UTC)

func testOptions() Options {
	return Options{
		Repository: "ghcr.io/tokenbroker/tokenbroker",
		Version:    "v0.1.0",
		Platforms:  []v1.Platform{{OS: "linux", Architecture: "amd64"}},
		Revision:   "27e0a2af4c62729e4a1a34fc8e55d20282f0b498",
		Created:    commitTime,
	}
}

func fakeBinary(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "tokenbroker")
	require.NoError(t, os.WriteFile(p, []byte(content), 0o755))
	return p
}

// TestTheImageHasTheShapeTheChartsRelyOn checks what the Deployments
// assume of the image: user 65532:65532 (runAsNonRoot can be verified), the
// binary as entrypoint (the manifests pass only its arguments), OCI media
// types, the OCI labels with the commit's time, and a root file system of
// exactly the binary (root-owned, not writable) and the user database.
func TestTheImageHasTheShapeTheChartsRelyOn(t *testing.T) {
	o := testOptions()
	img, err := platformImage(o, o.Platforms[0], fakeBinary(t, "#!binary"))
	require.NoError(t, err)

	mt, err := img.MediaType()
	require.NoError(t, err)
	require.Equal(t, types.OCIManifestSchema1, mt)
	m, err := img.Manifest()
	require.NoError(t, err)
	require.Equal(t, types.OCIConfigJSON, m.Config.MediaType)
	require.Len(t, m.Layers, 1)
	require.Equal(t, types.OCILayer, m.Layers[0].MediaType)
	require.Equal(t, o.Revision, m.Annotations["org.opencontainers.image.revision"])

	cf, err := img.ConfigFile()
	require.NoError(t, err)
	require.Equal(t, "65532:65532", cf.Config.User)
	require.Equal(t, []string{"/usr/local/bin/tokenbroker"}, cf.Config.Entrypoint)
	require.Empty(t, cf.Config.Cmd)
	require.Equal(t, "linux", cf.OS)
	require.Equal(t, "amd64", cf.Architecture)
	require.True(t, cf.Created.Time.Equal(commitTime), "created is the commit time, not now: %s", cf.Created)
	require.Equal(t, map[string]string{
		"org.opencontainers.image.source":      "https://github.com/tokenbroker/tokenbroker",
		"org.opencontainers.image.revision":    o.Revision,
		"org.opencontainers.image.version":     "v0.1.0",
		"org.opencontainers.image.created":     "2026-11-25T03:18:53Z",
		"org.opencontainers.image.title":       "tokenbroker",
		"org.opencontainers.image.description": labels(o)["org.opencontainers.image.description"],
	}, cf.Config.Labels)
	for _, h := range cf.History {
		require.True(t, h.Created.Time.Equal(commitTime))
	}

	layers, err := img.Layers()
	require.NoError(t, err)
	rc, err := layers[0].Uncompressed()
	require.NoError(t, err)
	defer rc.Close()
	tr := tar.NewReader(rc)
	got := map[string]string{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		require.Zero(t, h.Uid, h.Name)
		require.Zero(t, h.Gid, h.Name)
		require.True(t, h.ModTime.Equal(commitTime), h.Name)
		body, err := io.ReadAll(tr)
		require.NoError(t, err)
		got[h.Name] = os.FileMode(h.Mode).String()
		switch h.Name {
		case "usr/local/bin/tokenbroker":
			require.Equal(t, "#!binary", string(body))
		case "etc/passwd":
			require.Contains(t, string(body), "nonroot:x:65532:65532:")
		}
	}
	require.Equal(t, map[string]string{
		"etc/": "-rwxr-xr-x", "etc/group": "-r--r--r--", "etc/passwd": "-r--r--r--",
		"tmp/": "-rwxrwxrwx", "usr/": "-rwxr-xr-x", "usr/local/": "-rwxr-xr-x", "usr/local/bin/": "-rwxr-xr-x",
		"usr/local/bin/tokenbroker": "-r-xr-xr-x",
	}, got, "no shell, no package database, nothing writable but /tmp (which a read-only root makes read-only too)")
}

// TestOnlyTheInputsDecideTheDigest builds the same image twice, and once
// with another commit time: the same inputs give the same digest (no clock,
// no host user, no path leaks in), and the commit time is in it.
func TestOnlyTheInputsDecideTheDigest(t *testing.T) {
	o := testOptions()
	bin := fakeBinary(t, "same")
	digest := func(o Options, bin string) v1.Hash {
		img, err := platformImage(o, o.Platforms[0], bin)
		require.NoError(t, err)
		d, err := img.Digest()
		require.NoError(t, err)
		return d
	}
	first := digest(o, bin)
	require.Equal(t, first, digest(o, fakeBinary(t, "same")), "another path, the same bytes")
	later := o
	later.Created = commitTime.Add(time.Second)
	require.NotEqual(t, first, digest(later, bin))
	require.NotEqual(t, first, digest(o, fakeBinary(t, "other")))
}

// TestWriteMakesALayoutCranePushesAndArchivesPodmanLoads checks the
// outputs' shape: the OCI layout's index.json names one multi-platform
// index with the reference annotations containerd and Docker read, and
// each platform's archive holds a docker-archive manifest.json tagged
// REPOSITORY:VERSION.
func TestWriteMakesALayoutCranePushesAndArchivesPodmanLoads(t *testing.T) {
	o := testOptions()
	o.Platforms = []v1.Platform{{OS: "linux", Architecture: "amd64"}, {OS: "linux", Architecture: "arm64"}}
	res := &Result{}
	for _, p := range o.Platforms {
		img, err := platformImage(o, p, fakeBinary(t, p.Architecture))
		require.NoError(t, err)
		res.Images = append(res.Images, img)
	}
	res.Index = indexOf(o, res.Images)
	dir := t.TempDir()
	digest, err := Write(res, o, dir)
	require.NoError(t, err)
	b, err := os.ReadFile(filepath.Join(dir, "digest"))
	require.NoError(t, err)
	require.Equal(t, digest.String()+"\n", string(b))

	idx, err := layout.ImageIndexFromPath(filepath.Join(dir, "oci"))
	require.NoError(t, err)
	im, err := idx.IndexManifest()
	require.NoError(t, err)
	require.Len(t, im.Manifests, 1)
	require.Equal(t, digest, im.Manifests[0].Digest)
	require.Equal(t, types.OCIImageIndex, im.Manifests[0].MediaType)
	require.Equal(t, "v0.1.0", im.Manifests[0].Annotations["org.opencontainers.image.ref.name"])
	require.Equal(t, "ghcr.io/tokenbroker/tokenbroker:v0.1.0", im.Manifests[0].Annotations["io.containerd.image.name"])
	inner, err := idx.ImageIndex(digest)
	require.NoError(t, err)
	platforms, err := inner.IndexManifest()
	require.NoError(t, err)
	require.Len(t, platforms.Manifests, 2)
	for i, m := range platforms.Manifests {
		require.Equal(t, o.Platforms[i].Architecture, m.Platform.Architecture)
	}

	for _, arch := range []string{"amd64", "arm64"} {
		f, err := os.Open(filepath.Join(dir, "tokenbroker-v0.1.0-linux-"+arch+".tar"))
		require.NoError(t, err)
		tr := tar.NewReader(f)
		var manifest string
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			require.NoError(t, err)
			if h.Name == "manifest.json" {
				b, err := io.ReadAll(tr)
				require.NoError(t, err)
				manifest = string(b)
			}
		}
		f.Close()
		require.Contains(t, manifest, `"RepoTags":["ghcr.io/tokenbroker/tokenbroker:v0.1.0"]`)
	}
}

// TestTwoBuildsOfTheCommitGiveTheSameDigest builds the image again into
// another directory and compares it with the one `make image` wrote: first
// linux/amd64 alone from scratch (an empty Go build cache, so no compiled
// package is reused; its manifest digest must be the one the index lists),
// then every platform with the shared cache (the index digest must match).
// One platform from scratch proves that nothing cached changes the bytes; a
// second would compile the same sources again with another GOARCH, which
// costs CI minutes and proves nothing more. `make image-test` runs it.
func TestTwoBuildsOfTheCommitGiveTheSameDigest(t *testing.T) {
	dir, version := os.Getenv("TOKENBROKER_IMAGE_DIR"), os.Getenv("TOKENBROKER_IMAGE_VERSION")
	if testing.Short() || dir == "" || version == "" {
		t.Skip("make image-test runs it after make image (TOKENBROKER_IMAGE_DIR, TOKENBROKER_IMAGE_VERSION)")
	}
	b, err := os.ReadFile(filepath.Join(dir, "digest"))
	require.NoError(t, err)
	want := strings.TrimSpace(string(b))
	idx, err := layout.ImageIndexFromPath(filepath.Join(dir, "oci"))
	require.NoError(t, err)
	wantAMD64 := platformDigest(t, idx, "amd64")

	moduleDir, err := filepath.Abs("../..")
	require.NoError(t, err)
	ctx := context.Background()
	rev, created, _, err := commitInfo(ctx, moduleDir)
	require.NoError(t, err)
	pls, err := parsePlatforms("linux/amd64,linux/arm64")
	require.NoError(t, err)
	o := Options{
		ModuleDir: moduleDir, Repository: "ghcr.io/tokenbroker/tokenbroker", Version: version, Platforms: pls,
		Revision: rev, Created: created,
	}

	scratch := o
	scratch.Platforms = []v1.Platform{{OS: "linux", Architecture: "amd64"}}
	scratch.Env = []string{"GOCACHE=" + t.TempDir()}
	start := time.Now()
	res, err := Build(ctx, scratch, t.TempDir())
	require.NoError(t, err)
	got, err := res.Images[0].Digest()
	require.NoError(t, err)
	t.Logf("linux/amd64 rebuilt with an empty build cache in %s: %s", time.Since(start).Round(time.Second), got)
	require.Equal(t, wantAMD64, got.String(), "linux/amd64 built from scratch must give the manifest the index lists")

	res, err = Build(ctx, o, t.TempDir())
	require.NoError(t, err)
	gotIndex, err := res.Index.Digest()
	require.NoError(t, err)
	require.Equal(t, want, gotIndex.String(), "a second build of the same commit must give the same digest")
}

// platformDigest is the manifest digest idx lists for linux/arch, looked up
// through the nested index `make image` writes (the layout's index points at
// the image index).
func platformDigest(t *testing.T, idx v1.ImageIndex, arch string) string {
	t.Helper()
	m, err := idx.IndexManifest()
	require.NoError(t, err)
	for _, d := range m.Manifests {
		if d.Platform != nil && d.Platform.OS == "linux" && d.Platform.Architecture == arch {
			return d.Digest.String()
		}
		if d.MediaType.IsIndex() {
			child, err := idx.ImageIndex(d.Digest)
			require.NoError(t, err)
			return platformDigest(t, child, arch)
		}
	}
	t.Fatalf("no linux/%s manifest in the image index", arch)
	return ""
}

// TestTheNodeImageIsTheProbeAloneAndTheSameEveryTime builds the harness's
// node image twice: a docker-archive that names NodeImageRef, whose one
// layer holds nodeprobe as the entrypoint, with the same digest both times.
func TestTheNodeImageIsTheProbeAloneAndTheSameEveryTime(t *testing.T) {
	dir := t.TempDir()
	var digests []v1.Hash
	for _, name := range []string{"a.tar", "b.tar"} {
		out := filepath.Join(dir, name)
		require.NoError(t, BuildNodeImage(t.Context(), out))
		tag, err := gcrname.NewTag(NodeImageRef)
		require.NoError(t, err)
		img, err := tarball.ImageFromPath(out, &tag)
		require.NoError(t, err, "the archive names "+NodeImageRef)
		cf, err := img.ConfigFile()
		require.NoError(t, err)
		require.Equal(t, []string{nodeProbePath}, cf.Config.Entrypoint)
		layers, err := img.Layers()
		require.NoError(t, err)
		require.Len(t, layers, 1)
		rc, err := layers[0].Uncompressed()
		require.NoError(t, err)
		tr := tar.NewReader(rc)
		var files []string
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			require.NoError(t, err)
			files = append(files, h.Name)
			if h.Name == nodeProbePath[1:] {
				require.EqualValues(t, 0o555, h.Mode)
			}
		}
		require.NoError(t, rc.Close())
		require.Equal(t, []string{"tmp/", nodeProbePath[1:]}, files)
		d, err := img.Digest()
		require.NoError(t, err)
		digests = append(digests, d)
	}
	require.Equal(t, digests[0], digests[1])
}
