package server

import (
	"crypto/tls"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
)

// watchedConn is the server's end of a connection, telling the test when
// the listener first reads from it (its TLS handshake has begun) and when
// the listener closes it.
type watchedConn struct {
	net.Conn
	readOnce, closeOnce sync.Once
	read, closed        chan struct{}
}

func (c *watchedConn) Read(p []byte) (int, error) {
	c.readOnce.Do(func() { close(c.read) })
	return c.Conn.Read(p)
}

func (c *watchedConn) Close() error {
	err := c.Conn.Close()
	c.closeOnce.Do(func() { close(c.closed) })
	return err
}

// watchingListener hands every accepted connection, watched, to the test
// as well as to the handshake listener.
type watchingListener struct {
	net.Listener
	accepted chan *watchedConn
}

func (l *watchingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	w := &watchedConn{Conn: c, read: make(chan struct{}), closed: make(chan struct{})}
	l.accepted <- w
	return w, nil
}

// capsHarness is a handshake listener on a loopback socket, with the caps
// the test sets and timeouts far beyond the test, so that a handshake ends
// only when the test ends it.
type capsHarness struct {
	t         *testing.T
	srv       *Server
	ln        *handshakeListener
	addr      string
	accepted  chan *watchedConn
	clientTLS *tls.Config
}

func newCapsHarness(t *testing.T, caps func(*Config)) *capsHarness {
	t.Helper()
	p := newTestPKI(t)
	cfg := Config{
		Addr: ":0", OpsAddr: ":0", TLSConfig: p.serverTLSConfig(t), Broker: &fakeBroker{},
		HandshakeTimeout: time.Hour, ReadHeaderTimeout: 2 * time.Hour,
	}
	caps(&cfg)
	srv, err := New(cfg)
	require.NoError(t, err)
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	accepted := make(chan *watchedConn, 64)
	ln := srv.newHandshakeListener(&watchingListener{Listener: tcp, accepted: accepted}, listenerAPI, withALPN(srv.cfg.TLSConfig))
	t.Cleanup(func() { _ = ln.Close() })
	cert, err := p.client.TLSCertificate()
	require.NoError(t, err)
	return &capsHarness{
		t: t, srv: srv, ln: ln, addr: tcp.Addr().String(), accepted: accepted,
		clientTLS: &tls.Config{
			MinVersion: tls.VersionTLS13, RootCAs: p.ca.CertPool(), ServerName: "127.0.0.1",
			Certificates: []tls.Certificate{cert},
		},
	}
}

// connect opens a connection from the loopback address src and returns it
// with the server's end once the listener has either begun its handshake
// (admitted) or closed it (refused). A refused connection must never have
// been read: no TLS state was made for it.
func (h *capsHarness) connect(src string) (client net.Conn, server *watchedConn, admitted bool) {
	h.t.Helper()
	client = dialFrom(h.t, src, h.addr)
	select {
	case server = <-h.accepted:
	case <-time.After(10 * time.Second):
		h.t.Fatal("the listener did not accept the connection")
	}
	select {
	case <-server.read:
		return client, server, true
	case <-server.closed:
		select {
		case <-server.read:
			h.t.Fatal("a refused connection was read from")
		default:
		}
		return client, server, false
	case <-time.After(10 * time.Second):
		h.t.Fatal("the listener neither began a handshake nor closed the connection")
	}
	return nil, nil, false
}

// stall opens a connection that never sends a byte and requires that it
// was admitted (wantReason "") or refused for wantReason.
func (h *capsHarness) stall(src, wantReason string) (client net.Conn, server *watchedConn) {
	h.t.Helper()
	before := h.refused(wantReason)
	client, server, admitted := h.connect(src)
	if wantReason == "" {
		require.True(h.t, admitted, "a stalled connection from %s must be admitted", src)
		return client, server
	}
	require.False(h.t, admitted, "a stalled connection from %s must be refused (%s)", src, wantReason)
	require.Equal(h.t, before+1, h.refused(wantReason), "refused for %s", wantReason)
	return client, server
}

// establish completes a handshake from src as the test peer and returns
// both ends of the connection.
func (h *capsHarness) establish(src string) (client *tls.Conn, server net.Conn) {
	h.t.Helper()
	raw, _, admitted := h.connect(src)
	require.True(h.t, admitted, "a connection from %s must be admitted", src)
	client = tls.Client(raw, h.clientTLS)
	require.NoError(h.t, client.Handshake())
	server, err := h.ln.Accept()
	require.NoError(h.t, err)
	return client, server
}

// endStall closes the client's end of a stalled handshake and waits until
// the listener has closed its own, which it does after giving back the
// handshake's places (the connection's own places follow the close).
func (h *capsHarness) endStall(client net.Conn, server *watchedConn) {
	h.t.Helper()
	require.NoError(h.t, client.Close())
	select {
	case <-server.closed:
	case <-time.After(10 * time.Second):
		h.t.Fatal("the listener did not end the handshake")
	}
}

func (h *capsHarness) refused(reason string) float64 {
	if reason == "" {
		return 0
	}
	return testutil.ToFloat64(h.srv.metrics.refused.WithLabelValues(listenerAPI, reason))
}

func (h *capsHarness) gauges() (open, handshaking float64) {
	return testutil.ToFloat64(h.srv.metrics.openConns.WithLabelValues(listenerAPI)),
		testutil.ToFloat64(h.srv.metrics.inHandshake.WithLabelValues(listenerAPI))
}

