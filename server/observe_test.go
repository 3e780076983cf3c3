package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

func TestAccessLogHasOneLinePerRequestAndNoSecrets(t *testing.T) {
	t.Parallel()
	h := newHarness(t, nil)
	secretHeader := http.Header{"Authorization": {"Bearer " + testToken}, "Cookie": {"session=" + testToken}}
	// A bearer token on the API listener is a workload token: this broker
	// verifies none, so it is refused (401), and logged no more than the
	// cookie.
	cookieOnly := http.Header{"Cookie": {"session=" + testToken}}
	requests := []request{
		func() request { r := postKubeconfig(validBody); r.header = cookieOnly; return r }(),
		func() request { r := postKubeconfig(validBody); r.accept = "application/yaml"; return r }(),
		{method: http.MethodGet, path: "/v1/leases", header: secretHeader},
		{method: http.MethodGet, path: "/v1/leases/" + testLeaseID},
		{method: http.MethodDelete, path: "/v1/leases/" + testLeaseID},
		{method: http.MethodGet, path: "/v1/whoami"},
		{method: http.MethodGet, path: "/v1/nope"},
		{method: http.MethodGet, path: "/v1/whoami", noTLS: true},
	}
	var ids []string
	for _, rq := range requests {
		rec := h.do(rq)
		ids = append(ids, rec.Header().Get("X-Request-Id"))
	}

	access := h.logs.FilterMessage("request").All()
	require.Len(t, access, len(requests))
	wantKeys := []string{"bytes", "duration", "identity", "listener", "method", "remote", "request_id", "route", "status", "workload"}
	for i, e := range access {
		ctx := e.ContextMap()
		keys := make([]string, 0, len(ctx))
		for k := range ctx {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		require.Equal(t, wantKeys, keys, "line %d", i)
		require.Equal(t, ids[i], ctx["request_id"])
	}

	first := access[0].ContextMap()
	require.Equal(t, "api", first["listener"])
	require.Equal(t, "POST", first["method"])
	require.Equal(t, "/v1/kubeconfigs", first["route"])
	require.EqualValues(t, http.StatusCreated, first["status"])
	require.Equal(t, testIdentity, first["identity"])
	require.Positive(t, first["bytes"])
	require.EqualValues(t, http.StatusUnauthorized, access[2].ContextMap()["status"])
	require.Equal(t, "/v1/leases/{id}", access[3].ContextMap()["route"])
	require.Equal(t, "unmatched", access[6].ContextMap()["route"])
	require.Equal(t, "/v1/whoami", access[7].ContextMap()["route"])
	require.Empty(t, access[7].ContextMap()["identity"])

	// Neither the token nor the kubeconfig nor any header reaches any log
	// line, access log or otherwise.
	for _, e := range h.logs.All() {
		line := fmt.Sprintf("%s %v", e.Message, e.ContextMap())
		require.NotContains(t, line, testToken)
		require.NotContains(t, line, "Bearer")
		require.NotContains(t, line, "session=")
	}
}

func TestMetricsAreRecordedOnTheGivenRegistry(t *testing.T) {
	t.Parallel()
	h := newHarness(t, &fakeBroker{
		get: func(context.Context, broker.Caller, string) (*apiv1.Lease, error) {
			return nil, problem.Errorf(problem.KindNotFound, "lease not found")
		},
	})
	h.do(postKubeconfig(validBody))
	h.do(postKubeconfig(validBody))
	h.do(request{method: http.MethodGet, path: "/v1/leases/" + testLeaseID})
	h.do(request{method: http.MethodGet, path: "/v1/whoami", noTLS: true})
	h.do(request{method: http.MethodGet, path: "/wp-login.php"})
	h.do(request{method: "BREW", path: "/v1/whoami"})

	const want = `
# HELP tokenbroker_http_requests_total API requests answered, by listener, route pattern, method and status code.
# TYPE tokenbroker_http_requests_total counter
tokenbroker_http_requests_total{code="201",listener="api",method="POST",route="/v1/kubeconfigs"} 2
tokenbroker_http_requests_total{code="401",listener="api",method="GET",route="/v1/whoami"} 1
tokenbroker_http_requests_total{code="404",listener="api",method="GET",route="/v1/leases/{id}"} 1
tokenbroker_http_requests_total{code="404",listener="api",method="GET",route="unmatched"} 1
tokenbroker_http_requests_total{code="405",listener="api",method="OTHER",route="unmatched"} 1
`
	require.NoError(t, testutil.GatherAndCompare(h.reg, strings.NewReader(want), "tokenbroker_http_requests_total"))
	require.Equal(t, 4, testutil.CollectAndCount(h.srv.metrics.duration))
	require.Equal(t, 5, testutil.CollectAndCount(h.srv.metrics.requests))

	// The same metrics are served on the operations handler.
	rec := httptest.NewRecorder()
	h.srv.OpsHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	require.Contains(t, rec.Body.String(), `tokenbroker_http_request_duration_seconds_count{listener="api",route="/v1/kubeconfigs"} 2`)
}

func TestMetricNamesAndDurationsUseTheInjectedClock(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	h := newHarness(t, nil, func(c *Config) {
		c.Now = func() time.Time {
			now = now.Add(250 * time.Millisecond)
			return now
		}
	})
	h.do(request{method: http.MethodGet, path: "/v1/leases"})

	mfs, err := h.reg.Gather()
	require.NoError(t, err)
	var names []string
	for _, mf := range mfs {
		names = append(names, mf.GetName())
		require.True(t, strings.HasPrefix(mf.GetName(), "tokenbroker_"), mf.GetName())
	}
	require.Equal(t, []string{"tokenbroker_http_request_duration_seconds", "tokenbroker_http_requests_total"}, names)

	// Two clock reads for authentication and the request itself; the
	// duration spans start to end of the chain.
	hist := mfs[0].GetMetric()[0].GetHistogram()
	require.Equal(t, uint64(1), hist.GetSampleCount())
	require.InDelta(t, 0.5, hist.GetSampleSum(), 1e-9)
}

func TestOperationsEndpoints(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		path   string
		ready  error
		status int
		body   string
	}{
		{name: "Healthz answers ok while the process runs.", path: "/healthz", status: http.StatusOK, body: "ok\n"},
		{name: "Healthz answers ok even when the broker is not ready.", path: "/healthz", ready: errors.New("api server down"), status: http.StatusOK, body: "ok\n"},
		{name: "Readyz answers ok when the broker is ready.", path: "/readyz", status: http.StatusOK, body: "ok\n"},
		{name: "Readyz answers 503 with the reason when the broker is not ready.", path: "/readyz", ready: errors.New("api server unreachable"), status: http.StatusServiceUnavailable, body: "not ready: api server unreachable\n"},
		{name: "An unknown operations path is 404.", path: "/debug/pprof", status: http.StatusNotFound, body: "404 page not found\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, &fakeBroker{ready: func(context.Context) error { return tt.ready }})
			rec := httptest.NewRecorder()
			h.srv.OpsHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, tt.path, nil))
			require.Equal(t, tt.status, rec.Code)
			require.Equal(t, tt.body, rec.Body.String())
			require.Equal(t, "no-store", rec.Header().Get("Cache-Control"))
			require.Equal(t, "nosniff", rec.Header().Get("X-Content-Type-Options"))
			require.Empty(t, h.logs.FilterMessage("request").All(), "operations requests are not access-logged")
		})
	}

	t.Run("Readyz gives up on a slow broker after the ready timeout.", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, &fakeBroker{ready: func(ctx context.Context) error {
			<-ctx.Done()
			return ctx.Err()
		}}, func(c *Config) { c.ReadyTimeout = 20 * time.Millisecond })
		rec := httptest.NewRecorder()
		h.srv.OpsHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
		require.Equal(t, http.StatusServiceUnavailable, rec.Code)
		require.Equal(t, "not ready: context deadline exceeded\n", rec.Body.String())
	})
}

