package testcluster

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

// BinDirEnv names the environment variable that points the harness at a
// directory holding (or to receive) the kube binaries.
const BinDirEnv = "TOKENBROKER_BIN_DIR"

// KubeVersionEnv names the environment variable that picks the Kubernetes
// release the harness builds and runs (KUBE_VERSION=v1.35.4); unset, it is
// DefaultKubeVersion. Each release the harness can build is a small module
// of its own, test/kube/<version>, that pins k8s.io/kubernetes at that
// version; the binaries of each are kept apart in <bin>/kube/<version>.
const KubeVersionEnv = "KUBE_VERSION"

// DefaultKubeVersion is the release `make test` runs against: the newest
// Kubernetes the project supports.
const DefaultKubeVersion = "v1.37.2"

// Names of the binaries the harness can build. They are pinned in
// test/kube/<version>/tools.go.
const (
	KubeAPIServer         = "kube-apiserver"
	KubeControllerManager = "kube-controller-manager"
	Kubectl               = "kubectl"
	// The node's (WithNode).
	Kubelet       = "kubelet"
	KubeScheduler = "kube-scheduler"
)

// AllBinaries returns the names of every binary the harness can build.
func AllBinaries() []string {
	return append(ControlPlaneBinaries(), NodeBinaries()...)
}

// ControlPlaneBinaries are the binaries every cluster needs, and kubectl.
func ControlPlaneBinaries() []string {
	return []string{KubeAPIServer, KubeControllerManager, Kubectl}
}

// NodeBinaries are the binaries of a node (WithNode).
func NodeBinaries() []string {
	return []string{Kubelet, KubeScheduler}
}

const (
	buildLockFile     = ".build.lock"
	stampSuffix       = ".stamp"
	lockPollInterval  = 200 * time.Millisecond
	buildOutputLimit  = 8192
	kubernetesModule  = "k8s.io/kubernetes"
	kubernetesCmdPath = kubernetesModule + "/cmd/"
	kubeModulesDir    = "kube" // under test/: one module per release
	kubeBinSubdir     = "kube" // under the binary directory: one directory per release
)

