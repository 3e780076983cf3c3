package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/pki"
)

// running is a Server started with Run on 127.0.0.1 listeners.
type running struct {
	srv    *Server
	pki    *testPKI
	logs   *observer.ObservedLogs
	cancel context.CancelFunc
	// finished is closed when Run has returned runErr.
	finished chan struct{}
	runErr   error
}

func (r *running) apiURL(path string) string { return "https://" + r.srv.Addr().String() + path }
func (r *running) opsURL(path string) string { return "http://" + r.srv.OpsAddr().String() + path }

// client makes an HTTPS client trusting the test CA and presenting cert
// (none if nil).
func (r *running) client(cert *tls.Certificate) *http.Client {
	cfg := &tls.Config{MinVersion: tls.VersionTLS13, RootCAs: r.pki.ca.CertPool()}
	if cert != nil {
		cfg.GetClientCertificate = presentAlways(cert)
	}
	return &http.Client{
		Transport: &http.Transport{TLSClientConfig: cfg, ForceAttemptHTTP2: true},
		Timeout:   10 * time.Second,
	}
}

func (r *running) goodClientCert(t *testing.T) *tls.Certificate {
	t.Helper()
	c, err := r.pki.client.TLSCertificate()
	require.NoError(t, err)
	return &c
}

// stop cancels Run and returns its result.
func (r *running) stop(t *testing.T) error {
	t.Helper()
	r.cancel()
	return r.wait(t)
}

// wait returns Run's result once it has returned.
func (r *running) wait(t *testing.T) error {
	t.Helper()
	select {
	case <-r.finished:
		return r.runErr
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return")
		return nil
	}
}

// presentAlways sends cert whatever CAs the server names, unlike
// tls.Config.Certificates, so that the server's own checks are tested.
func presentAlways(cert *tls.Certificate) func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	return func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cert, nil }
}

// rawRequest sends one HTTP/1.1 request over a bare TLS connection and
// returns the first error, which is the server's alert when it refuses the
// client.
func rawRequest(addr string, cfg *tls.Config) error {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(conn, "GET /v1/whoami HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n\r\n"); err != nil {
		return err
	}
	_, err = io.ReadAll(conn)
	if err == nil {
		return errors.New("the server answered")
	}
	return err
}

