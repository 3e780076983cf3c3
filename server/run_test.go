package server

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"k8s.io/client-go/rest"

	"github.com/tokenbroker/tokenbroker/broker/audit"
)

func TestAnAuditLogFileIsAppendedToAndPrivate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	require.NoError(t, os.WriteFile(path, []byte("{\"earlier\":true}\n"), 0o600))
	a, closeFn, err := OpenAuditLog(path, zap.NewNop())
	require.NoError(t, err)
	require.NoError(t, a.Audit(audit.Event{Audit: audit.Schema, Action: audit.ActionIssue, Decision: audit.DecisionAllow}))
	closeFn()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	require.Len(t, lines, 2, "the earlier content is kept")
	require.Contains(t, lines[1], `"action":"issue"`)

	fresh := filepath.Join(t.TempDir(), "new.jsonl")
	_, closeFn, err = OpenAuditLog(fresh, zap.NewNop())
	require.NoError(t, err)
	closeFn()
	st, err := os.Stat(fresh)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())

	_, _, err = OpenAuditLog(filepath.Join(t.TempDir(), "missing", "audit.jsonl"), zap.NewNop())
	require.ErrorContains(t, err, "audit log")
}

func TestTheAuditLogFileIsReopenedOnSIGHUPForLogrotate(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "audit.jsonl")
	core, logs := observer.New(zap.InfoLevel)
	a, closeFn, err := OpenAuditLog(path, zap.New(core))
	require.NoError(t, err)
	defer closeFn()
	event := func(id string) {
		require.NoError(t, a.Audit(audit.Event{Audit: audit.Schema, Action: audit.ActionIssue, RequestID: id}))
	}
	event("before")
	require.NoError(t, os.Rename(path, path+".1")) // what logrotate does first
	event("after-rename")                          // still the old file, until the signal
	require.NoError(t, syscall.Kill(os.Getpid(), syscall.SIGHUP))
	require.Eventually(t, func() bool { return logs.FilterMessage("audit log reopened").Len() == 1 },
		5*time.Second, 10*time.Millisecond, "SIGHUP reopens the audit log under its name")
	event("after-reopen")

	old, err := os.ReadFile(path + ".1")
	require.NoError(t, err)
	require.Contains(t, string(old), `"request_id":"before"`)
	require.Contains(t, string(old), `"request_id":"after-rename"`)
	cur, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(string(cur), "\n"))
	require.Contains(t, string(cur), `"request_id":"after-reopen"`)
	st, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
}

func TestRunsKubernetesClientIsNotThrottledAndSpeaksProtobufUncompressed(t *testing.T) {
	rc := kubeRESTConfig(Options{Kube: &rest.Config{Host: "https://127.0.0.1:1"}, KubeQPS: 2000, KubeBurst: 4000, Build: Build{Version: "v1"}}, zap.NewNop())
	require.Equal(t, float32(2000), rc.QPS)
	require.Equal(t, 4000, rc.Burst)
	require.Equal(t, "application/vnd.kubernetes.protobuf", rc.ContentType)
	require.Equal(t, "tokenbroker/v1", rc.UserAgent)
	require.True(t, rc.DisableCompression, "no gzip of lease watch events between the API server and the broker")
}

func TestRunRefusesOptionsThatCannotWorkBeforeItStartsAnything(t *testing.T) {
	err := Run(context.Background(), Options{KubeQPS: 1, KubeBurst: 1, GCInterval: time.Minute, Credentials: []string{"password"}})
	for _, want := range []string{"--policy-file is required", "--tls-cert-file is required", `unknown or unsupported credential kind "password"`, "--audit-log", "--max-body-bytes"} {
		require.ErrorContains(t, err, want)
	}
}
