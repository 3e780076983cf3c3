package gateway

import (
	"crypto/tls"
	"crypto/x509"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/broker/audit"
)

// BenchmarkForward is the gateway's own cost per forwarded request beside
// a bare proxy's, as the bench's "CPU per forwarded GET" row measures it
// across processes, without the noise of two cores shared with an API
// server: one GET of a ConfigMap forwarded to the same upstream over the
// same transport by
//   - plain: an httputil.ReverseProxy that sets the token, with its own
//     buffers;
//   - bare: the same with the gateway's pooled buffers, as
//     test/cmd/bareproxy forwards;
//   - gateway: the gateway, on a connection AdmitConn admitted (the lease
//     read from its certificate then, the caps, the deny list, the
//     lease's liveness, the header rewrite, the audit event written to a
//     file as the broker writes it to stdout, and the metrics).
//
// Their ns/op and allocs/op, from one run, give the gateway's ratio to
// the bare proxy; the handshake and the client's side are left out of
// all three.
func BenchmarkForward(b *testing.B) {
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"c","namespace":"argo"},"data":{"k":"v"}}`)
	}))
	b.Cleanup(upstream.Close)
	u, err := url.Parse(upstream.URL)
	require.NoError(b, err)
	transport := &http.Transport{MaxIdleConnsPerHost: 16}
	b.Cleanup(transport.CloseIdleConnections)
	// The audit log as the broker writes it: one JSON line a request,
	// one write to a file.
	sink, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	require.NoError(b, err)
	b.Cleanup(func() { _ = sink.Close() })
	metrics, err := NewMetrics(prometheus.NewRegistry())
	require.NoError(b, err)
	f := newFixture(b, u, transport, func(c *Config) {
		c.Auditor, c.Metrics = audit.NewLog(sink), metrics
	})
	leaf, _ := f.cert(b, leaseA, time.Hour)
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	// The state a TLS 1.3 handshake verified: the leaf and its CA.
	st := &tls.ConnectionState{HandshakeComplete: true, Version: tls.VersionTLS13,
		PeerCertificates: []*x509.Certificate{leaf}, VerifiedChains: [][]*x509.Certificate{{leaf, f.ca.Certificate()}}}
	// Admitted as the broker's listener admits a connection once its
	// handshake is done.
	release, reason, _ := f.gw.AdmitConn(*st, newCloser())
	require.Empty(b, reason)
	b.Cleanup(release)

	plain := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(u)
			pr.Out.URL.Path, pr.Out.URL.RawPath = pr.In.URL.Path, pr.In.URL.RawPath
			pr.Out.Host = u.Host
			pr.Out.Header.Set("Authorization", "Bearer upstream-token")
		},
		Transport: transport,
		ErrorLog:  log.New(io.Discard, "", 0),
	}
	bare := *plain
	bare.BufferPool = CopyBuffers()
	for _, h := range []struct {
		name    string
		handler http.Handler
	}{{"plain", plain}, {"bare", &bare}, {"gateway", f.gw}} {
		b.Run(h.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				r := httptest.NewRequest(http.MethodGet, "https://gateway.example/api/v1/namespaces/argo/configmaps/c", nil)
				r.Header.Set("User-Agent", "kubectl/v1.37.2 (linux/amd64) kubernetes/abcdef0")
				r.Header.Set("Accept", "application/json, */*")
				r.TLS = st
				w := httptest.NewRecorder()
				h.handler.ServeHTTP(w, r)
				if w.Code != http.StatusOK {
					b.Fatalf("status %d: %s", w.Code, w.Body)
				}
			}
		})
	}
}
