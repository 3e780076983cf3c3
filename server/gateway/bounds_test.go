package gateway

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/pki"
)

// holdingUpstream answers every request once release is closed; a watch
// (watch=true) is answered at once with one event and held open until
// its client goes.
type holdingUpstream struct {
	release chan struct{}
	mu      sync.Mutex
	ids     []string // Audit-Id of every request, in order
}

func (u *holdingUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.ids = append(u.ids, r.Header.Get("Audit-Id"))
	u.mu.Unlock()
	if r.URL.Query().Get("watch") == "true" {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"type":"ADDED","object":{"kind":"ConfigMap"}}`+"\n")
		http.NewResponseController(w).Flush()
		<-r.Context().Done()
		return
	}
	select {
	case <-u.release:
	case <-r.Context().Done():
		return
	}
	_, _ = io.WriteString(w, `{"kind":"Status"}`)
}

func (f *fixture) client(t *testing.T, n pki.LeaseName) *http.Client {
	t.Helper()
	_, pair := f.cert(t, n, time.Hour)
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{ForceAttemptHTTP2: true,
		TLSClientConfig: &tls.Config{RootCAs: f.ca.CertPool(), Certificates: []tls.Certificate{pair}}}}
}

func TestRequestsAreCappedPerLeaseAndPerPeerAsTheAPIServerAnswersOverload(t *testing.T) {
	up := &holdingUpstream{release: make(chan struct{})}
	srv := httptest.NewTLSServer(up)
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	f := newFixture(t, u, srv.Client().Transport, func(c *Config) { c.MaxRequestsPerLease, c.MaxRequestsPerPeer = 2, 3 })
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	f.leases.add(leaseB, f.clock.Now().Add(time.Hour))
	gw := serveGateway(t, f)
	a, b := f.client(t, leaseA), f.client(t, leaseB)

	var wg sync.WaitGroup
	held := func(c *http.Client) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := c.Get(gw.URL + "/api")
			if err == nil {
				resp.Body.Close()
			}
		}()
	}
	inFlight := func(n pki.LeaseName) int { return f.gw.InFlight(n.Namespace, secretName(n), types.UID(n.UID)) }
	refused := func(c *http.Client, want string) {
		t.Helper()
		resp, err := c.Get(gw.URL + "/api")
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
		require.Equal(t, "1", resp.Header.Get("Retry-After"))
		var st metav1.Status
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&st))
		require.Equal(t, metav1.StatusReasonTooManyRequests, st.Reason)
		require.Contains(t, st.Message, want)
	}

	held(a)
	held(a)
	require.Eventually(t, func() bool { return inFlight(leaseA) == 2 }, 5*time.Second, time.Millisecond)
	refused(a, "lease")
	held(b)
	require.Eventually(t, func() bool { return inFlight(leaseB) == 1 }, 5*time.Second, time.Millisecond)
	refused(b, "peer")

	close(up.release)
	wg.Wait()
	require.Eventually(t, func() bool { return inFlight(leaseA) == 0 && inFlight(leaseB) == 0 }, 5*time.Second, time.Millisecond)
	resp, err := a.Get(gw.URL + "/api")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "the places are given back")
	var over []string
	for _, e := range f.audit.all() {
		if e.Status == http.StatusTooManyRequests {
			over = append(over, e.Reason)
		}
	}
	require.Equal(t, []string{"too_many_requests_per_lease", "too_many_requests_per_peer"}, over)
}

// A watch is on the record from its forwarding, with the id the API
// server's audit log has, and again when it ends, however it ends; the
// in-flight gauge and the duration histogram count it.
func TestAWatchIsOnTheRecordWhileItRunsAndWhenItEnds(t *testing.T) {
	up := &holdingUpstream{release: make(chan struct{})}
	srv := httptest.NewTLSServer(up)
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL)
	m, err := NewMetrics(prometheus.NewRegistry())
	require.NoError(t, err)
	f := newFixture(t, u, srv.Client().Transport, func(c *Config) { c.Metrics = m })
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	gw := serveGateway(t, f)

	events := func(action string) []audit.Event {
		var out []audit.Event
		for _, e := range f.audit.all() {
			if e.Action == action {
				out = append(out, e)
			}
		}
		return out
	}
	watch := func(c *http.Client) (context.CancelFunc, *http.Response) {
		t.Helper()
		ctx, cancel := context.WithCancel(context.Background())
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, gw.URL+"/api/v1/namespaces/argo/configmaps?watch=true", nil)
		require.NoError(t, err)
		resp, err := c.Do(req)
		require.NoError(t, err)
		line, err := bufio.NewReader(resp.Body).ReadString('\n')
		require.NoError(t, err)
		require.Contains(t, line, "ADDED")
		return cancel, resp
	}

	// Ended by its client.
	cancel, _ := watch(f.client(t, leaseA))
	fwd := events(audit.ActionGatewayForward)
	require.Len(t, fwd, 1, "on the record while it runs")
	require.Empty(t, events(audit.ActionGatewayRequest))
	up.mu.Lock()
	require.Equal(t, up.ids[0], fwd[0].APIAuditID, "the id the API server's audit log records")
	up.mu.Unlock()
	require.Equal(t, leaseA.ID, fwd[0].LeaseID)
	require.Equal(t, 1.0, testutil.ToFloat64(m.inFlight))
	cancel()
	require.Eventually(t, func() bool { return len(events(audit.ActionGatewayRequest)) == 1 }, 5*time.Second, time.Millisecond)
	end := events(audit.ActionGatewayRequest)[0]
	require.Equal(t, fwd[0].APIAuditID, end.APIAuditID)
	require.Equal(t, "client_gone", end.Reason)
	require.Equal(t, http.StatusOK, end.Status)
	require.Eventually(t, func() bool { return testutil.ToFloat64(m.inFlight) == 0 }, 5*time.Second, time.Millisecond)
	require.Equal(t, 1, testutil.CollectAndCount(m.duration))

	// Ended by the revocation.
	_, resp := watch(f.client(t, leaseA))
	defer resp.Body.Close()
	f.gw.Gone(leaseA.Namespace, secretName(leaseA), types.UID(leaseA.UID))
	require.Eventually(t, func() bool { return len(events(audit.ActionGatewayRequest)) == 2 }, 5*time.Second, time.Millisecond)
	require.Equal(t, reasonRevoked, events(audit.ActionGatewayRequest)[1].Reason)
	require.Len(t, events(audit.ActionGatewayForward), 2)
	require.Eventually(t, func() bool { return testutil.ToFloat64(m.inFlight) == 0 }, 5*time.Second, time.Millisecond)
	require.Equal(t, 2.0, testutil.ToFloat64(m.requests.WithLabelValues(leaseA.Peer, "2xx")), "both watches counted")
}

// recordingGateway serves a gateway in front of an upstreamRecorder, with
// leaseA live.
func recordingGateway(t *testing.T) (*upstreamRecorder, *fixture, *httptest.Server) {
	t.Helper()
	rec := &upstreamRecorder{}
	up := httptest.NewTLSServer(rec)
	t.Cleanup(up.Close)
	u, _ := url.Parse(up.URL)
	f := newFixture(t, u, up.Client().Transport, nil)
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	return rec, f, serveGateway(t, f)
}

// rawHTTP1 opens a lease's HTTP/1.1 connection to the gateway.
func rawHTTP1(t *testing.T, f *fixture, gw *httptest.Server, n pki.LeaseName) *tls.Conn {
	t.Helper()
	_, pair := f.cert(t, n, time.Hour)
	conn, err := tls.Dial("tcp", strings.TrimPrefix(gw.URL, "https://"), &tls.Config{RootCAs: f.ca.CertPool(), Certificates: []tls.Certificate{pair}, NextProtos: []string{"http/1.1"}})
	require.NoError(t, err)
	t.Cleanup(func() { conn.Close() })
	require.NoError(t, conn.SetDeadline(time.Now().Add(10*time.Second)))
	return conn
}

// RFC 9112, section 6.1: a request with both Content-Length and
// Transfer-Encoding may be a smuggling attempt; the connection must close
// after the answer, so that a second request hidden in the body is never
// read.
func TestARequestWithBothContentLengthAndTransferEncodingIsRefusedAndItsConnectionClosed(t *testing.T) {
	rec, f, gw := recordingGateway(t)
	conn := rawHTTP1(t, f, gw, leaseA)
	fmt.Fprint(conn, "POST /api/v1/namespaces/argo/configmaps HTTP/1.1\r\nHost: gw\r\nContent-Length: 44\r\nTransfer-Encoding: chunked\r\n\r\n"+
		"0\r\n\r\nGET /api/v1/secrets HTTP/1.1\r\nHost: gw\r\n\r\n")
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	require.True(t, resp.Close)
	_, err = http.ReadResponse(br, nil)
	require.Error(t, err, "no second answer: the connection closed")
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Empty(t, rec.got, "nothing reached the API server")
}

// A body the client breaks off is the client's error (400), not an
// upstream failure (502).
func TestABrokenOffBodyIsABadRequest(t *testing.T) {
	up := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
	}))
	t.Cleanup(up.Close)
	u, _ := url.Parse(up.URL)
	f := newFixture(t, u, up.Client().Transport, nil)
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	gw := serveGateway(t, f)
	conn := rawHTTP1(t, f, gw, leaseA)
	fmt.Fprint(conn, "POST /api/v1/namespaces/argo/configmaps HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"kind\":")
	require.NoError(t, conn.CloseWrite())
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
}

// Revoking the CA that signed a lease certificate (or an intermediate)
// stops it at the gateway as revoking its serial does: the deny list is
// checked against every verified chain.
func TestTheDenyListCoversEveryCertificateOfTheChain(t *testing.T) {
	f := newFixture(t, nil, nil, nil)
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	leaf, _ := f.cert(t, leaseA, time.Hour)
	st := tls.ConnectionState{PeerCertificates: []*x509.Certificate{leaf}, VerifiedChains: [][]*x509.Certificate{{leaf, f.ca.Certificate()}}}
	c := newCloser()
	release, reason, _ := f.gw.AdmitConn(st, c)
	require.Empty(t, reason)

	f.deny.mu.Lock()
	f.deny.revoked[serialOf(f.ca.Certificate())] = true
	f.deny.mu.Unlock()
	f.gw.SweepDenied()
	require.True(t, c.isClosed(t), "the open connection ends")
	release() // as the listener does at the close
	requireNoPlace(t, f, st, leaseA)
}

// requireNoPlace admits a connection of st and checks that it holds no
// place of n's and lives only refusedConnLinger, for its refusal.
func requireNoPlace(t *testing.T, f *fixture, st tls.ConnectionState, n pki.LeaseName) {
	t.Helper()
	c := newCloser()
	release, reason, _ := f.gw.AdmitConn(st, c)
	require.Empty(t, reason, "answered, so that the client learns why")
	defer release()
	require.Zero(t, f.gw.OpenConns(n.Namespace, secretName(n), types.UID(n.UID)), "no place under the lease's caps")
	select {
	case <-c.closed:
		t.Fatal("closed before its refusal could be answered")
	default:
	}
	f.clock.Step(refusedConnLinger)
	require.True(t, c.isClosed(t), "closed after the linger")
}

// A lease known gone gets no connection place, only the time to answer
// its first request's refusal; an older certificate whose lease the
// counter does not hold neither.
func TestARevokedLeaseGetsNoConnectionPlace(t *testing.T) {
	f := newFixture(t, nil, nil, nil)
	f.leases.add(leaseA, f.clock.Now().Add(time.Hour))
	release, reason := f.admit(t, leaseA, newCloser())
	require.Empty(t, reason)
	f.gw.Gone(leaseA.Namespace, secretName(leaseA), types.UID(leaseA.UID))
	f.leases.remove(leaseA)
	release() // as the listener does at the close
	leafA, _ := f.cert(t, leaseA, time.Hour)
	requireNoPlace(t, f, tls.ConnectionState{PeerCertificates: []*x509.Certificate{leafA}}, leaseA)

	leaf, _ := f.cert(t, leaseB, time.Hour) // young, not held yet: admitted
	c := newCloser()
	release, reason, _ = f.gw.AdmitConn(tls.ConnectionState{PeerCertificates: []*x509.Certificate{leaf}}, c)
	require.Empty(t, reason)
	require.Equal(t, 1, f.gw.OpenConns(leaseB.Namespace, secretName(leaseB), types.UID(leaseB.UID)))
	release()
	f.clock.Step(time.Minute) // old, never held
	requireNoPlace(t, f, tls.ConnectionState{PeerCertificates: []*x509.Certificate{leaf}}, leaseB)
}

// The API server may answer a GET without reading its body, which would
// then sit in the broker's receive buffers: a body on a GET, a HEAD or an
// upgrade is refused.
func TestABodyOnAGetIsRefused(t *testing.T) {
	rec, f, gw := recordingGateway(t)
	req, err := http.NewRequest(http.MethodGet, gw.URL+"/api/v1/namespaces/argo/configmaps?watch=1", strings.NewReader(strings.Repeat("x", 1<<20)))
	require.NoError(t, err)
	resp, err := f.client(t, leaseA).Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Empty(t, rec.got)
}

// A watch or a followed log is recognised as the API server recognises
// it, whatever true-ish value it is asked with, so that no stream runs off
// the record.
func TestLongRunningRequestsAreReadAsTheAPIServerReadsThem(t *testing.T) {
	for target, want := range map[string]bool{
		"/api/v1/namespaces/a/configmaps?watch=true":  true,
		"/api/v1/namespaces/a/configmaps?watch=1":     true,
		"/api/v1/namespaces/a/configmaps?watch=yes":   true,
		"/api/v1/namespaces/a/configmaps?watch=":      true,
		"/api/v1/namespaces/a/configmaps?watch=False": false,
		"/api/v1/namespaces/a/configmaps?watch=0":     false,
		"/api/v1/namespaces/a/configmaps":             false,
		"/api/v1/watch/namespaces/a/configmaps":       true,
		"/api/v1/namespaces/a/pods/p/log?follow=1":    true,
		"/api/v1/namespaces/a/pods/p/log":             false,
		"/api/v1/namespaces/a/services/s/proxy/x":     true,
	} {
		r := httptest.NewRequest(http.MethodGet, target, nil)
		require.Equal(t, want, longRunning(r), target)
	}
}
