package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

const getTestLease = "abcdefghijklmnopqrstuvwxyz"

// getTestBroker is a broker stand-in over mutual TLS that answers POST
// /v1/kubeconfigs, and an identity directory that it trusts.
func getTestBroker(t *testing.T) (url, identityDir string, requests func() []apiv1.KubeconfigRequest) {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{})
	require.NoError(t, err)
	server, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	serverCert, err := server.TLSCertificate()
	require.NoError(t, err)
	var mu sync.Mutex
	var got []apiv1.KubeconfigRequest
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req apiv1.KubeconfigRequest
		if r.URL.Path != "/v1/kubeconfigs" || json.NewDecoder(r.Body).Decode(&req) != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		mu.Lock()
		got = append(got, req)
		mu.Unlock()
		w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(apiv1.KubeconfigResponse{
			LeaseID: getTestLease,
			Kubeconfig: `apiVersion: v1
kind: Config
clusters: [{name: east, cluster: {server: "https://east.example.com:6443", certificate-authority-data: ` + "Zm9v" + `}}]
users: [{name: sa, user: {token: tok-SECRET}}]
contexts: [{name: c, context: {cluster: east, user: sa, namespace: ` + req.Namespace + `}}]
current-context: c
`,
			Token:      "tok-SECRET",
			ExpiresAt:  time.Now().Add(time.Hour).UTC().Truncate(time.Second),
			GrantedTTL: "1h0m0s",
			ClampedBy:  "grant.maxTTL",
		})
	}))
	srv.TLS = &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{serverCert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    ca.CertPool(),
	}
	srv.StartTLS()
	t.Cleanup(srv.Close)

	dir := t.TempDir()
	kp, err := ca.IssueClient(pki.ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	require.NoError(t, err)
	require.NoError(t, kp.WriteFiles(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ca.crt"), ca.BundlePEM(), 0o644))
	return srv.URL, dir, func() []apiv1.KubeconfigRequest {
		mu.Lock()
		defer mu.Unlock()
		return append([]apiv1.KubeconfigRequest(nil), got...)
	}
}

func runGet(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := newGetCommand()
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(append([]string{"kubeconfig"}, args...))
	err = cmd.ExecuteContext(context.Background())
	return out.String(), errOut.String(), err
}

func TestGetKubeconfigWritesTheKubeconfigToStdoutAndTheLeaseToStderr(t *testing.T) {
	url, dir, reqs := getTestBroker(t)
	out, errOut, err := runGet(t, "--broker", url, "--identity-dir", dir, "--namespace", "argo",
		"--service-account", "admiralty-source", "--ttl", "2h", "--min-ttl", "30m", "--audience", "a", "--audience", "b")
	require.NoError(t, err)
	require.Contains(t, out, "token: tok-SECRET")
	require.Contains(t, errOut, "lease "+getTestLease+" for argo/admiralty-source expires at")
	require.Contains(t, errOut, "clamped by grant.maxTTL")
	require.NotContains(t, errOut, "SECRET")
	require.Equal(t, []apiv1.KubeconfigRequest{{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h", MinTTL: "30m", Audiences: []string{"a", "b"}}}, reqs())
}

func TestGetKubeconfigWritesAFileWithMode0600(t *testing.T) {
	url, dir, _ := getTestBroker(t)
	file := filepath.Join(t.TempDir(), "east.kubeconfig")
	out, errOut, err := runGet(t, "--broker", url, "--identity-dir", dir, "--namespace", "argo",
		"--service-account", "sa", "-o", file)
	require.NoError(t, err)
	require.Empty(t, out)
	require.Contains(t, errOut, "written to "+file)
	st, err := os.Stat(file)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	data, err := os.ReadFile(file)
	require.NoError(t, err)
	require.Contains(t, string(data), "tok-SECRET")
}

func TestGetKubeconfigAsJSONIsTheBrokersAnswer(t *testing.T) {
	url, dir, _ := getTestBroker(t)
	t.Setenv("TOKENBROKER_IDENTITY_DIR", dir)
	out, _, err := runGet(t, "--broker", url, "--namespace", "argo", "--service-account", "sa", "--format", "json")
	require.NoError(t, err, "the identity directory comes from the environment")
	var resp apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(out), &resp))
	require.Equal(t, getTestLease, resp.LeaseID)
	require.Equal(t, "tok-SECRET", resp.Token)
	require.Equal(t, "1h0m0s", resp.GrantedTTL)
}

func TestGetKubeconfigReportsEveryProblemBeforeCallingTheBroker(t *testing.T) {
	_, _, err := runGet(t, "--format", "yaml", "--ttl", "soon")
	require.Error(t, err)
	for _, want := range []string{"--broker is required", "--identity-dir is required", "--namespace is required",
		"--service-account is required", `--format must be kubeconfig or json, not "yaml"`} {
		require.Contains(t, err.Error(), want)
	}
	_, _, err = runGet(t, "--broker", "https://b", "--identity-dir", "d", "--namespace", "argo", "--service-account", "sa", "--ttl", "soon")
	require.ErrorContains(t, err, "request.ttl: must be a duration")
}

func TestGetKubeconfigWithoutAnIdentityFails(t *testing.T) {
	_, _, err := runGet(t, "--broker", "https://127.0.0.1:1", "--identity-dir", filepath.Join(t.TempDir(), "none"),
		"--namespace", "argo", "--service-account", "sa")
	require.ErrorContains(t, err, "no identity stored")
}

func TestAgentNeedsAConfigFile(t *testing.T) {
	cmd := newAgentCommand()
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	cmd.SetArgs(nil)
	cmd.SetOut(new(strings.Builder))
	require.ErrorContains(t, cmd.Execute(), "--config is required")
}

func TestAgentReportsABadConfigFileWithItsFieldPaths(t *testing.T) {
	file := filepath.Join(t.TempDir(), "agent.yaml")
	require.NoError(t, os.WriteFile(file, []byte("identity: {dir: id}\ntargets: [{name: East}]\n"), 0o600))
	t.Setenv("TOKENBROKER_CONFIG", file)
	cmd := newAgentCommand()
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	cmd.SetArgs([]string{"--log-format", "console"})
	err := cmd.Execute()
	require.ErrorContains(t, err, file+": invalid agent config: targets[0].name: must be a DNS label")
	require.ErrorContains(t, err, "targets[0].broker: is required")
}

func TestAgentRunsUntilCancelledWithAFileOutput(t *testing.T) {
	url, dir, reqs := getTestBroker(t)
	out := t.TempDir()
	ops := freeAddr(t)
	file := filepath.Join(out, "agent.yaml")
	require.NoError(t, os.WriteFile(file, fmt.Appendf(nil, `
identity: {dir: %q}
targets:
  - name: east
    broker: %q
    request: {namespace: argo, serviceAccount: sa, ttl: 1h}
    outputs: [{file: {path: east.kubeconfig}}]
opsAddress: %q
`, dir, url, ops), 0o600))
	log, err := newLogger(logConfig{Level: "error", Format: "json"})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- runAgent(ctx, agentCommandConfig{ConfigFile: file}, log) }()
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://" + ops + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 10*time.Second, 20*time.Millisecond)
	data, err := os.ReadFile(filepath.Join(out, "east.kubeconfig"))
	require.NoError(t, err)
	require.Contains(t, string(data), "tok-SECRET")
	require.Len(t, reqs(), 1)
	cancel()
	require.NoError(t, <-done)
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().String()
}
