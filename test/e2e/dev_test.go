package e2e

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestMakeDevCommandsWorkAsPrinted runs what `make dev` runs — localcluster
// around `tokenbroker dev` — then pastes the printed curl and kubectl
// commands into a shell exactly as printed, and stops everything with
// Ctrl-C (SIGINT).
func TestMakeDevCommandsWorkAsPrinted(t *testing.T) {
	bin := filepath.Dir(tokenbrokerBinary(t))
	localcluster := filepath.Join(bin, "localcluster")
	if _, err := os.Stat(localcluster); err != nil {
		build := exec.Command("go", "build", "-o", localcluster, "./cmd/localcluster")
		build.Dir = filepath.Join(repoRoot(t), "test")
		out, err := build.CombinedOutput()
		require.NoError(t, err, string(out))
	}
	dir := t.TempDir()
	cmd := exec.Command(localcluster, "--controller-manager", "--kubeconfig-out", filepath.Join(dir, "admin.kubeconfig"), "--",
		filepath.Join(bin, "tokenbroker"), "dev", "--dir", filepath.Join(dir, "dev"),
		"--listen-address", fmt.Sprintf("127.0.0.1:%d", freePort(t)),
		"--ops-address", fmt.Sprintf("127.0.0.1:%d", freePort(t)))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	logs := &syncBuffer{}
	cmd.Stderr = logs
	collectLog("dev ("+t.Name()+")", logs.String)
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		if t.Failed() {
			t.Logf("dev logs:\n%s", logs.String())
		}
	})

	commands := printedCommands(t, stdout, 90*time.Second)
	require.Len(t, commands, 5, "curl for a kubeconfig, kubectl, curl for a certificate kubeconfig, kubectl auth whoami, curl for whoami")

	for i, c := range commands {
		out, err := exec.Command("bash", "-c", c).CombinedOutput()
		require.NoError(t, err, "command %d as printed: %s\n%s", i+1, c, out)
		switch i {
		case 1:
			require.Contains(t, string(out), "hello", "kubectl lists the demo ConfigMap")
		case 3:
			require.Regexp(t, `tokenbroker:west:[0-9a-f]{32}`, string(out), "kubectl is the certificate's per-lease user")
		case 4:
			require.Contains(t, string(out), `"peer":"west"`)
		}
	}

	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Ctrl-C did not stop make dev within 30s")
	}
	_, err = os.Stat(filepath.Join(dir, "admin.kubeconfig"))
	require.ErrorIs(t, err, os.ErrNotExist, "the admin kubeconfig is removed on exit")
}

// printedCommands reads a dev banner from r up to its last line ("Ctrl-C
// stops ...") and returns its indented lines, the commands, trimmed; it
// keeps draining r afterwards.
func printedCommands(t *testing.T, r io.Reader, timeout time.Duration) []string {
	t.Helper()
	var commands []string
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	deadline := time.After(timeout)
	for {
		select {
		case line, ok := <-lines:
			require.True(t, ok, "the dev command ended before it was ready")
			if strings.HasPrefix(line, "  ") {
				commands = append(commands, strings.TrimSpace(line))
			}
			if strings.HasPrefix(line, "Ctrl-C stops") {
				go func() {
					for range lines { // keep the pipe drained
					}
				}()
				return commands
			}
		case <-deadline:
			t.Fatalf("the dev command printed no commands within %s", timeout)
		}
	}
}
