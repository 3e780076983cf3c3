package integration

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
)

func TestAnUnavailableAPIServerIsA503AndLeavesNothingBehind(t *testing.T) {
	s, west := setUp(t)
	issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	before := len(leaseSecrets(t, s.cluster.Client))

	require.NoError(t, s.cluster.StopAPIServer())
	req, err := http.NewRequest(http.MethodPost, s.url+"/v1/kubeconfigs", jsonBody(t, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"}))
	require.NoError(t, err)
	req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
	resp, err := west.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Equal(t, apiv1.MediaTypeProblem, resp.Header.Get("Content-Type"))
	require.NotEmpty(t, resp.Header.Get("Retry-After"))
	var p apiv1.Problem
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&p))
	require.Equal(t, http.StatusServiceUnavailable, p.Status)
	require.Error(t, s.broker.Ready(context.Background()), "not ready while the API server is down")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, s.cluster.StartAPIServer(ctx))
	require.NoError(t, s.broker.Ready(ctx))
	// Recovered without a restart, and the failed request left no lease.
	require.Len(t, leaseSecrets(t, s.cluster.Client), before)
	issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
}

func TestARevocationDuringAnOutageIsA503AndTheLeaseIsGoneWhenTheAPIServerIsBack(t *testing.T) {
	s, west := setUp(t)
	lease := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	require.Len(t, leaseSecrets(t, s.cluster.Client), 1)

	require.NoError(t, s.cluster.StopAPIServer())
	req, err := http.NewRequest(http.MethodDelete, s.url+"/v1/leases/"+lease.LeaseID, nil)
	require.NoError(t, err)
	resp, err := west.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode, "the DELETE claims nothing")
	require.NotEmpty(t, resp.Header.Get("Retry-After"))
	require.Equal(t, 1, s.broker.PendingDeletions(), "the revocation is queued")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	require.NoError(t, s.cluster.StartAPIServer(ctx))
	back := time.Now()
	// Nobody retries the DELETE: the broker does.
	require.Eventually(t, func() bool {
		l, err := s.cluster.Client.CoreV1().Secrets("argo").List(ctx, metav1.ListOptions{LabelSelector: objects.LabelLeaseID + "=" + lease.LeaseID})
		return err == nil && len(l.Items) == 0
	}, time.Minute, 20*time.Millisecond, "the revoked lease must be deleted once the API server is back")
	t.Logf("API server ready %s after its start; lease gone %s after it was ready", back.Sub(start).Round(time.Millisecond), time.Since(back).Round(time.Millisecond))
	require.Eventually(t, func() bool { return s.broker.PendingDeletions() == 0 }, 10*time.Second, 20*time.Millisecond)
	require.Equal(t, http.StatusNotFound, statusOf(t, west, http.MethodDelete, s.url+"/v1/leases/"+lease.LeaseID))
	require.NotEmpty(t, s.logs.FilterMessage("revocation failed: API server unavailable; retrying in the background").All())
}

func statusOf(t *testing.T, c *http.Client, method, url string) int {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	require.NoError(t, err)
	resp, err := c.Do(req)
	require.NoError(t, err)
	_ = resp.Body.Close()
	return resp.StatusCode
}

func TestIdleAndSlowlorisConnectionsDoNotStopIssuanceForAWellBehavedPeer(t *testing.T) {
	s, west := setUp(t)
	issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	addr := strings.TrimPrefix(s.url, "https://")
	dial := func(src string) net.Conn {
		d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		conn, err := d.Dial("tcp", addr)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	refused := func(reason string) float64 {
		return counter(t, s.reg, "tokenbroker_connections_refused_total", map[string]string{"listener": "api", "reason": reason})
	}

	// Idle connections from one address, 72 over its cap of connections
	// in their TLS handshake (an idle one never leaves it).
	const idle = server.DefaultMaxHandshakesPerIP + 72
	for range idle {
		dial("127.0.0.2")
	}
	require.Eventually(t, func() bool { return refused("per_ip_handshakes") == idle-server.DefaultMaxHandshakesPerIP },
		10*time.Second, 10*time.Millisecond)

	// Connections of another peer, each with half a request, 8 over its
	// cap.
	kp, err := s.ca.IssueClient(pki.ClientOptions{Identity: identity(t, "north")})
	require.NoError(t, err)
	north, err := kp.TLSCertificate()
	require.NoError(t, err)
	const slow = server.DefaultMaxConnsPerIdentity + 8
	for range slow {
		c := tls.Client(dial("127.0.0.3"), &tls.Config{
			MinVersion: tls.VersionTLS13, RootCAs: s.ca.CertPool(), ServerName: "127.0.0.1",
			GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &north, nil },
		})
		require.NoError(t, c.Handshake())
		_, _ = io.WriteString(c, "POST /v1/kubeconfigs HTTP/1.1\r\nHost: broker\r\nContent-Le")
	}
	require.Eventually(t, func() bool { return refused("per_identity") == slow-server.DefaultMaxConnsPerIdentity },
		10*time.Second, 10*time.Millisecond)

	// Meanwhile the well-behaved peer gets kubeconfigs, on new connections
	// too, as fast as ever.
	for range 5 {
		west.CloseIdleConnections()
		start := time.Now()
		issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
		t.Logf("issued in %s with %g connections open", time.Since(start).Round(time.Millisecond),
			counterOrGauge(t, s.reg, "tokenbroker_connections_open", map[string]string{"listener": "api"}))
	}
}