func TestNewRefusesBadConfig(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t)
	good := func() Config {
		return Config{Addr: ":0", OpsAddr: ":0", TLSConfig: p.serverTLSConfig(t), Broker: &fakeBroker{}}
	}
	tests := []struct {
		name   string
		mutate func(*Config)
		errMsg string
	}{
		{name: "A missing broker is refused.", mutate: func(c *Config) { c.Broker = nil }, errMsg: "Broker is required"},
		{name: "A missing TLS config is refused.", mutate: func(c *Config) { c.TLSConfig = nil }, errMsg: "TLSConfig is required"},
		{name: "A TLS config that does not verify clients is refused.", mutate: func(c *Config) {
			c.TLSConfig = c.TLSConfig.Clone()
			c.TLSConfig.ClientAuth = 0
		}, errMsg: "must require and verify client certificates"},
		{name: "A TLS config allowing TLS 1.2 is refused.", mutate: func(c *Config) {
			c.TLSConfig = c.TLSConfig.Clone()
			c.TLSConfig.MinVersion = 0
		}, errMsg: "must require TLS 1.3"},
		{name: "A missing API address is refused.", mutate: func(c *Config) { c.Addr = "" }, errMsg: "Addr or Listener is required"},
		{name: "A missing ops address is refused.", mutate: func(c *Config) { c.OpsAddr = "" }, errMsg: "OpsAddr or OpsListener is required"},
		{name: "A Registerer without a Gatherer is refused.", mutate: func(c *Config) { c.Registerer = prometheus.NewRegistry() }, errMsg: "must be set together"},
		{name: "A negative timeout is refused.", mutate: func(c *Config) { c.WriteTimeout = -time.Second }, errMsg: "WriteTimeout must not be negative"},
		{name: "A negative body limit is refused.", mutate: func(c *Config) { c.MaxBodyBytes = -1 }, errMsg: "MaxBodyBytes must not be negative"},
		{name: "A negative connection cap is refused.", mutate: func(c *Config) { c.MaxHandshakes = -1 }, errMsg: "MaxHandshakes must not be negative"},
		{name: "A handshake timeout as long as the header timeout is refused.", mutate: func(c *Config) {
			c.HandshakeTimeout, c.ReadHeaderTimeout = 2*time.Second, 2*time.Second
		}, errMsg: "HandshakeTimeout (2s) must be shorter than ReadHeaderTimeout (2s)"},
		{name: "A header timeout shorter than the default handshake timeout is refused.", mutate: func(c *Config) {
			c.ReadHeaderTimeout = time.Second
		}, errMsg: "HandshakeTimeout (3s) must be shorter than ReadHeaderTimeout (1s)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := good()
			tt.mutate(&cfg)
			_, err := New(cfg)
			require.ErrorContains(t, err, tt.errMsg)
		})
	}

	t.Run("Zero limits and timeouts take the defaults.", func(t *testing.T) {
		t.Parallel()
		s, err := New(good())
		require.NoError(t, err)
		require.Equal(t, int64(DefaultMaxBodyBytes), s.cfg.MaxBodyBytes)
		require.Equal(t, DefaultMaxHeaderBytes, s.cfg.MaxHeaderBytes)
		require.Equal(t, DefaultReadHeaderTimeout, s.cfg.ReadHeaderTimeout)
		require.Equal(t, DefaultReadTimeout, s.cfg.ReadTimeout)
		require.Equal(t, DefaultWriteTimeout, s.cfg.WriteTimeout)
		require.Equal(t, DefaultIdleTimeout, s.cfg.IdleTimeout)
		require.Equal(t, DefaultShutdownGrace, s.cfg.ShutdownGrace)
		require.Equal(t, DefaultReadyTimeout, s.cfg.ReadyTimeout)
		require.Equal(t, DefaultHandshakeTimeout, s.cfg.HandshakeTimeout)
		require.Less(t, DefaultHandshakeTimeout, DefaultReadHeaderTimeout)
		require.Equal(t, DefaultMaxConns, s.cfg.MaxConns)
		require.Equal(t, DefaultMaxHandshakes, s.cfg.MaxHandshakes)
		require.Equal(t, DefaultMaxHandshakesPerIP, s.cfg.MaxHandshakesPerIP)
		hs := s.httpServer(http.NotFoundHandler(), context.Background(), "api")
		require.Equal(t, DefaultReadHeaderTimeout, hs.ReadHeaderTimeout)
		require.Equal(t, DefaultReadTimeout, hs.ReadTimeout)
		require.Equal(t, DefaultWriteTimeout, hs.WriteTimeout)
		require.Equal(t, DefaultIdleTimeout, hs.IdleTimeout)
		require.Equal(t, DefaultMaxHeaderBytes, hs.MaxHeaderBytes)
	})

	t.Run("Registering twice on one registry is refused.", func(t *testing.T) {
		t.Parallel()
		reg := prometheus.NewRegistry()
		cfg := good()
		cfg.Registerer, cfg.Gatherer = reg, reg
		_, err := New(cfg)
		require.NoError(t, err)
		_, err = New(cfg)
		require.ErrorContains(t, err, "register http metrics")
	})
}

// readAll is io.ReadAll for a test that must not fail on it.
func readAll(t *testing.T, r io.Reader) string {
	t.Helper()
	b, err := io.ReadAll(r)
	require.NoError(t, err)
	return string(b)
}

func TestProfilesAreServedOnlyWhenAskedFor(t *testing.T) {
	t.Parallel()
	for _, on := range []bool{false, true} {
		h := newHarness(t, nil, func(c *Config) { c.Pprof = on })
		rec := httptest.NewRecorder()
		h.srv.OpsHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/debug/pprof/goroutine?debug=1", nil))
		if on {
			require.Equal(t, http.StatusOK, rec.Code)
			require.Contains(t, rec.Body.String(), "goroutine profile: total")
		} else {
			require.Equal(t, http.StatusNotFound, rec.Code)
		}
	}
}
