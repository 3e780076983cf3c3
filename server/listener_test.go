package server

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/time/rate"

	"github.com/tokenbroker/tokenbroker/pki"
)

// caAndLeaf makes a CA and a client certificate for testIdentity signed by
// it, which change may alter before signing (expire it, change its usage).
func caAndLeaf(t *testing.T, change func(*x509.Certificate)) (*x509.Certificate, *tls.Certificate) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "handshake test CA"},
		NotBefore: now.Add(-48 * time.Hour), NotAfter: now.Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	caCert, err := x509.ParseCertificate(caDER)
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	id, err := url.Parse(testIdentity)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: testIdentity}, URIs: []*url.URL{id},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	change(tmpl)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	require.NoError(t, err)
	return caCert, &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

func TestHandshakeFailuresAreCountedByReason(t *testing.T) {
	t.Parallel()
	expiredCA, expired := caAndLeaf(t, func(c *x509.Certificate) {
		c.NotBefore, c.NotAfter = time.Now().Add(-48*time.Hour), time.Now().Add(-24*time.Hour)
	})
	usageCA, serverUsage := caAndLeaf(t, func(c *x509.Certificate) {
		c.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	})
	_, untrusted := caAndLeaf(t, func(*x509.Certificate) {})
	r := startServer(t, &fakeBroker{}, []*x509.Certificate{expiredCA, usageCA},
		func(c *Config) { c.HandshakeTimeout = 300 * time.Millisecond })
	addr := r.srv.Addr().String()
	failures := r.srv.metrics.handshakes

	tlsClient := func(cert *tls.Certificate, change func(*tls.Config)) func() {
		return func() {
			cfg := &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: r.pki.ca.CertPool()}
			if cert != nil {
				cfg.GetClientCertificate = presentAlways(cert)
			}
			if change != nil {
				change(cfg)
			}
			require.Error(t, rawRequest(addr, cfg))
		}
	}
	// tcp sends send over a bare TCP connection, then leaves at once or
	// waits for the server to close it.
	tcp := func(send string, leave bool) func() {
		return func() {
			conn, err := net.Dial("tcp", addr)
			require.NoError(t, err)
			defer func() { _ = conn.Close() }()
			if send != "" {
				_, err = io.WriteString(conn, send)
				require.NoError(t, err)
			}
			if leave {
				return
			}
			// The server ends the connection.
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, err = io.ReadAll(conn)
			var ne net.Error
			require.False(t, errors.As(err, &ne) && ne.Timeout(), "the server must close the connection")
		}
	}

	for _, tc := range []struct {
		name   string
		reason string
		client func()
	}{
		{"A client without a certificate counts as no_certificate.", HandshakeNoCertificate, tlsClient(nil, nil)},
		{"A certificate of an unknown CA counts as unknown_authority.", HandshakeUnknownAuthority, tlsClient(untrusted, nil)},
		{"An expired certificate counts as expired.", HandshakeExpired, tlsClient(expired, nil)},
		{"A server certificate used as a client's counts as wrong_usage.", HandshakeWrongUsage, tlsClient(serverUsage, nil)},
		{"A TLS 1.2 client counts as protocol_version.", HandshakeProtocolVersion,
			tlsClient(r.goodClientCert(t), func(c *tls.Config) { c.MaxVersion = tls.VersionTLS12 })},
		{"A client that does not trust the server counts as refused_by_client.", HandshakeRefusedByClient,
			tlsClient(r.goodClientCert(t), func(c *tls.Config) { c.RootCAs = x509.NewCertPool() })},
		{"Plain HTTP counts as not_tls.", HandshakeNotTLS, tcp("GET /v1/whoami HTTP/1.1\r\nHost: broker\r\n\r\n", false)},
		{"A client that sends nothing counts as timeout.", HandshakeTimeout, tcp("", false)},
		{"A client that connects and leaves counts as closed.", HandshakeClosed, tcp("", true)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := testutil.ToFloat64(failures.WithLabelValues(listenerAPI, tc.reason))
			tc.client()
			require.Eventually(t, func() bool {
				return testutil.ToFloat64(failures.WithLabelValues(listenerAPI, tc.reason)) == before+1
			}, 10*time.Second, 5*time.Millisecond)
		})
	}
	require.Equal(t, 9, testutil.CollectAndCount(failures), "one series per reason, no other")

	logged := r.logs.FilterMessage("TLS handshake failed")
	byReason := map[string]map[string]any{}
	for _, e := range logged.All() {
		byReason[e.ContextMap()["reason"].(string)] = e.ContextMap()
	}
	expiredLog := byReason[HandshakeExpired]
	require.Equal(t, testIdentity, expiredLog["identity"])
	require.Equal(t, "CN="+testIdentity, expiredLog["subject"])
	require.Equal(t, listenerAPI, expiredLog["listener"])
	require.Contains(t, expiredLog["remote"], "127.0.0.1:")
	require.NotContains(t, expiredLog, "error", "an x509 error names certificate contents")
	require.Equal(t, testIdentity, byReason[HandshakeUnknownAuthority]["identity"])

	t.Run("A good client still gets through.", func(t *testing.T) {
		resp, err := r.client(r.goodClientCert(t)).Get(r.apiURL("/v1/whoami"))
		require.NoError(t, err)
		_ = resp.Body.Close()
	})
}

