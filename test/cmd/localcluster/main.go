// Command localcluster runs a throw-away local Kubernetes control plane (a
// real kube-apiserver with embedded etcd, see package testcluster) for
// development, typically from `make dev`.
//
// It writes the cluster's admin kubeconfig to --kubeconfig-out, then either
// runs the command given after "--" with KUBECONFIG pointing at it, stopping
// the cluster when the command exits (and exiting with its status), or, with
// no command, waits for Ctrl-C. The cluster and its data never outlive it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// config is what the command line asks for.
type config struct {
	kubeconfigOut      string
	binDir             string
	maxTokenExpiration time.Duration
	controllerManager  bool
	node               bool
	importImages       []string
	startTimeout       time.Duration
	command            []string
}

const usage = `Usage: localcluster [flags] [-- command [args...]]

Starts a local Kubernetes control plane for development: a real kube-apiserver
(built from the k8s.io/kubernetes release $KUBE_VERSION names, default
` + testcluster.DefaultKubeVersion + `) with etcd
embedded in this process, listening on 127.0.0.1 on a free port. All state
lives in a temporary directory that is removed on exit.

The admin kubeconfig (credentials embedded, mode 0600) is written to
--kubeconfig-out and removed again on exit.

With a command after "--", localcluster runs it with KUBECONFIG set to that
file (and the binary directory first on PATH, for kubectl), forwards SIGINT and SIGTERM to it, stops the cluster when it exits and
exits with its status. Without a command, it prints the kubeconfig path and
runs until interrupted (Ctrl-C or SIGTERM).

Binaries are taken from $TOKENBROKER_BIN_DIR, else bin/ at the repository root
(or --bin-dir), and built there first if missing (this takes minutes once).

Examples:
  localcluster --kubeconfig-out .dev/admin.kubeconfig
  localcluster -- kubectl get namespaces
  localcluster --max-token-expiration 1h -- go run ./cmd/tokenbroker dev
  localcluster --node --import-image dist/image/tokenbroker-v0.1.0-linux-amd64.tar -- kubectl get nodes

Flags:
`

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		os.Exit(2)
	}
	// Registered before anything starts, so that no signal is lost.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	code, err := run(cfg, sigs, os.Stderr)
	signal.Stop(sigs)
	if err != nil {
		fmt.Fprintf(os.Stderr, "localcluster: %v\n", err)
	}
	os.Exit(code)
}

// parseFlags parses args into a config; errors (and --help) are reported to
// out by the flag package.
func parseFlags(args []string, out io.Writer) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("localcluster", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprint(out, usage)
		fs.PrintDefaults()
	}
	fs.StringVar(&cfg.kubeconfigOut, "kubeconfig-out", ".dev/admin.kubeconfig", "where to write the admin kubeconfig (parent directories are created)")
	fs.StringVar(&cfg.binDir, "bin-dir", "", "directory of the kube binaries (default $"+testcluster.BinDirEnv+", else bin/ at the repository root)")
	fs.DurationVar(&cfg.maxTokenExpiration, "max-token-expiration", 0, "kube-apiserver --service-account-max-token-expiration, e.g. 1h (default: no cap)")
	fs.BoolVar(&cfg.controllerManager, "controller-manager", false, "also run kube-controller-manager with the controllers a real cluster runs (CSR signing, garbage collection, clusterrole aggregation, namespaces, ServiceAccounts...)")
	fs.BoolVar(&cfg.node, "node", false, "also run a node: kubelet, kube-scheduler, containerd and runc (root; Debian packages containerd runc containernetworking-plugins iproute2), and the controller manager")
	fs.Func("import-image", "an image archive (make image's) to import into the node's containerd; repeatable; needs --node", func(s string) error {
		cfg.importImages = append(cfg.importImages, s)
		return nil
	})
	fs.DurationVar(&cfg.startTimeout, "start-timeout", 60*time.Second, "how long to wait for the cluster to become ready")
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	cfg.command = fs.Args()
	if len(cfg.importImages) > 0 && !cfg.node {
		err := errors.New("--import-image needs --node")
		fmt.Fprintf(out, "localcluster: %v\n", err)
		return config{}, err
	}
	if cfg.kubeconfigOut == "" {
		err := errors.New("--kubeconfig-out must not be empty")
		fmt.Fprintf(out, "localcluster: %v\n", err)
		return config{}, err
	}
	return cfg, nil
}

