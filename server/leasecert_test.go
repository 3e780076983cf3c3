package server

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/tokenbroker/tokenbroker/pki"
)

// testLeaseUID is the lease Secret's UID in the test lease certificates.
const testLeaseUID = "0b6c1d7e-3f5a-4c2b-9d8e-7a6f5e4d3c2b"

// leaseCertificate is the lease certificate of testLeaseID, issued to
// testIdentity by ca: in the tests, as in every deployment, the signing CA
// is in the API listener's client-CA bundle, so the certificate chains to
// it.
func leaseCertificate(t *testing.T, ca *pki.CA) *tls.Certificate {
	t.Helper()
	pub, keyPEM, err := ca.NewLeaseKey()
	require.NoError(t, err)
	kp, err := ca.SignLease(pub, pki.LeaseName{Namespace: "argo", ServiceAccount: "admiralty-source", ID: testLeaseID,
		UID: testLeaseUID, Peer: testIdentity}, time.Now().Add(time.Hour))
	require.NoError(t, err)
	require.True(t, pki.IsLeaseCertificate(kp.Cert))
	pair, err := tls.X509KeyPair(kp.CertPEM, keyPEM)
	require.NoError(t, err)
	return &pair
}

// peerCertificate is a client certificate of ca for the cluster identity
// id.
func peerCertificate(t *testing.T, ca *pki.CA, id string) *tls.Certificate {
	t.Helper()
	kp, err := ca.IssueClient(pki.ClientOptions{Identity: id, Lifetime: time.Hour})
	require.NoError(t, err)
	c, err := kp.TLSCertificate()
	require.NoError(t, err)
	return &c
}

// TestALeaseCertificateGetsNoPlaceOnTheAPIListener: a lease holder who
// turns to the API listener with its certificate fails the handshake every
// time, so that however many connections it opens (and keeps open on its
// side), it holds none of the places the peers share, and its refusals are
// counted and logged as such.
func TestALeaseCertificateGetsNoPlaceOnTheAPIListener(t *testing.T) {
	t.Parallel()
	// The caps of the report: 20 lease connections against a per-identity
	// cap of 2; and a listener cap of 4, which any 4 kept would fill.
	const maxConns, perIdentity, attempts = 4, 2, 20
	r := startServer(t, &fakeBroker{}, nil, func(c *Config) { c.MaxConns, c.MaxConnsPerIdentity = maxConns, perIdentity })
	m := r.srv.metrics
	addr := r.srv.Addr().String()
	lease := leaseCertificate(t, r.pki.ca)
	openConns := func() float64 { return testutil.ToFloat64(m.openConns.WithLabelValues(listenerAPI)) }
	refusedLeases := func() float64 {
		return testutil.ToFloat64(m.handshakes.WithLabelValues(listenerAPI, HandshakeLeaseCertificate))
	}
	listLeases := func(c *http.Client) error {
		resp, err := c.Get(r.apiURL("/v1/leases"))
		if err != nil {
			return err
		}
		defer func() { _ = resp.Body.Close() }()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("answered %d", resp.StatusCode)
		}
		return nil
	}

	// A real peer holds a kept-alive connection all along.
	peer := r.client(r.goodClientCert(t))
	require.NoError(t, listLeases(peer))
	require.Equal(t, 1.0, openConns())

	// Go's HTTP client with the lease certificate gets an error, not an
	// answer.
	require.Error(t, listLeases(r.client(lease)))
	require.Eventually(t, func() bool { return refusedLeases() == 1 }, 10*time.Second, 5*time.Millisecond)

	for i := range attempts {
		conn := tls.Client(dialFrom(t, "127.0.0.2", addr), &tls.Config{
			MinVersion: tls.VersionTLS13, RootCAs: r.pki.ca.CertPool(), ServerName: "127.0.0.1",
			GetClientCertificate: presentAlways(lease),
		})
		// In TLS 1.3 the client's handshake is over before the server
		// has looked at its certificate: the refusal is the first thing
		// it reads. The test keeps its end of the connection open.
		require.NoError(t, conn.Handshake())
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err := conn.Read(make([]byte, 1))
		require.ErrorContains(t, err, "bad certificate", "attempt %d", i)
		require.Eventually(t, func() bool { return refusedLeases() == float64(i+2) }, 10*time.Second, 5*time.Millisecond)
		require.Eventually(t, func() bool { return openConns() == 1 }, 10*time.Second, 5*time.Millisecond,
			"attempt %d: only the peer's connection is open", i)
		// The peer is served meanwhile, on its kept-alive connection.
		require.NoError(t, listLeases(peer))
	}

	// With the 20 lease connections still open on the holder's side,
	// the peers take every place of the cap: none is the holder's.
	require.NoError(t, listLeases(r.client(r.goodClientCert(t))))
	north, south := peerCertificate(t, r.pki.ca, "spiffe://oc.example/cluster/north"), peerCertificate(t, r.pki.ca, "spiffe://oc.example/cluster/south")
	require.NoError(t, listLeases(r.client(north)))
	require.NoError(t, listLeases(r.client(south)))
	require.Equal(t, float64(maxConns), openConns())
	require.Error(t, listLeases(r.client(peerCertificate(t, r.pki.ca, "spiffe://oc.example/cluster/east"))), "the cap is in force")
	require.Equal(t, 1.0, testutil.ToFloat64(m.refused.WithLabelValues(listenerAPI, ConnRefusedConns)))
	require.Equal(t, 1, testutil.CollectAndCount(m.refused), "no lease connection reached a cap")
	require.Equal(t, float64(attempts+1), refusedLeases())
	require.Equal(t, 1, testutil.CollectAndCount(m.handshakes), "every refusal is a lease_certificate one")

	// Logged as such (the first ten; the rest rate-limited), naming the
	// lease and its peer by the certificate's subject.
	logged := r.logs.FilterMessage("TLS handshake failed").FilterField(zap.String("reason", HandshakeLeaseCertificate)).All()
	require.NotEmpty(t, logged)
	fields := logged[0].ContextMap()
	require.Equal(t, zapcore.WarnLevel, logged[0].Level)
	require.Equal(t, listenerAPI, fields["listener"])
	require.Equal(t, "CN=tokenbroker-lease:"+testLeaseID+",O="+testIdentity, fields["subject"])
	require.Contains(t, fields["remote"], "127.0.0.")
	require.NotContains(t, fields, "identity", "a lease certificate names no identity")
	require.NotContains(t, fields, "error")
}