// KubeVersion returns the Kubernetes release the harness uses: $KUBE_VERSION
// if set, else DefaultKubeVersion. It fails, naming the releases there are,
// when test/kube holds no module for it.
func KubeVersion() (string, error) {
	v := strings.TrimSpace(os.Getenv(KubeVersionEnv))
	if v == "" {
		v = DefaultKubeVersion
	}
	if !strings.HasPrefix(v, "v") {
		v = "v" + v
	}
	root, err := repoRoot()
	if err != nil {
		return "", fmt.Errorf("locate test/%s: %w", kubeModulesDir, err)
	}
	if strings.ContainsAny(v, `/\`) || !isFile(filepath.Join(root, "test", kubeModulesDir, v, "go.mod")) {
		have, _ := KubeVersions()
		return "", fmt.Errorf("%s=%s: the harness has no module test/%s/%s; it can build %s", KubeVersionEnv, v, kubeModulesDir, v, strings.Join(have, ", "))
	}
	return v, nil
}

// KubeVersions lists the releases the harness can build: the modules under
// test/kube.
func KubeVersions() ([]string, error) {
	root, err := repoRoot()
	if err != nil {
		return nil, err
	}
	entries, err := os.ReadDir(filepath.Join(root, "test", kubeModulesDir))
	if err != nil {
		return nil, err
	}
	var vs []string
	for _, e := range entries {
		if e.IsDir() && isFile(filepath.Join(root, "test", kubeModulesDir, e.Name(), "go.mod")) {
			vs = append(vs, e.Name())
		}
	}
	return vs, nil
}

// Binary returns the path of one of the pinned kube binaries (KubeAPIServer,
// KubeControllerManager, Kubectl, Kubelet or KubeScheduler) of KubeVersion, building it with `go
// build` from test/kube/<version> only if it is missing: a present binary is
// trusted, so that a test never pays for a rebuild (EnsureBinaries, run by
// the Makefile, is what replaces stale ones). binDir may be empty: then
// $TOKENBROKER_BIN_DIR is used if set, else bin/ at the repository root; the
// binaries live in its kube/<version> subdirectory. Parallel callers, also in
// other processes, build a binary only once: builds hold a flock on a lock
// file in the binary directory. The first build of kube-apiserver takes
// minutes; ctx bounds the wait for the lock and the build.
func Binary(ctx context.Context, binDir, name string) (string, error) {
	if err := checkNames(name); err != nil {
		return "", err
	}
	dir, version, err := kubeBinDir(binDir)
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, name)
	if isExecutable(path) {
		return path, nil
	}
	err = withBuildLock(ctx, dir, func() error {
		// Another process may have built it while we waited for the lock.
		if isExecutable(path) {
			return nil
		}
		return build(ctx, dir, version, []string{name})
	})
	if err != nil {
		return "", err
	}
	return path, nil
}

// EnsureBinaries builds the named binaries (ControlPlaneBinaries when names is empty)
// of KubeVersion into binDir/kube/<version> (binDir resolved as for Binary)
// unless each is present and was built from the current
// test/kube/<version>/go.mod, go.sum and Go toolchain. For the default
// version it also links <binDir>/kubectl to its kubectl, the one README's
// commands run. Make targets
// call it (through test/cmd/kubebins) once per run, so that tests find fresh
// binaries; when nothing changed it costs a second, not a relink.
func EnsureBinaries(ctx context.Context, binDir string, names ...string) error {
	if len(names) == 0 {
		names = ControlPlaneBinaries()
	}
	if err := checkNames(names...); err != nil {
		return err
	}
	dir, version, err := kubeBinDir(binDir)
	if err != nil {
		return err
	}
	inputs, err := buildInputs(ctx, version)
	if err != nil {
		return err
	}
	stale := func() []string {
		var out []string
		for _, name := range names {
			stamp, err := os.ReadFile(filepath.Join(dir, "."+name+stampSuffix))
			if err != nil || string(stamp) != inputs.stamp || !isExecutable(filepath.Join(dir, name)) {
				out = append(out, name)
			}
		}
		return out
	}
	// Up to date without the lock: a build moves each binary into place
	// before it writes its stamp, so a matching stamp names a whole
	// binary. Callers whose binaries are built do not wait for another
	// process building others of the release (make kube-node while make
	// test runs).
	if len(stale()) > 0 {
		if err := withBuildLock(ctx, dir, func() error {
			if names := stale(); len(names) > 0 {
				return buildWith(ctx, dir, names, inputs)
			}
			return nil
		}); err != nil {
			return err
		}
	}
	if version != DefaultKubeVersion || !slices.Contains(names, Kubectl) {
		return nil
	}
	link := filepath.Join(filepath.Dir(filepath.Dir(dir)), Kubectl)
	target := filepath.Join(kubeBinSubdir, version, Kubectl)
	if cur, err := os.Readlink(link); err == nil && cur == target {
		return nil
	}
	_ = os.Remove(link)
	if err := os.Symlink(target, link); err != nil {
		return fmt.Errorf("link %s: %w", link, err)
	}
	return nil
}

// kubeBinDir returns the directory the binaries of KubeVersion live in.
func kubeBinDir(binDir string) (dir, version string, err error) {
	version, err = KubeVersion()
	if err != nil {
		return "", "", err
	}
	root, err := resolveBinDir(binDir)
	if err != nil {
		return "", "", err
	}
	return filepath.Join(root, kubeBinSubdir, version), version, nil
}

func checkNames(names ...string) error {
	for _, name := range names {
		switch name {
		case KubeAPIServer, KubeControllerManager, Kubectl, Kubelet, KubeScheduler:
		default:
			return fmt.Errorf("unknown kube binary %q (want one of %s)", name, strings.Join(AllBinaries(), ", "))
		}
	}
	return nil
}

// resolveBinDir applies the precedence explicit > $TOKENBROKER_BIN_DIR >
// <repository root>/bin.
func resolveBinDir(binDir string) (string, error) {
	if binDir == "" {
		binDir = os.Getenv(BinDirEnv)
	}
	if binDir == "" {
		root, err := repoRoot()
		if err != nil {
			return "", fmt.Errorf("find binary directory (set %s to override): %w", BinDirEnv, err)
		}
		binDir = filepath.Join(root, "bin")
	}
	abs, err := filepath.Abs(binDir)
	if err != nil {
		return "", fmt.Errorf("resolve binary directory: %w", err)
	}
	return abs, nil
}

// repoRoot walks up from the working directory to the directory that holds
// both go.mod and test/go.mod: the tokenbroker repository root.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("get working directory: %w", err)
	}
	for {
		if isFile(filepath.Join(dir, "go.mod")) && isFile(filepath.Join(dir, "test", "go.mod")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no directory containing go.mod and test/go.mod above the working directory")
		}
		dir = parent
	}
}

// inputs is what a build depends on beyond the Go build cache's own
// tracking: where the module is, which kube version, and a stamp that
// changes whenever the result would.
type inputs struct {
	moduleDir   string
	kubeVersion string // e.g. v1.37.2
	ldflags     string
	stamp       string
}

