package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/tokenbroker/tokenbroker/broker"
)

// serveConfigOf parses args like "tokenbroker serve" would, without running.
func serveConfigOf(t *testing.T, args ...string) (serveConfig, error) {
	t.Helper()
	var got serveConfig
	var gotErr error
	cmd := newServeCommand()
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		v, err := newViper(cmd)
		if err != nil {
			gotErr = err
			return nil
		}
		got, gotErr = serveConfigFrom(v)
		return nil
	}
	cmd.SetArgs(args)
	cmd.SetOut(new(strings.Builder))
	cmd.SetErr(new(strings.Builder))
	require.NoError(t, cmd.Execute())
	return got, gotErr
}

var required = []string{"--tls-cert-file", "c", "--tls-key-file", "k", "--client-ca-file", "ca", "--policy-file", "p"}

func TestServeDefaultsSuitABroker(t *testing.T) {
	cfg, err := serveConfigOf(t, required...)
	require.NoError(t, err)
	require.Equal(t, ":8443", cfg.ListenAddress)
	require.Equal(t, ":9090", cfg.OpsAddress)
	// Far above client-go's 5 QPS / burst 10, which would cap issuance.
	require.Equal(t, float32(2000), cfg.KubeQPS)
	require.Equal(t, 4000, cfg.KubeBurst)
	require.Equal(t, time.Minute, cfg.GCInterval)
	require.Equal(t, []string{"token"}, cfg.Credentials)
	require.Equal(t, "json", cfg.Log.Format)

	rc, err := kubeRESTConfig(writeKubeconfig(t), cfg.KubeQPS, cfg.KubeBurst)
	require.NoError(t, err)
	require.Equal(t, float32(2000), rc.QPS)
	require.Equal(t, 4000, rc.Burst)
}

func TestServeReportsEveryMissingFlag(t *testing.T) {
	_, err := serveConfigOf(t)
	require.Error(t, err)
	for _, f := range []string{"--tls-cert-file", "--tls-key-file", "--client-ca-file", "--policy-file"} {
		require.Contains(t, err.Error(), f)
	}
}

func TestFlagsBeatEnvironmentWhichBeatsTheConfigFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "serve.yaml")
	require.NoError(t, os.WriteFile(file, []byte("kube-qps: 50\nkube-burst: 60\nops-address: 127.0.0.1:1\n"), 0o600))
	t.Setenv("TOKENBROKER_KUBE_BURST", "70")
	t.Setenv("TOKENBROKER_OPS_ADDRESS", "127.0.0.1:2")
	cfg, err := serveConfigOf(t, append(required, "--config", file, "--ops-address", "127.0.0.1:3")...)
	require.NoError(t, err)
	require.Equal(t, float32(50), cfg.KubeQPS, "from the file")
	require.Equal(t, 70, cfg.KubeBurst, "environment over file")
	require.Equal(t, "127.0.0.1:3", cfg.OpsAddress, "flag over environment")
}

func TestAConfigFileWithAnUnknownKeyIsRejected(t *testing.T) {
	file := filepath.Join(t.TempDir(), "serve.yaml")
	require.NoError(t, os.WriteFile(file, []byte("kube-qsp: 50\n"), 0o600))
	_, err := serveConfigOf(t, append(required, "--config", file)...)
	require.ErrorContains(t, err, `unknown key "kube-qsp"`)
}

func TestBadValuesAreRefused(t *testing.T) {
	for _, args := range [][]string{{"--kube-qps", "0"}, {"--gc-interval", "1ms"}, {"--max-body-bytes", "-1"}} {
		_, err := serveConfigOf(t, append(required, args...)...)
		require.Error(t, err, args)
	}
}

func writeKubeconfig(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(p, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600))
	return p
}

