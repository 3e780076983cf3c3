package gateway

import (
	"context"
	"crypto/tls"
	"errors"
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
	"k8s.io/apimachinery/pkg/types"

	"github.com/tokenbroker/tokenbroker/pki"
)

// The fake counter's memory is never blind; blindLeases is one that is.
func (f *fakeLeases) Blind(string, time.Time) bool { return false }
func (f *fakeLeases) Recheck(context.Context, string, string, types.UID, string, time.Time) (time.Time, bool, error) {
	return time.Time{}, false, errors.New("fakeLeases: not blind, asked nothing")
}

// blindLeases is a counter blind to every namespace, whose memory (the
// embedded fakeLeases) may be stale, with the API server's answers in
// server.
type blindLeases struct {
	*fakeLeases
	mu     sync.Mutex
	server map[string]time.Time // live leases by leaseKey/peer
	err    error                // the API server's answer to every recheck
	asked  int
	// gate, if set, holds every recheck until it is closed.
	gate chan struct{}
}

func (b *blindLeases) Blind(string, time.Time) bool { return true }

func (b *blindLeases) Recheck(ctx context.Context, namespace, name string, uid types.UID, identity string, now time.Time) (time.Time, bool, error) {
	b.mu.Lock()
	b.asked++
	gate := b.gate
	b.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return time.Time{}, false, ctx.Err()
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err != nil {
		return time.Time{}, false, b.err
	}
	exp, ok := b.server[leaseKey(namespace, name, uid)+"/"+identity]
	return exp, ok && now.Before(exp), nil
}

func (b *blindLeases) set(n pki.LeaseName, exp time.Time, err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.server = map[string]time.Time{}
	if !exp.IsZero() {
		b.server[leaseKey(n.Namespace, secretName(n), types.UID(n.UID))+"/"+n.Peer] = exp
	}
	b.err = err
}

func (b *blindLeases) questions() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.asked
}

// get asks the gateway for /api and returns the status, Retry-After and
// body.
func get(t *testing.T, client *http.Client, gw string) (int, string, string) {
	t.Helper()
	resp, err := client.Get(gw + "/api")
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, resp.Header.Get("Retry-After"), string(body)
}

// A replica blind to the leases answers from the API server, not from its
// memory: a lease its memory still holds but the API server no longer
// has is refused, and when the API server cannot be asked the request is
// refused as unavailable, never forwarded.
func TestABlindGatewayAsksTheAPIServerAndRefusesWhenItCannot(t *testing.T) {
	rec := &upstreamRecorder{}
	up := httptest.NewTLSServer(rec)
	t.Cleanup(up.Close)
	u, _ := url.Parse(up.URL)
	bl := &blindLeases{fakeLeases: &fakeLeases{live: map[string]time.Time{}}}
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	require.NoError(t, err)
	f := newFixture(t, u, up.Client().Transport, func(c *Config) { c.Leases, c.Metrics = bl, m })
	gw := serveGateway(t, f)
	_, pair := f.cert(t, leaseA, time.Hour)
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: f.ca.CertPool(), Certificates: []tls.Certificate{pair}}}}
	exp := f.clock.Now().Add(time.Hour)
	bl.add(leaseA, exp) // the stale memory holds it throughout

	bl.set(leaseA, exp, nil)
	code, _, _ := get(t, client, gw.URL)
	require.Equal(t, http.StatusOK, code, "the API server has the lease")
	require.Equal(t, 1, bl.questions())
	code, _, _ = get(t, client, gw.URL)
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, 1, bl.questions(), "an answer is reused for a second")

	bl.set(leaseA, time.Time{}, nil) // deleted while the replica was blind
	f.clock.Step(time.Second)
	code, _, body := get(t, client, gw.URL)
	require.Equal(t, http.StatusUnauthorized, code, "the memory still holds it; the API server does not")
	require.Contains(t, body, "revoked or expired")
	require.Equal(t, 2, bl.questions())
	code, _, _ = get(t, client, gw.URL)
	require.Equal(t, http.StatusUnauthorized, code)
	require.Equal(t, 2, bl.questions(), "a lease found gone is refused from memory, not asked about again")

	f.clock.Step(newLeaseAge + newLeaseWait) // past that memory
	bl.set(leaseA, exp, errors.New("dial tcp: connection refused"))
	code, retry, body := get(t, client, gw.URL)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "1", retry)
	require.Contains(t, body, `"reason":"ServiceUnavailable"`)
	require.Contains(t, body, "cannot confirm this lease")
	require.Equal(t, 3, bl.questions(), "a failure is not reused")

	other := leaseA
	other.Peer = "spiffe://oc.example/cluster/east"
	bl.set(other, exp, nil) // the Secret was issued to east
	code, _, _ = get(t, client, gw.URL)
	require.Equal(t, http.StatusUnauthorized, code, "a certificate of another peer than the Secret's")

	rec.mu.Lock()
	forwarded := len(rec.got)
	rec.mu.Unlock()
	require.Equal(t, 2, forwarded, "only the two requests of a lease the API server confirmed were forwarded")
	require.NoError(t, testutil.CollectAndCompare(m.rechecks, strings.NewReader(`
# HELP tokenbroker_gateway_lease_rechecks_total Leases the gateway asked the API server about because the lease counter was blind to their namespace (its watch broken), by outcome: live, gone, error (no answer: the request was refused 503).
# TYPE tokenbroker_gateway_lease_rechecks_total counter
tokenbroker_gateway_lease_rechecks_total{outcome="error"} 1
tokenbroker_gateway_lease_rechecks_total{outcome="gone"} 2
tokenbroker_gateway_lease_rechecks_total{outcome="live"} 1
`)))
}