// run starts the cluster, runs the command (or waits for a signal), stops
// the cluster and returns the exit code.
func run(cfg config, sigs <-chan os.Signal, log io.Writer) (int, error) {
	opts := []testcluster.Option{
		testcluster.WithBinDir(cfg.binDir),
		testcluster.WithStartTimeout(cfg.startTimeout),
	}
	if cfg.maxTokenExpiration > 0 {
		opts = append(opts, testcluster.WithMaxTokenExpiration(cfg.maxTokenExpiration))
	}
	if cfg.controllerManager {
		opts = append(opts, testcluster.WithControllerManager())
	}
	if cfg.node {
		opts = append(opts, testcluster.WithNode())
	}

	// A signal during start-up (which may include building binaries)
	// aborts it.
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan struct{})
	go func() {
		select {
		case <-sigs:
			cancel()
		case <-started:
		}
	}()
	cluster, err := testcluster.Run(ctx, opts...)
	close(started)
	cancel()
	if err != nil {
		return 1, fmt.Errorf("start cluster: %w", err)
	}

	for _, img := range cfg.importImages {
		if err := cluster.Node.ImportImage(context.Background(), img); err != nil {
			_ = cluster.Stop()
			return 1, fmt.Errorf("import %s: %w", img, err)
		}
	}
	code, runErr := serve(cfg, cluster, sigs, log)
	if err := cluster.Stop(); err != nil {
		runErr = errors.Join(runErr, fmt.Errorf("stop cluster: %w", err))
	}
	if runErr != nil && code == 0 {
		code = 1
	}
	return code, runErr
}

// serve publishes the kubeconfig and runs the command or waits for a signal.
func serve(cfg config, cluster *testcluster.Cluster, sigs <-chan os.Signal, log io.Writer) (int, error) {
	kubeconfig, err := filepath.Abs(cfg.kubeconfigOut)
	if err != nil {
		return 1, fmt.Errorf("resolve --kubeconfig-out: %w", err)
	}
	if err := copyKubeconfig(cluster.KubeconfigPath, kubeconfig); err != nil {
		return 1, err
	}
	defer func() { _ = os.Remove(kubeconfig) }()
	fmt.Fprintf(log, "localcluster: kube-apiserver %s ready in %s\n", cluster.URL, cluster.StartDuration.Round(time.Millisecond))
	fmt.Fprintf(log, "localcluster: logs in %s\n", cluster.Dir)

	if len(cfg.command) == 0 {
		fmt.Fprintf(log, "localcluster: export KUBECONFIG=%s\n", kubeconfig)
		fmt.Fprintln(log, "localcluster: press Ctrl-C to stop")
		sig := <-sigs
		fmt.Fprintf(log, "localcluster: %s, stopping\n", sig)
		return 0, nil
	}
	// The command finds the pinned kubectl (when built) before any other.
	apiServer, err := testcluster.Binary(context.Background(), cfg.binDir, testcluster.KubeAPIServer)
	if err != nil {
		return 1, err
	}
	return runCommand(cfg.command, kubeconfig, filepath.Dir(apiServer), sigs, log)
}

// runCommand runs command with KUBECONFIG set and binDir first on PATH,
// forwarding signals to it until it exits, and returns its exit status.
func runCommand(command []string, kubeconfig, binDir string, sigs <-chan os.Signal, log io.Writer) (int, error) {
	cmd := exec.Command(command[0], command[1:]...)
	cmd.Stdin = os.Stdin
	cmd.Stdout = os.Stdout
	cmd.Stderr = os.Stderr
	cmd.Env = append(os.Environ(),
		"KUBECONFIG="+kubeconfig,
		"PATH="+binDir+string(os.PathListSeparator)+os.Getenv("PATH"))
	if err := cmd.Start(); err != nil {
		return 127, fmt.Errorf("start %s: %w", command[0], err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	for {
		select {
		case sig := <-sigs:
			// The command shares our process group: a Ctrl-C typed in the
			// terminal already reached it, and a second SIGINT would make
			// many programs skip their graceful shutdown.
			if sig == syscall.SIGINT && inForegroundOfTerminal() {
				continue
			}
			_ = cmd.Process.Signal(sig)
		case err := <-done:
			return exitCode(err, log)
		}
	}
}

// exitCode maps the command's end to a shell-style exit status.
func exitCode(err error, log io.Writer) (int, error) {
	if err == nil {
		return 0, nil
	}
	var exitErr *exec.ExitError
	if !errors.As(err, &exitErr) {
		return 1, fmt.Errorf("wait for command: %w", err)
	}
	if status, ok := exitErr.Sys().(syscall.WaitStatus); ok && status.Signaled() {
		fmt.Fprintf(log, "localcluster: command killed by %s\n", status.Signal())
		return 128 + int(status.Signal()), nil
	}
	return exitErr.ExitCode(), nil
}

// inForegroundOfTerminal reports whether stdin is a terminal whose
// foreground process group is ours, i.e. whether the terminal's Ctrl-C is
// delivered to our whole process group.
func inForegroundOfTerminal() bool {
	pgrp, err := unix.IoctlGetInt(int(os.Stdin.Fd()), unix.TIOCGPGRP)
	return err == nil && pgrp == syscall.Getpgrp()
}

// copyKubeconfig writes the admin kubeconfig to dst with mode 0600: it
// holds the admin private key.
func copyKubeconfig(src, dst string) error {
	data, err := os.ReadFile(src)
	if err != nil {
		return fmt.Errorf("read admin kubeconfig: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return fmt.Errorf("create kubeconfig directory: %w", err)
	}
	if err := os.WriteFile(dst, data, 0o600); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	// WriteFile keeps the mode of an existing file; a stale one may be 0644.
	if err := os.Chmod(dst, 0o600); err != nil {
		return fmt.Errorf("restrict kubeconfig: %w", err)
	}
	return nil
}