func TestTheHandshakeCapRefusesNewConnectionsBeforeAnyTLSState(t *testing.T) {
	t.Parallel()
	h := newCapsHarness(t, func(c *Config) { c.MaxHandshakes = 2 })

	first, firstServer := h.stall("127.0.0.2", "")
	h.stall("127.0.0.3", "")
	h.stall("127.0.0.4", ConnRefusedHandshakes)
	// A well-behaved peer's new connection is refused as well while the
	// cap is full: the cap bounds memory, not who gets in.
	h.stall("127.0.0.5", ConnRefusedHandshakes)
	open, handshaking := h.gauges()
	require.Equal(t, 2.0, open)
	require.Equal(t, 2.0, handshaking)

	// A handshake that ends gives its place back; an established
	// connection holds none.
	h.endStall(first, firstServer)
	h.establish("127.0.0.5")
	h.stall("127.0.0.6", "")
	h.stall("127.0.0.7", ConnRefusedHandshakes)
	_, handshaking = h.gauges()
	require.Equal(t, 2.0, handshaking, "two handshakes; the established connection is not one")

	require.NoError(t, testutil.CollectAndCompare(h.srv.metrics.refused, strings.NewReader(`
# HELP tokenbroker_connections_refused_total Connections closed unanswered over a cap, by listener and reason (per_ip, per_ip_handshakes, conns, handshakes, per_identity).
# TYPE tokenbroker_connections_refused_total counter
tokenbroker_connections_refused_total{listener="api",reason="handshakes"} 3
`)))
}

func TestTheHandshakeCapPerAddressLeavesOtherAddressesIn(t *testing.T) {
	t.Parallel()
	h := newCapsHarness(t, func(c *Config) { c.MaxHandshakesPerIP = 2 })

	// Finished handshakes do not count against the address.
	h.establish("127.0.0.2")
	h.establish("127.0.0.2")
	h.stall("127.0.0.2", "")
	h.stall("127.0.0.2", "")
	h.stall("127.0.0.2", ConnRefusedPerIPHandshakes)
	h.stall("127.0.0.3", "")
	h.establish("127.0.0.3")
	h.stall("127.0.0.3", "")
	h.stall("127.0.0.3", ConnRefusedPerIPHandshakes)
	open, handshaking := h.gauges()
	require.Equal(t, 7.0, open)
	require.Equal(t, 4.0, handshaking)
}

func TestTheConnectionCapCountsEstablishedConnectionsAndHandshakes(t *testing.T) {
	t.Parallel()
	h := newCapsHarness(t, func(c *Config) { c.MaxConns = 3 })

	_, kept := h.establish("127.0.0.2")
	h.establish("127.0.0.3")
	h.stall("127.0.0.4", "")
	h.stall("127.0.0.5", ConnRefusedConns)
	_, _, admitted := h.connect("127.0.0.6")
	require.False(t, admitted, "a peer's new connection waits for a place")
	require.Equal(t, 2.0, h.refused(ConnRefusedConns))

	// Closing a connection gives its place back at once.
	require.NoError(t, kept.Close())
	open, handshaking := h.gauges()
	require.Equal(t, 2.0, open)
	require.Equal(t, 1.0, handshaking)
	h.establish("127.0.0.6")
}

func TestAnAddressOverItsOwnCapIsRefusedAsSuch(t *testing.T) {
	t.Parallel()
	// With every cap at one, the second connection of an address is over
	// its own caps and over the listener's: the address's are named.
	h := newCapsHarness(t, func(c *Config) {
		c.MaxConnsPerIP, c.MaxHandshakesPerIP, c.MaxConns, c.MaxHandshakes = 1, 1, 1, 1
	})
	h.stall("127.0.0.2", "")
	h.stall("127.0.0.2", ConnRefusedPerIP)
	h.stall("127.0.0.3", ConnRefusedConns)

	h2 := newCapsHarness(t, func(c *Config) { c.MaxHandshakesPerIP, c.MaxHandshakes = 1, 1 })
	h2.stall("127.0.0.2", "")
	h2.stall("127.0.0.2", ConnRefusedPerIPHandshakes)
	h2.stall("127.0.0.3", ConnRefusedHandshakes)
}

func TestTheCapsAreSharedByTheTLSListeners(t *testing.T) {
	t.Parallel()
	h := newCapsHarness(t, func(c *Config) { c.MaxConns, c.MaxHandshakes = 2, 2 })
	h.stall("127.0.0.2", "")

	// A second listener of the same server (the enrollment listener)
	// takes places under the same caps.
	tcp, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	enroll := &capsHarness{t: t, srv: h.srv, addr: tcp.Addr().String(), accepted: make(chan *watchedConn, 8)}
	enroll.ln = h.srv.newHandshakeListener(&watchingListener{Listener: tcp, accepted: enroll.accepted}, listenerEnroll, withALPN(h.srv.cfg.TLSConfig))
	t.Cleanup(func() { _ = enroll.ln.Close() })
	_, _, admitted := enroll.connect("127.0.0.3")
	require.True(t, admitted)
	_, _, admitted = enroll.connect("127.0.0.4")
	require.False(t, admitted)
	require.Equal(t, 1.0, testutil.ToFloat64(h.srv.metrics.refused.WithLabelValues(listenerEnroll, ConnRefusedConns)))
	h.stall("127.0.0.5", ConnRefusedConns)
}
