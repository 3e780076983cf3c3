package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestRunGivesTheCommandTheKubeconfigAndExitsWithItsStatus(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a real kube-apiserver; skipped with -short")
	}
	t.Parallel()
	out := filepath.Join(t.TempDir(), "nested", "admin.kubeconfig")
	var log bytes.Buffer
	code, err := run(config{
		kubeconfigOut: out,
		startTimeout:  time.Minute,
		command: []string{"sh", "-c", `test "$KUBECONFIG" = "` + out + `" &&
			test "$(stat -c %a "$KUBECONFIG")" = 600 &&
			grep -q client-key-data "$KUBECONFIG" && exit 7`},
	}, make(chan os.Signal), &log)
	require.NoError(t, err, log.String())
	require.Equal(t, 7, code, log.String())
	_, err = os.Stat(out)
	require.True(t, errors.Is(err, os.ErrNotExist), "kubeconfig left behind: %v", err)
}

func TestRunWithoutCommandServesUntilInterrupted(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a real kube-apiserver; skipped with -short")
	}
	t.Parallel()
	out := filepath.Join(t.TempDir(), "admin.kubeconfig")
	sigs := make(chan os.Signal, 1)
	log := &notifyingWriter{marker: "press Ctrl-C", seen: make(chan struct{})}
	go func() {
		<-log.seen
		_, err := os.Stat(out)
		if err != nil {
			t.Errorf("kubeconfig not written while serving: %v", err)
		}
		sigs <- syscall.SIGINT
	}()
	code, err := run(config{kubeconfigOut: out, startTimeout: time.Minute}, sigs, log)
	require.NoError(t, err, log.String())
	require.Equal(t, 0, code)
	require.Contains(t, log.String(), "export KUBECONFIG="+out)
}

func TestParseFlagsSplitsTheCommandAfterDoubleDash(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	cfg, err := parseFlags([]string{"--max-token-expiration", "1h", "--", "kubectl", "get", "ns"}, &out)
	require.NoError(t, err)
	require.Equal(t, time.Hour, cfg.maxTokenExpiration)
	require.Equal(t, ".dev/admin.kubeconfig", cfg.kubeconfigOut)
	require.Equal(t, []string{"kubectl", "get", "ns"}, cfg.command)
}

// notifyingWriter closes seen once marker has been written.
type notifyingWriter struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	marker string
	seen   chan struct{}
	once   sync.Once
}

func (w *notifyingWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	n, err := w.buf.Write(p)
	if strings.Contains(w.buf.String(), w.marker) {
		w.once.Do(func() { close(w.seen) })
	}
	return n, err
}

func (w *notifyingWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}