func startServer(t *testing.T, b Broker, extraCAs []*x509.Certificate, opts ...harnessOption) *running {
	t.Helper()
	p := newTestPKI(t)
	apiLn, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	opsLn, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	core, logs := observer.New(zapcore.DebugLevel)
	reg := prometheus.NewRegistry()
	cfg := Config{
		Listener:    apiLn,
		OpsListener: opsLn,
		TLSConfig:   p.serverTLSConfig(t, extraCAs...),
		Logger:      zap.New(core),
		Registerer:  reg,
		Gatherer:    reg,
		Broker:      b,
	}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.Addr != "" { // the server opens its own listeners
		require.NoError(t, apiLn.Close())
		require.NoError(t, opsLn.Close())
		cfg.Listener, cfg.OpsListener = nil, nil
	}
	srv, err := New(cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{srv: srv, pki: p, logs: logs, cancel: cancel, finished: make(chan struct{})}
	go func() {
		r.runErr = srv.Run(ctx)
		close(r.finished)
	}()
	select {
	case <-srv.Listening():
	case <-time.After(10 * time.Second):
		t.Fatal("server did not start listening")
	}
	t.Cleanup(func() {
		cancel()
		<-r.finished
	})
	return r
}

func TestMutualTLS(t *testing.T) {
	t.Parallel()
	noURICA, noURI := selfMadeCert(t)
	twoURIsCA, twoURIs := selfMadeCert(t, testIdentity, "spiffe://oc.example/cluster/east")
	untrusted := func() *tls.Certificate {
		ca, err := pki.NewCA(pki.CAOptions{CommonName: "untrusted"})
		require.NoError(t, err)
		kp, err := ca.IssueClient(pki.ClientOptions{Identity: testIdentity})
		require.NoError(t, err)
		c, err := kp.TLSCertificate()
		require.NoError(t, err)
		return &c
	}()
	b := &fakeBroker{}
	r := startServer(t, b, []*x509.Certificate{noURICA, twoURIsCA})

	handshakeTests := []struct {
		name    string
		cert    *tls.Certificate
		tls12   bool
		wantErr string
	}{
		{name: "A client without a certificate is refused during the handshake.", wantErr: "certificate required"},
		{name: "A client certificate from an untrusted CA is refused during the handshake.", cert: untrusted, wantErr: "unknown certificate authority"},
		{name: "A TLS 1.2 client is refused during the handshake.", cert: r.goodClientCert(t), tls12: true, wantErr: "protocol version"},
		// It chains to the client CA, but is good at the lease gateway
		// only: a 401 would leave it a connection that no per-identity
		// cap counts.
		{name: "A lease certificate is refused during the handshake.", cert: leaseCertificate(t, r.pki.ca), wantErr: "bad certificate"},
	}
	for _, tc := range handshakeTests {
		t.Run(tc.name, func(t *testing.T) {
			// Through an HTTP client: no answer at all.
			c := r.client(tc.cert)
			if tc.tls12 {
				tr := c.Transport.(*http.Transport)
				tr.TLSClientConfig.MinVersion, tr.TLSClientConfig.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
			}
			resp, err := c.Get(r.apiURL("/v1/whoami"))
			if resp != nil {
				_ = resp.Body.Close()
			}
			require.Error(t, err)

			// On the raw connection: the server's alert says why. In TLS 1.3
			// the client learns of a refused certificate on its first read.
			cfg := &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: r.pki.ca.CertPool()}
			if tc.cert != nil {
				cfg.GetClientCertificate = presentAlways(tc.cert)
			}
			if tc.tls12 {
				cfg.MaxVersion = tls.VersionTLS12
			}
			require.ErrorContains(t, rawRequest(r.srv.Addr().String(), cfg), tc.wantErr)
		})
	}
	require.Zero(t, b.calls.Load(), "the broker must not be called")

	for _, tc := range []struct {
		name string
		cert tls.Certificate
	}{
		{"A trusted certificate without a SPIFFE identity gets the uniform 401.", noURI},
		{"A trusted certificate with two URI SANs gets the uniform 401.", twoURIs},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := r.client(&tc.cert).Get(r.apiURL("/v1/whoami"))
			require.NoError(t, err)
			defer func() { _ = resp.Body.Close() }()
			require.Equal(t, http.StatusUnauthorized, resp.StatusCode)
			require.Equal(t, apiv1.MediaTypeProblem, resp.Header.Get("Content-Type"))
			var p apiv1.Problem
			require.NoError(t, json.NewDecoder(resp.Body).Decode(&p))
			require.Equal(t, apiv1.Problem{
				Type: "urn:tokenbroker:problem:unauthenticated", Title: "Unauthorized", Status: http.StatusUnauthorized,
				Detail: classUnauthenticated.detail, Instance: "/v1/whoami", RequestID: resp.Header.Get("X-Request-Id"),
			}, p)
			require.Zero(t, b.calls.Load(), "the broker must not be called")
		})
	}

	t.Run("A good certificate reaches whoami with its identity.", func(t *testing.T) {
		resp, err := r.client(r.goodClientCert(t)).Get(r.apiURL("/v1/whoami"))
		require.NoError(t, err)
		defer func() { _ = resp.Body.Close() }()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, uint16(tls.VersionTLS13), resp.TLS.Version)
		require.Equal(t, 2, resp.ProtoMajor, "ServeTLS offers HTTP/2")
		require.Equal(t, "no-store", resp.Header.Get("Cache-Control"))
		var who apiv1.WhoAmI
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&who))
		require.Equal(t, testIdentity, who.Identity)
		require.Equal(t, pki.Fingerprint(r.pki.client.Cert), who.Certificate.SHA256)
	})

	t.Run("The operations listener serves plain HTTP.", func(t *testing.T) {
		resp, err := http.Get(r.opsURL("/healthz"))
		require.NoError(t, err)
		defer func() { _ = resp.Body.Close() }()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		require.Equal(t, "ok\n", readAll(t, resp.Body))
	})
}