// Requests of one lease that arrive together while the counter is blind
// ask the API server once.
func TestConcurrentRequestsOfABlindReplicaShareOneRecheck(t *testing.T) {
	bl := &blindLeases{fakeLeases: &fakeLeases{live: map[string]time.Time{}}, gate: make(chan struct{})}
	f := newFixture(t, nil, nil, func(c *Config) { c.Leases = bl })
	bl.set(leaseA, f.clock.Now().Add(time.Hour), nil)
	_, _ = f.cert(t, leaseA, time.Hour)
	const n = 20
	results := make(chan liveness, n)
	for range n {
		go func() { results <- f.gw.live(context.Background(), leaseA, f.clock.Now()) }()
	}
	require.Eventually(t, func() bool { return bl.questions() == 1 }, 5*time.Second, time.Millisecond)
	close(bl.gate)
	for range n {
		require.Equal(t, leaseLive, <-results)
	}
	require.Equal(t, 1, bl.questions())
}

// The answers kept are bounded: past maxRechecks a lease is asked again
// at each request, and nothing grows.
func TestTheKeptRecheckAnswersAreBounded(t *testing.T) {
	bl := &blindLeases{fakeLeases: &fakeLeases{live: map[string]time.Time{}}, server: map[string]time.Time{}}
	f := newFixture(t, nil, nil, func(c *Config) { c.Leases = bl })
	exp := f.clock.Now().Add(time.Hour)
	var names []pki.LeaseName
	for i := range maxRechecks + 10 {
		n := leaseA
		n.ID = fmt.Sprintf("c%025d", i)
		names = append(names, n)
		bl.server[leaseKey(n.Namespace, secretName(n), types.UID(n.UID))+"/"+n.Peer] = exp
	}
	for _, n := range names {
		require.Equal(t, leaseLive, f.gw.live(context.Background(), n, f.clock.Now()))
	}
	require.LessOrEqual(t, len(f.gw.rechecks.m), maxRechecks)
	f.clock.Step(recheckFor) // every answer is stale: the next ones make room
	for _, n := range names[:10] {
		require.Equal(t, leaseLive, f.gw.live(context.Background(), n, f.clock.Now()))
	}
	require.LessOrEqual(t, len(f.gw.rechecks.m), 10, "the stale answers were dropped")
}
