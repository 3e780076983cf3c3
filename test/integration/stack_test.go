package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/issuers/tokenrequest"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const trustDomain = "it.tokenbroker.test"

// stack is a broker and its HTTP server running in this process against a
// real kube-apiserver, reached over real mutual TLS.
type stack struct {
	cluster *testcluster.Cluster
	broker  *broker.Broker
	url     string
	ca      *pki.CA
	dir     string
	logs    *observer.ObservedLogs
}

func startStack(t *testing.T, c *testcluster.Cluster, policy string) *stack {
	t.Helper()
	dir := t.TempDir()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "integration CA"})
	require.NoError(t, err)
	srvPair, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	require.NoError(t, srvPair.WriteFiles(filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key")))

	caFile := filepath.Join(dir, "cluster-ca.crt")
	require.NoError(t, os.WriteFile(caFile, c.CAData, 0o644))
	policyFile := filepath.Join(dir, "policy.yaml")
	doc := fmt.Sprintf("cluster: {name: east, server: %q, caFile: %q}\n%s", c.URL, caFile, policy)
	require.NoError(t, os.WriteFile(policyFile, []byte(doc), 0o644))
	p, err := broker.LoadPolicyFile(policyFile)
	require.NoError(t, err)

	core, logs := observer.New(zap.DebugLevel)
	b, err := broker.New(broker.Config{
		Secrets: c.Client.CoreV1(),
		Issuers: map[string]broker.Issuer{apiv1.CredentialToken: tokenrequest.New(c.Client.CoreV1())},
		Policy:  broker.NewPolicyStore(p),
		Logger:  zap.New(core),
		// Readiness asks the API server's /readyz, as "tokenbroker serve" does.
		APIServerReady: broker.APIServerReadyz(c.Client.Discovery().RESTClient()),
	})
	require.NoError(t, err)
	certs, err := pki.NewCertReloader(filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key"))
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	opsLn, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv, err := server.New(server.Config{
		Listener:    ln,
		OpsListener: opsLn,
		TLSConfig:   pki.ServerTLSConfig(certs, ca.CertPool()),
		Logger:      zap.New(core),
		Broker:      b,
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	<-srv.Listening()
	return &stack{cluster: c, broker: b, url: "https://" + ln.Addr().String(), ca: ca, dir: dir, logs: logs}
}

// client returns an HTTP client presenting a certificate for the cluster
// identity name, with the production TLS client profile.
func (s *stack) client(t *testing.T, name string) *http.Client {
	t.Helper()
	id, err := pki.ClusterIdentity(trustDomain, name)
	require.NoError(t, err)
	kp, err := s.ca.IssueClient(pki.ClientOptions{Identity: id})
	require.NoError(t, err)
	certFile, keyFile := filepath.Join(s.dir, name+".crt"), filepath.Join(s.dir, name+".key")
	require.NoError(t, kp.WriteFiles(certFile, keyFile))
	r, err := pki.NewCertReloader(certFile, keyFile)
	require.NoError(t, err)
	return &http.Client{
		Timeout:   30 * time.Second,
		Transport: &http.Transport{TLSClientConfig: pki.ClientTLSConfig(s.ca.CertPool(), r)},
	}
}

// do sends a JSON request and decodes the answer into out (if not nil). It
// returns the status and the raw body.
func do(t *testing.T, c *http.Client, method, url string, in, out any) (int, []byte) {
	t.Helper()
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		require.NoError(t, err)
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, body)
	require.NoError(t, err)
	if in != nil {
		req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
	}
	resp, err := c.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	if out != nil && resp.StatusCode < 300 {
		require.NoError(t, json.Unmarshal(raw, out), string(raw))
	}
	return resp.StatusCode, raw
}

func zapNop() *zap.Logger { return zap.NewNop() }

func jsonBody(t *testing.T, v any) io.Reader {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return bytes.NewReader(b)
}