func TestServeCertificateFlags(t *testing.T) {
	t.Setenv("POD_NAMESPACE", "")
	cfg, err := serveConfigOf(t, required...)
	require.NoError(t, err)
	require.Empty(t, cfg.EnrollAddress, "enrollment is off unless asked for")
	require.Empty(t, cfg.CACertFile)
	require.Equal(t, 24*time.Hour, cfg.ClientCertTTL)
	require.Equal(t, "tokenbroker", cfg.Namespace)

	cfg, err = serveConfigOf(t, append(required, "--ca-cert-file", "ca.crt", "--ca-key-file", "ca.key",
		"--enroll-address", ":8444", "--client-cert-ttl", "2h")...)
	require.NoError(t, err)
	require.Equal(t, ":8444", cfg.EnrollAddress)
	require.Equal(t, 2*time.Hour, cfg.ClientCertTTL)
}

func TestTheNamespaceComesFromTheFlagThenThePod(t *testing.T) {
	t.Setenv("POD_NAMESPACE", "from-pod")
	cfg, err := serveConfigOf(t, required...)
	require.NoError(t, err)
	require.Equal(t, "from-pod", cfg.Namespace)
	cfg, err = serveConfigOf(t, append(required, "--namespace", "from-flag")...)
	require.NoError(t, err)
	require.Equal(t, "from-flag", cfg.Namespace)
}

func TestBadCertificateFlagsAreRefused(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--enroll-address", ":8444"}, "--enroll-address needs --ca-cert-file"},
		{[]string{"--ca-cert-file", "ca.crt"}, "go together"},
		{[]string{"--ca-key-file", "ca.key"}, "go together"},
		{[]string{"--client-cert-ttl", "1m"}, "--client-cert-ttl"},
		{[]string{"--client-cert-ttl", "1000h"}, "--client-cert-ttl"},
		{[]string{"--namespace", "Not_A_Namespace"}, "--namespace"},
	} {
		_, err := serveConfigOf(t, append(required, tc.args...)...)
		require.ErrorContains(t, err, tc.want, tc.args)
	}
}

func TestTheAuditLogGoesToStdoutByDefaultAndCannotBeTurnedOff(t *testing.T) {
	cfg, err := serveConfigOf(t, required...)
	require.NoError(t, err)
	require.Equal(t, "stdout", cfg.AuditLog)
	_, err = serveConfigOf(t, append([]string{"--audit-log", ""}, required...)...)
	require.ErrorContains(t, err, "--audit-log")
}

func TestAnAuditLogFileIsAppendedToAndPrivate(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	require.NoError(t, os.WriteFile(path, []byte("{\"earlier\":true}\n"), 0o600))
	a, closeFn, err := openAuditLog(path, zap.NewNop())
	require.NoError(t, err)
	require.NoError(t, a.Audit(broker.AuditEvent{Audit: broker.AuditSchema, Action: broker.ActionIssue, Decision: broker.DecisionAllow}))
	closeFn()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	require.Len(t, lines, 2, "the earlier content is kept")
	require.Contains(t, lines[1], `"action":"issue"`)

	fresh := filepath.Join(t.TempDir(), "new.jsonl")
	_, closeFn, err = openAuditLog(fresh, zap.NewNop())
	require.NoError(t, err)
	closeFn()
	st, err := os.Stat(fresh)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())

	_, _, err = openAuditLog(filepath.Join(t.TempDir(), "missing", "audit.jsonl"), zap.NewNop())
	require.ErrorContains(t, err, "--audit-log")
}

func TestAnUnknownCredentialKindIsRefusedBeforeStart(t *testing.T) {
	_, err := serveConfigOf(t, append([]string{"--credentials", "token,clientCertificate"}, required...)...)
	require.ErrorContains(t, err, `unknown or unsupported credential kind "clientCertificate"`)
}

func TestTheAuditLogFileIsReopenedOnSIGHUPForLogrotate(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "audit.jsonl")
	core, logs := observer.New(zap.InfoLevel)
	a, closeFn, err := openAuditLog(path, zap.New(core))
	require.NoError(t, err)
	defer closeFn()
	event := func(id string) {
		require.NoError(t, a.Audit(broker.AuditEvent{Audit: broker.AuditSchema, Action: broker.ActionIssue, RequestID: id}))
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
