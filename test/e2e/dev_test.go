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
// Ctrl-C (SIGINT). The gateway's lines are pasted as a user would: the
// watch left running, the revocation from "another terminal", which must
// end the watch.
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
		"--ops-address", fmt.Sprintf("127.0.0.1:%d", freePort(t)),
		"--gateway-address", fmt.Sprintf("127.0.0.1:%d", freePort(t)))
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
	require.Len(t, commands, 8, "curl for a kubeconfig, kubectl, curl for a gateway kubeconfig, a watch through it, "+
		"the DELETE of its lease, curl for a certificate kubeconfig, kubectl auth whoami, curl for whoami")

	for i, c := range commands {
		switch i {
		case 3:
			watchThroughGatewayUntilRevoked(t, c, commands[4], filepath.Join(dir, "admin.kubeconfig"))
			continue
		case 4: // pasted by watchThroughGatewayUntilRevoked
			continue
		}
		out, err := exec.Command("bash", "-c", c).CombinedOutput()
		require.NoError(t, err, "command %d as printed: %s\n%s", i+1, c, out)
		switch i {
		case 1:
			require.Contains(t, string(out), "hello", "kubectl lists the demo ConfigMap")
		case 2:
			require.Contains(t, c, `"access":"gateway"`)
		case 6:
			require.Regexp(t, `tokenbroker:west:[0-9a-f]{32}`, string(out), "kubectl is the certificate's per-lease user")
		case 7:
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

// watchThroughGatewayUntilRevoked pastes the printed watch through the
// gateway and leaves it running, sees it list the demo ConfigMap and
// stream a ConfigMap the admin creates, pastes the printed revocation
// (as from another terminal) and requires the watch to end within 2 s of
// the DELETE's answer; the gateway kubeconfig gets nothing from then on.
func watchThroughGatewayUntilRevoked(t *testing.T, watchLine, revokeLine, adminKubeconfig string) {
	t.Helper()
	require.True(t, strings.HasSuffix(watchLine, " get configmaps -w"), "the printed watch: %s", watchLine)
	require.Contains(t, revokeLine, "-X DELETE")
	watch := exec.Command("bash", "-c", watchLine)
	watch.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out := &syncBuffer{}
	watch.Stdout, watch.Stderr = out, out
	require.NoError(t, watch.Start())
	ended := make(chan error, 1)
	go func() { ended <- watch.Wait() }()
	t.Cleanup(func() { _ = watch.Process.Kill() })

	// shows waits for the watch's output to show name, or fails if the
	// watch ends first.
	shows := func(name string) {
		t.Helper()
		deadline := time.After(30 * time.Second)
		for !strings.Contains(out.String(), name) {
			select {
			case err := <-ended:
				t.Fatalf("the watch through the gateway ended before it showed %s: %v\n%s", name, err, out.String())
			case <-deadline:
				t.Fatalf("the watch through the gateway did not show %s within 30s:\n%s", name, out.String())
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	shows("hello")
	// Listed is not yet watching: an event proves the watch is open
	// through the gateway before the revocation.
	kubectl := kubectlBinary(t)
	run(t, kubectl, "--kubeconfig", adminKubeconfig, "-n", "demo", "create", "configmap", "watched")
	shows("watched")

	revokeOut, err := exec.Command("bash", "-c", revokeLine).CombinedOutput()
	require.NoError(t, err, "the revocation as printed: %s\n%s", revokeLine, revokeOut)
	answered := time.Now()
	select {
	case <-ended:
		t.Logf("the watch through the gateway had ended at most %s after the DELETE answered", time.Since(answered).Round(100*time.Microsecond))
	case <-time.After(2 * time.Second):
		t.Fatalf("the watch through the gateway went on 2s after its lease's DELETE answered:\n%s", out.String())
	}

	gatewayKubeconfig := strings.Fields(watchLine)[2]
	refusedOut, err := exec.Command(kubectl, "--kubeconfig", gatewayKubeconfig, "get", "configmaps").CombinedOutput()
	// Refused at the TLS handshake or with a 401, depending on where the
	// gateway stops a revoked lease's certificate: either way no list.
	require.Error(t, err, "the revoked lease's kubeconfig still works:\n%s", refusedOut)
	require.NotContains(t, string(refusedOut), "hello")
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