// TestTheAPIListenerClosesALeaseCertificateWhateverItsTLSConfig: the
// listener does not rely on the TLS configuration's check alone. With a
// configuration that lets a lease certificate through the handshake, the
// API listener closes the connection before handing it to the HTTP server
// and counts it the same; the gateway's listener takes it.
func TestTheAPIListenerClosesALeaseCertificateWhateverItsTLSConfig(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t)
	cfg := p.serverTLSConfig(t)
	require.NotNil(t, cfg.VerifyConnection, "the production profile checks")
	cfg.VerifyConnection = nil
	core, logs := observer.New(zapcore.DebugLevel)
	srv, err := New(Config{Addr: ":0", OpsAddr: ":0", TLSConfig: cfg, Broker: &fakeBroker{}, Logger: zap.New(core)})
	require.NoError(t, err)
	lease := leaseCertificate(t, p.ca)

	listen := func(name string) (string, chan net.Conn) {
		tcp, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		ln := srv.newHandshakeListener(tcp, name, withALPN(cfg))
		t.Cleanup(func() { _ = ln.Close() })
		accepted := make(chan net.Conn, 4)
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				accepted <- c
			}
		}()
		return tcp.Addr().String(), accepted
	}
	connect := func(addr string, cert *tls.Certificate) *tls.Conn {
		conn := tls.Client(dialFrom(t, "127.0.0.1", addr), &tls.Config{
			MinVersion: tls.VersionTLS13, RootCAs: p.ca.CertPool(), ServerName: "127.0.0.1",
			GetClientCertificate: presentAlways(cert),
		})
		require.NoError(t, conn.Handshake())
		return conn
	}

	addr, accepted := listen(listenerAPI)
	conn := connect(addr, lease)
	require.True(t, closedByServer(conn, 10*time.Second), "the listener closes it")
	require.Eventually(t, func() bool {
		return testutil.ToFloat64(srv.metrics.handshakes.WithLabelValues(listenerAPI, HandshakeLeaseCertificate)) == 1
	}, 10*time.Second, 5*time.Millisecond)
	require.Eventually(t, func() bool { return testutil.ToFloat64(srv.metrics.openConns.WithLabelValues(listenerAPI)) == 0 },
		10*time.Second, 5*time.Millisecond)
	// What the HTTP server gets next is the peer's connection, not the
	// lease's.
	connect(addr, peerCertificate(t, p.ca, testIdentity))
	select {
	case c := <-accepted:
		st := c.(*tls.Conn).ConnectionState()
		require.False(t, pki.IsLeaseCertificate(st.PeerCertificates[0]))
	case <-time.After(10 * time.Second):
		t.Fatal("the peer's connection was not handed over")
	}
	logged := logs.FilterMessage("TLS handshake failed").FilterField(zap.String("reason", HandshakeLeaseCertificate)).All()
	require.Len(t, logged, 1)
	require.Equal(t, "CN=tokenbroker-lease:"+testLeaseID+",O="+testIdentity, logged[0].ContextMap()["subject"])

	// The gateway's listener (whose own profile verifies lease
	// certificates) is the one that takes it.
	gwAddr, gwAccepted := listen(listenerGateway)
	connect(gwAddr, lease)
	select {
	case c := <-gwAccepted:
		require.True(t, pki.IsLeaseCertificate(c.(*tls.Conn).ConnectionState().PeerCertificates[0]))
	case <-time.After(10 * time.Second):
		t.Fatal("the gateway's listener did not take the lease certificate")
	}
}

func TestHandshakeFailureReasonOfALeaseCertificate(t *testing.T) {
	t.Parallel()
	err := fmt.Errorf("handshake: %w", &pki.LeaseCertificateError{})
	require.Equal(t, HandshakeLeaseCertificate, HandshakeFailureReason(err))
	require.Contains(t, HandshakeReasons(), HandshakeLeaseCertificate)
}