func TestHandshakeFailureLogsAreRateLimited(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zapcore.DebugLevel)
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	var counted int
	l := &handshakeListener{
		name:     listenerAPI,
		failures: func(string, string) { counted++ },
		log:      zap.New(core),
		now:      func() time.Time { return now },
		logLimit: rate.NewLimiter(rate.Every(handshakeLogEvery), handshakeLogBurst),
	}
	remote := &net.TCPAddr{IP: net.IPv4(192, 0, 2, 1), Port: 4242}
	noCert := errors.New("tls: client didn't provide a certificate")
	for range handshakeLogBurst + 5 {
		l.failed(remote, noCert)
	}
	require.Equal(t, handshakeLogBurst+5, counted, "every failure is counted")
	require.Equal(t, handshakeLogBurst, logs.Len(), "only a burst is logged")

	now = now.Add(handshakeLogEvery)
	l.failed(remote, noCert)
	last := logs.All()[logs.Len()-1]
	require.Equal(t, zapcore.WarnLevel, last.Level)
	require.Equal(t, map[string]any{"reason": HandshakeNoCertificate, "remote": "192.0.2.1:4242", "suppressed": int64(5)}, last.ContextMap())
}

func TestHandshakeFailureReason(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		err  error
		want string
	}{
		{"A chain to an unknown CA is unknown_authority.", &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, HandshakeUnknownAuthority},
		{"An expired certificate is expired.", &tls.CertificateVerificationError{Err: x509.CertificateInvalidError{Reason: x509.Expired}}, HandshakeExpired},
		{"A certificate not for client authentication is wrong_usage.", x509.CertificateInvalidError{Reason: x509.IncompatibleUsage}, HandshakeWrongUsage},
		{"Another invalid certificate is other.", x509.CertificateInvalidError{Reason: x509.NameConstraintsWithoutSANs}, HandshakeOther},
		{"crypto/tls's missing certificate is no_certificate.", errors.New("tls: client didn't provide a certificate"), HandshakeNoCertificate},
		{"crypto/tls's version mismatch is protocol_version.", errors.New("tls: client offered only unsupported versions: [303]"), HandshakeProtocolVersion},
		{"A peer's alert is refused_by_client.", &net.OpError{Op: "remote error", Err: errors.New("tls: bad certificate")}, HandshakeRefusedByClient},
		{"A record that is not TLS is not_tls.", tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"}, HandshakeNotTLS},
		{"An EOF is closed.", io.EOF, HandshakeClosed},
		{"Anything else is other.", errors.New(strings.Repeat("x", 10)), HandshakeOther},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, HandshakeFailureReason(tc.err))
		})
	}
	require.Len(t, HandshakeReasons(), 11)
}