func TestGracefulShutdown(t *testing.T) {
	t.Parallel()

	t.Run("An in-flight request completes after cancel and new ones are refused.", func(t *testing.T) {
		t.Parallel()
		entered, release := make(chan struct{}), make(chan struct{})
		r := startServer(t, &fakeBroker{
			list: func(ctx context.Context, _ broker.Caller) ([]apiv1.Lease, error) {
				close(entered)
				select {
				case <-release:
					return []apiv1.Lease{testLease()}, nil
				case <-ctx.Done():
					return nil, ctx.Err()
				}
			},
		}, nil)
		client := r.client(r.goodClientCert(t))

		type result struct {
			status int
			body   string
			err    error
		}
		inflight := make(chan result, 1)
		go func() {
			resp, err := client.Get(r.apiURL("/v1/leases"))
			if err != nil {
				inflight <- result{err: err}
				return
			}
			defer func() { _ = resp.Body.Close() }()
			b, err := io.ReadAll(resp.Body)
			inflight <- result{status: resp.StatusCode, body: string(b), err: err}
		}()
		<-entered

		r.cancel()
		// Run waits for the request; meanwhile /readyz reports draining.
		require.Eventually(t, func() bool {
			resp, err := http.Get(r.opsURL("/readyz"))
			if err != nil {
				return false
			}
			defer func() { _ = resp.Body.Close() }()
			return resp.StatusCode == http.StatusServiceUnavailable && readAll(t, resp.Body) == "not ready: shutting down\n"
		}, 5*time.Second, 10*time.Millisecond)
		select {
		case <-r.finished:
			t.Fatalf("Run returned before the in-flight request finished: %v", r.runErr)
		default:
		}
		// /readyz turns first, then the listeners close: a new connection
		// (a new client each time, so that none is kept alive) is refused
		// soon after, while the in-flight request still runs.
		require.Eventually(t, func() bool {
			fresh := r.client(r.goodClientCert(t))
			defer fresh.CloseIdleConnections()
			resp, err := fresh.Get(r.apiURL("/v1/whoami"))
			if err == nil {
				_ = resp.Body.Close()
			}
			return err != nil
		}, 5*time.Second, 10*time.Millisecond, "a new connection must be refused while draining")
		select {
		case <-r.finished:
			t.Fatalf("Run returned before the in-flight request finished: %v", r.runErr)
		default:
		}

		close(release)
		res := <-inflight
		require.NoError(t, res.err)
		require.Equal(t, http.StatusOK, res.status)
		require.Contains(t, res.body, testLeaseID)
		require.NoError(t, r.wait(t))
	})

	t.Run("A request still running after the grace period is cancelled and Run reports it.", func(t *testing.T) {
		t.Parallel()
		entered := make(chan struct{})
		r := startServer(t, &fakeBroker{
			list: func(ctx context.Context, _ broker.Caller) ([]apiv1.Lease, error) {
				close(entered)
				<-ctx.Done()
				return nil, ctx.Err()
			},
		}, nil, func(c *Config) { c.ShutdownGrace = 100 * time.Millisecond })
		client := r.client(r.goodClientCert(t))
		go func() {
			resp, err := client.Get(r.apiURL("/v1/leases"))
			if err == nil {
				_ = resp.Body.Close()
			}
		}()
		<-entered
		require.ErrorIs(t, r.stop(t), context.DeadlineExceeded)
	})

	t.Run("Run may be called only once.", func(t *testing.T) {
		t.Parallel()
		r := startServer(t, &fakeBroker{}, nil)
		require.ErrorContains(t, r.srv.Run(context.Background()), "more than once")
	})
}

func TestRunReportsABusyAddress(t *testing.T) {
	t.Parallel()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = busy.Close() }()
	p := newTestPKI(t)
	srv, err := New(Config{
		Addr: "127.0.0.1:0", OpsAddr: busy.Addr().String(),
		TLSConfig: p.serverTLSConfig(t), Broker: &fakeBroker{},
	})
	require.NoError(t, err)
	require.ErrorContains(t, srv.Run(context.Background()), "listen on ops address")
	select {
	case <-srv.Listening():
		t.Fatal("Listening must not be closed when binding failed")
	default:
	}
	require.Nil(t, srv.Addr())
	require.Nil(t, srv.OpsAddr())
}