func buildInputs(ctx context.Context, kubeVersion string) (*inputs, error) {
	root, err := repoRoot()
	if err != nil {
		return nil, fmt.Errorf("locate the module to build from: %w", err)
	}
	moduleDir := filepath.Join(root, "test", kubeModulesDir, kubeVersion)
	version, err := goOutput(ctx, moduleDir, "list", "-m", "-f", "{{.Version}}", kubernetesModule)
	if err != nil {
		return nil, err
	}
	if version != kubeVersion {
		return nil, fmt.Errorf("test/%s/%s pins %s %s, not %s", kubeModulesDir, kubeVersion, kubernetesModule, version, kubeVersion)
	}
	goVersion, err := goOutput(ctx, moduleDir, "env", "GOVERSION")
	if err != nil {
		return nil, err
	}
	ldflags, err := versionLDFlags(version)
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	for _, f := range []string{"go.mod", "go.sum"} {
		data, err := os.ReadFile(filepath.Join(moduleDir, f))
		if err != nil {
			return nil, fmt.Errorf("read test/%s/%s/%s: %w", kubeModulesDir, kubeVersion, f, err)
		}
		h.Write(data)
	}
	fmt.Fprintf(h, "\x00%s\x00%s", goVersion, ldflags)
	return &inputs{
		moduleDir:   moduleDir,
		kubeVersion: version,
		ldflags:     ldflags,
		stamp:       hex.EncodeToString(h.Sum(nil)) + "\n",
	}, nil
}

// versionLDFlags stamps the binaries with the real Kubernetes version, as the
// Kubernetes release build does: a plain `go build` reports
// v0.0.0-master+$Format:%H$, which kubectl and version-checking clients
// cannot parse. Like the release build (hack/lib/golang.sh), it also leaves
// out the symbol table and DWARF (-s -w): nobody debugs the harness's
// kube-apiserver, and writing them is much of what the link of these
// binaries costs. Stack traces stay whole.
func versionLDFlags(version string) (string, error) {
	parts := strings.SplitN(strings.TrimPrefix(version, "v"), ".", 3)
	if len(parts) < 2 {
		return "", fmt.Errorf("unexpected %s version %q", kubernetesModule, version)
	}
	vars := []struct{ key, value string }{
		{"gitVersion", version},
		{"gitMajor", parts[0]},
		{"gitMinor", parts[1]},
		{"gitTreeState", "clean"},
	}
	flags := []string{"-s", "-w"}
	for _, pkg := range []string{"k8s.io/component-base/version", "k8s.io/client-go/pkg/version"} {
		for _, v := range vars {
			flags = append(flags, "-X "+pkg+"."+v.key+"="+v.value)
		}
	}
	return strings.Join(flags, " "), nil
}

// build compiles names into dir; the caller holds the build lock.
func build(ctx context.Context, dir, version string, names []string) error {
	in, err := buildInputs(ctx, version)
	if err != nil {
		return err
	}
	return buildWith(ctx, dir, names, in)
}

// buildWith compiles k8s.io/kubernetes/cmd/<name> for each name in one
// `go build` (so the packages they share compile once), into a scratch
// directory first so that nobody ever runs a half-written binary, then
// moves them into dir and records their stamps.
func buildWith(ctx context.Context, dir string, names []string, in *inputs) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create binary directory: %w", err)
	}
	scratch, err := os.MkdirTemp(dir, ".build-")
	if err != nil {
		return fmt.Errorf("create build directory: %w", err)
	}
	defer func() { _ = os.RemoveAll(scratch) }()

	args := []string{"build", "-ldflags", in.ldflags, "-o", scratch + string(os.PathSeparator)}
	for _, name := range names {
		args = append(args, kubernetesCmdPath+name)
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = in.moduleDir
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build %s (%s): %w\n%s", strings.Join(names, " "), in.kubeVersion, err, tail(out.Bytes(), buildOutputLimit))
	}
	for _, name := range names {
		if err := os.Rename(filepath.Join(scratch, name), filepath.Join(dir, name)); err != nil {
			return fmt.Errorf("install %s: %w", name, err)
		}
		if err := os.WriteFile(filepath.Join(dir, "."+name+stampSuffix), []byte(in.stamp), 0o644); err != nil {
			return fmt.Errorf("write build stamp of %s: %w", name, err)
		}
	}
	return nil
}

// goOutput runs the go command in dir and returns its trimmed output.
func goOutput(ctx context.Context, dir string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return strings.TrimSpace(string(out)), nil
}

// withBuildLock runs fn while holding an exclusive flock on the lock file in
// dir, polling so that ctx can end the wait. The lock dies with the process,
// so a crashed build never wedges it.
func withBuildLock(ctx context.Context, dir string, fn func() error) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("create binary directory: %w", err)
	}
	unlock, err := lockFile(ctx, filepath.Join(dir, buildLockFile))
	if err != nil {
		return err
	}
	defer unlock()
	return fn()
}

func lockFile(ctx context.Context, path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open build lock: %w", err)
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() {
				_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
				_ = f.Close()
			}, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			_ = f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			_ = f.Close()
			return nil, fmt.Errorf("wait for build lock %s: %w", path, ctx.Err())
		case <-time.After(lockPollInterval):
		}
	}
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

func isFile(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular()
}

// tail returns at most the last n bytes of b, cut at a line start.
func tail(b []byte, n int) []byte {
	if len(b) <= n {
		return b
	}
	b = b[len(b)-n:]
	if i := bytes.IndexByte(b, '\n'); i >= 0 {
		b = b[i+1:]
	}
	return b
}