// dialFrom opens a TCP connection to addr from the loopback address src.
func dialFrom(t *testing.T, src, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	conn, err := d.Dial("tcp", addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// closedByServer reports whether the server closed conn within d.
func closedByServer(conn net.Conn, d time.Duration) bool {
	_ = conn.SetReadDeadline(time.Now().Add(d))
	_, err := io.ReadAll(conn)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

func TestGreedyAndSlowClientsDoNotStarveAWellBehavedPeer(t *testing.T) {
	t.Parallel()
	const perIP, perIdentity = 8, 4
	const handshakeTimeout, headerTimeout = time.Second, 2 * time.Second
	r := startServer(t, &fakeBroker{}, nil, func(c *Config) {
		c.MaxConnsPerIP, c.MaxConnsPerIdentity = perIP, perIdentity
		c.HandshakeTimeout, c.ReadHeaderTimeout = handshakeTimeout, headerTimeout
	})
	addr := r.srv.Addr().String()
	m := r.srv.metrics
	good := r.client(r.goodClientCert(t))
	issue := func() {
		t.Helper()
		resp, err := good.Post(r.apiURL("/v1/kubeconfigs"), "application/json",
			strings.NewReader(`{"namespace":"argo","serviceAccount":"admiralty-source"}`))
		require.NoError(t, err)
		_ = resp.Body.Close()
		require.Equal(t, http.StatusCreated, resp.StatusCode)
	}
	issue()

	// A greedy client (127.0.0.2) opens connections and says nothing; one
	// over the cap is closed at once, before any handshake.
	var idle []net.Conn
	for range perIP {
		idle = append(idle, dialFrom(t, "127.0.0.2", addr))
	}
	require.Eventually(t, func() bool { return testutil.ToFloat64(m.openConns.WithLabelValues(listenerAPI)) >= perIP },
		5*time.Second, 5*time.Millisecond)
	extra := dialFrom(t, "127.0.0.2", addr)
	// Closed by the cap, not by a timeout: the counter says which.
	require.True(t, closedByServer(extra, 5*headerTimeout), "the connection over the cap is closed")
	require.Equal(t, 1.0, testutil.ToFloat64(m.refused.WithLabelValues(listenerAPI, ConnRefusedPerIP)))

	// A slow peer (another identity, 127.0.0.3) sends half a request on
	// each of its connections; one over its cap is closed after the
	// handshake.
	rogueKP, err := r.pki.ca.IssueClient(pki.ClientOptions{Identity: "spiffe://oc.example/cluster/rogue", Lifetime: time.Hour})
	require.NoError(t, err)
	rogue, err := rogueKP.TLSCertificate()
	require.NoError(t, err)
	rogueTLS := func() *tls.Conn {
		t.Helper()
		c := tls.Client(dialFrom(t, "127.0.0.3", addr), &tls.Config{
			MinVersion: tls.VersionTLS13, RootCAs: r.pki.ca.CertPool(), ServerName: "127.0.0.1",
			GetClientCertificate: presentAlways(&rogue),
		})
		require.NoError(t, c.Handshake())
		return c
	}
	var slow []*tls.Conn
	for range perIdentity {
		c := rogueTLS()
		_, err := io.WriteString(c, "POST /v1/kubeconfigs HTTP/1.1\r\nHost: broker\r\nContent-Ty")
		require.NoError(t, err)
		slow = append(slow, c)
	}
	over := rogueTLS()
	require.True(t, closedByServer(over, 5*headerTimeout), "the identity's connection over the cap is closed before any request")
	require.Eventually(t, func() bool {
		return testutil.ToFloat64(m.refused.WithLabelValues(listenerAPI, ConnRefusedPerIdentity)) == 1
	}, 5*time.Second, 5*time.Millisecond)

	// The well-behaved peer is served throughout.
	start := time.Now()
	issue()
	require.Less(t, time.Since(start), headerTimeout, "issuance does not wait for the greedy clients")

	// The server ends them all at its header timeout: the idle ones in the
	// handshake, the slow ones before their headers are complete.
	for _, c := range idle {
		require.True(t, closedByServer(c, 5*headerTimeout), "an idle connection is closed")
	}
	for _, c := range slow {
		require.True(t, closedByServer(c, 5*headerTimeout), "a half request is closed")
	}
	require.Eventually(t, func() bool {
		return testutil.ToFloat64(m.handshakes.WithLabelValues(listenerAPI, HandshakeTimeout)) == perIP
	}, 5*time.Second, 5*time.Millisecond)
	// And their places are free again.
	require.Eventually(t, func() bool { return testutil.ToFloat64(m.openConns.WithLabelValues(listenerAPI)) <= 1 },
		5*time.Second, 5*time.Millisecond, "only the good client's kept-alive connection is open")
	again := rogueTLS()
	_, err = io.WriteString(again, "GET /v1/whoami HTTP/1.1\r\nHost: broker\r\nConnection: close\r\n\r\n")
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(again), nil)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	issue()
}
