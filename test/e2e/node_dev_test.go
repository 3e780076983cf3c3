//go:build node

package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestNodeMakeDevCommandsWorkAsPrinted runs what `make dev NODE=1` runs —
// localcluster with a node and make image's archive, around devnode, which
// installs the broker's chart — then pastes the printed commands into a
// shell as printed: the curl for a kubeconfig, kubectl with it, and the
// kubectl exec into the demo Pod (a line typed comes back), and stops
// everything with Ctrl-C.
func TestNodeMakeDevCommandsWorkAsPrinted(t *testing.T) {
	bin := filepath.Dir(tokenbrokerBinary(t))
	for _, name := range []string{"localcluster", "devnode"} {
		build := exec.Command("go", "build", "-o", filepath.Join(bin, name), "./cmd/"+name)
		build.Dir = filepath.Join(repoRoot(t), "test")
		out, err := build.CombinedOutput()
		require.NoError(t, err, string(out))
	}
	dir := t.TempDir()
	cmd := exec.Command(filepath.Join(bin, "localcluster"), "--controller-manager", "--node", "--import-image", imageArchive(t),
		"--kubeconfig-out", filepath.Join(dir, "admin.kubeconfig"), "--",
		filepath.Join(bin, "devnode"), "--dir", filepath.Join(dir, "dev"), "--image", imageRef(t),
		"--helm", helmBinary(t), "--chart", filepath.Join(repoRoot(t), "deploy", "helm", "tokenbroker"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	logs := &syncBuffer{}
	cmd.Stderr = logs
	require.NoError(t, cmd.Start())
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		if t.Failed() {
			t.Logf("make dev NODE=1 logs:\n%s", logs.String())
		}
	})

	commands := printedCommands(t, stdout, 3*time.Minute)
	require.Len(t, commands, 3, "curl for a kubeconfig, kubectl with it, kubectl exec with it")
	require.Contains(t, commands[2], " exec ")

	path := filepath.Dir(kubectlBinary(t)) + string(os.PathListSeparator) + os.Getenv("PATH")
	for i, c := range commands {
		sh := exec.Command("bash", "-c", c)
		sh.Env = append(os.Environ(), "PATH="+path)
		if i == 2 {
			sh.Stdin = strings.NewReader("typed into the Pod\n")
		}
		out, err := sh.CombinedOutput()
		require.NoError(t, err, "command %d as printed: %s\n%s", i+1, c, out)
		switch i {
		case 1:
			require.Contains(t, string(out), "hello", "kubectl lists the demo ConfigMap")
		case 2:
			require.Equal(t, "typed into the Pod\n", string(out), "the exec session echoes")
		}
	}

	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("Ctrl-C did not stop make dev NODE=1 within 60s")
	}
	_, err = os.Stat(filepath.Join(dir, "admin.kubeconfig"))
	require.ErrorIs(t, err, os.ErrNotExist, "the admin kubeconfig is removed on exit")
}
