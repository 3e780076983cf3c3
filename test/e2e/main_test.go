// Package e2e tests tokenbroker as users run it: the real binary as a
// process, certificates made with its pki commands, requests made with curl,
// and the kubeconfigs it returns used by real kubectl against a real
// kube-apiserver from the harness.
package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// binary returns bin/tokenbroker, building it if it is missing.
func tokenbrokerBinary(t *testing.T) string {
	t.Helper()
	dir := os.Getenv(testcluster.BinDirEnv)
	if dir == "" {
		dir = filepath.Join(repoRoot(t), "bin")
	}
	p := filepath.Join(dir, "tokenbroker")
	if _, err := os.Stat(p); err != nil {
		out, err := exec.Command("go", "build", "-o", p, "github.com/tokenbroker/tokenbroker/cmd/tokenbroker").CombinedOutput()
		require.NoError(t, err, string(out))
	}
	return p
}

// kubectlBinary returns the kubectl of the harness's Kubernetes release
// ($KUBE_VERSION), built from its pinned k8s.io/kubernetes module if missing.
func kubectlBinary(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	p, err := testcluster.Binary(ctx, "", testcluster.Kubectl)
	require.NoError(t, err)
	return p
}

func repoRoot(t *testing.T) string {
	t.Helper()
	wd, err := os.Getwd()
	require.NoError(t, err)
	for d := wd; d != filepath.Dir(d); d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "test", "go.mod")); err == nil {
			return d
		}
	}
	t.Fatal("repository root not found")
	return ""
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// run runs a command and returns its stdout; it fails the test on error.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, errOut, err := runErr(name, args...)
	require.NoError(t, err, "%s %s\nstdout: %s\nstderr: %s", name, strings.Join(args, " "), out, errOut)
	return out
}

func runErr(name string, args ...string) (string, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if filepath.Base(name) == "tokenbroker" {
		// Stdout may be a kubeconfig or a key the command was asked
		// for; stderr is the log.
		errOut := stderr.String()
		collectLog("cli "+strings.Join(args[:min(len(args), 2)], " ")+" (stderr)", func() string { return errOut })
	}
	return stdout.String(), stderr.String(), err
}

// process is a tokenbroker serve process.
type process struct {
	cmd  *exec.Cmd
	logs *syncBuffer
	done chan error
}

func startProcess(t *testing.T, bin string, args ...string) *process {
	t.Helper()
	p := &process{cmd: exec.Command(bin, args...), logs: &syncBuffer{}, done: make(chan error, 1)}
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	collectLog(strings.Join(args[:min(len(args), 1)], " ")+" ("+t.Name()+")", p.logs.String)
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	require.NoError(t, p.cmd.Start())
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
		}
		if t.Failed() {
			t.Logf("broker log:\n%s", p.logs.String())
		}
	})
	return p
}

// syncBuffer collects a process's output while tests read it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func waitReady(t *testing.T, p *process, url string) time.Duration {
	t.Helper()
	start := time.Now()
	for time.Since(start) < 30*time.Second {
		select {
		case err := <-p.done:
			t.Fatalf("broker exited before it was ready: %v\n%s", err, p.logs.String())
		default:
		}
		if _, _, err := runErr("curl", "-sf", "-o", "/dev/null", url); err == nil {
			return time.Since(start)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("broker not ready after 30s:\n%s", p.logs.String())
	return 0
}

func writeFile(t *testing.T, path, content string) string {
	t.Helper()
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
	return path
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(fmt.Sprintf("must: %v", err))
	}
	return v
}
