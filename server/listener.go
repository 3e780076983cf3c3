package server

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/time/rate"

	"github.com/tokenbroker/tokenbroker/pki"
)

// Reasons a TLS handshake failed, the values of the reason label of
// tokenbroker_tls_handshake_failures_total. The set is closed so that a
// client cannot grow it.
const (
	// HandshakeNoCertificate: the mutual-TLS listener asked for a client
	// certificate and got none.
	HandshakeNoCertificate = "no_certificate"
	// HandshakeUnknownAuthority: the client certificate does not chain to
	// the client-CA bundle in force (a peer of another CA, or of a CA
	// dropped at the end of a rotation).
	HandshakeUnknownAuthority = "unknown_authority"
	// HandshakeExpired: the client certificate is expired or not yet
	// valid (a peer whose renewal failed, or a skewed clock).
	HandshakeExpired = "expired"
	// HandshakeWrongUsage: the certificate chains to the bundle but is not
	// for client authentication (a server certificate used as a client's).
	HandshakeWrongUsage = "wrong_usage"
	// HandshakeLeaseCertificate: the client certificate is a lease
	// certificate (pki.IsLeaseCertificate), good at the lease gateway only.
	// It chains to the client-CA bundle when the signing CA is in it, but
	// names no peer identity: were it admitted, no per-identity cap would
	// count its connections. The API profile refuses it in the handshake
	// (pki.RefuseLeaseCertificate); the listener also closes one that a
	// TLS configuration without that check let through, before any request
	// is read.
	HandshakeLeaseCertificate = "lease_certificate"
	// HandshakeProtocolVersion: the client offers no TLS 1.3.
	HandshakeProtocolVersion = "protocol_version"
	// HandshakeRefusedByClient: the client aborted with an alert, usually
	// because it does not trust the server certificate (its ca.crt lacks
	// the CA that signed it).
	HandshakeRefusedByClient = "refused_by_client"
	// HandshakeNotTLS: the first bytes were not TLS (plain HTTP to the TLS
	// port, a scanner).
	HandshakeNotTLS = "not_tls"
	// HandshakeTimeout: the handshake did not finish within
	// Config.HandshakeTimeout (a stalled or slowloris client).
	HandshakeTimeout = "timeout"
	// HandshakeClosed: the client closed the connection before finishing,
	// as TCP health checks of load balancers do; logged at debug level.
	HandshakeClosed = "closed"
	// HandshakeOther is every other failure.
	HandshakeOther = "other"
)

// HandshakeReasons lists every reason label value, in the order of the
// documentation.
func HandshakeReasons() []string {
	return []string{
		HandshakeNoCertificate, HandshakeUnknownAuthority, HandshakeExpired, HandshakeWrongUsage,
		HandshakeLeaseCertificate, HandshakeProtocolVersion, HandshakeRefusedByClient, HandshakeNotTLS,
		HandshakeTimeout, HandshakeClosed, HandshakeOther,
	}
}

// HandshakeFailureReason classifies the error of a failed server-side TLS
// handshake. It prefers the typed errors of crypto/x509 and crypto/tls;
// the two failures crypto/tls reports only as text (no client certificate,
// no common protocol version) are matched on its fixed messages.
func HandshakeFailureReason(err error) string {
	var (
		unknown x509.UnknownAuthorityError
		invalid x509.CertificateInvalidError
		record  tls.RecordHeaderError
		op      *net.OpError
		netErr  net.Error
		lease   *pki.LeaseCertificateError
	)
	switch {
	case err == nil:
		return ""
	case errors.As(err, &lease):
		return HandshakeLeaseCertificate
	case errors.As(err, &unknown):
		return HandshakeUnknownAuthority
	case errors.As(err, &invalid) && invalid.Reason == x509.Expired:
		return HandshakeExpired
	case errors.As(err, &invalid) && invalid.Reason == x509.IncompatibleUsage:
		return HandshakeWrongUsage
	case errors.As(err, &record):
		return HandshakeNotTLS
	case errors.As(err, &op) && op.Op == "remote error":
		// crypto/tls reports an alert from the peer as a *net.OpError
		// with this Op.
		return HandshakeRefusedByClient
	case errors.As(err, &netErr) && netErr.Timeout():
		return HandshakeTimeout
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.ECONNRESET), errors.Is(err, net.ErrClosed):
		return HandshakeClosed
	}
	msg := err.Error()
	switch {
	case strings.Contains(msg, "didn't provide a certificate"):
		return HandshakeNoCertificate
	case strings.Contains(msg, "unsupported versions"), strings.Contains(msg, "protocol version not supported"):
		return HandshakeProtocolVersion
	}
	return HandshakeOther
}

// Handshake failure logging is rate-limited per listener: a scanner or a
// peer in a retry loop must not flood the log. The counter counts every
// failure; the log line after a suppressed stretch says how many it
// skipped.
const (
	handshakeLogEvery = time.Second
	handshakeLogBurst = 10
)

// handshakeListener accepts TCP connections and performs the TLS handshake
// of each in its own goroutine, bounded by a deadline, before it hands the
// connection (a *tls.Conn whose handshake is complete, so that net/http
// sees TLS and skips its own) to the http.Server. Doing the handshake here
// instead of inside net/http is what gives its failures their typed errors:
// net/http reduces them to a line of text in its ErrorLog.
type handshakeListener struct {
	net.Listener
	// admitConn, if set, admits a connection once its handshake is done
	// (the lease gateway's caps per lease and peer, and its record of the
	// lease's connections): release runs at the connection's close; a
	// reason refuses it.
	admitConn func(st tls.ConnectionState, c io.Closer) (release func(), reason, who string)
	cfg       *tls.Config
	name      string
	timeout   time.Duration
	failures  func(listener, reason string)
	refused   func(listener, reason string)
	open      func(listener string, delta float64)
	log       *zap.Logger
	now       func() time.Time

	// perIP bounds the connections of one client address, counted from
	// accept (before the handshake costs anything) to close; perIdentity
	// those of one verified identity, from the handshake to close;
	// handshakesPerIP those of one client address from accept to the end
	// of the handshake.
	perIP, perIdentity, handshakesPerIP *connLimit
	// conns and handshakes are the Server's caps over all its TLS
	// listeners: open connections from accept to close, and connections
	// from accept to the end of their handshake.
	conns, handshakes *connCount
	// handshaking moves the gauge of connections in their handshake.
	handshaking func(listener string, delta float64)
	// refuseLeases closes a connection whose client certificate is a lease
	// certificate right after its handshake, before it takes any place
	// beyond the handshake's: set on every listener but the lease
	// gateway's, whatever its TLS configuration checks.
	refuseLeases bool

	logLimit   *rate.Limiter
	mu         sync.Mutex
	suppressed int

	// ready carries the connections whose handshake succeeded to Accept.
	ready chan net.Conn
	errc  chan error
	// ctx ends when the listener is closed.
	ctx       context.Context
	cancel    context.CancelFunc
	closeOnce sync.Once
	wg        sync.WaitGroup
	// draining is set by drain: the socket is closed on purpose, and
	// Accept keeps handing over the handshakes in progress.
	draining atomic.Bool
}

// newHandshakeListener wraps ln and starts accepting on it; Close stops it.
// cfg is used as is: the caller sets NextProtos.
func (s *Server) newHandshakeListener(ln net.Listener, name string, cfg *tls.Config, opts ...func(*handshakeListener)) *handshakeListener {
	l := &handshakeListener{
		Listener:        ln,
		cfg:             cfg,
		name:            name,
		timeout:         s.cfg.HandshakeTimeout,
		failures:        s.metrics.handshakeFailed,
		refused:         s.metrics.connectionRefused,
		open:            s.metrics.connectionsOpen,
		handshaking:     s.metrics.connectionsHandshaking,
		perIP:           newConnLimit(s.cfg.MaxConnsPerIP),
		handshakesPerIP: newConnLimit(s.cfg.MaxHandshakesPerIP),
		conns:           s.conns,
		handshakes:      s.handshakes,
		log:             s.log.With(zap.String("listener", name)),
		now:             s.cfg.Now,
		logLimit:        rate.NewLimiter(rate.Every(handshakeLogEvery), handshakeLogBurst),
		ready:           make(chan net.Conn),
		errc:            make(chan error, 1),
		refuseLeases:    name != listenerGateway,
	}
	if name == listenerAPI {
		// Only the mutual-TLS listener knows who connects.
		l.perIdentity = newConnLimit(s.cfg.MaxConnsPerIdentity)
	}
	for _, o := range opts {
		o(l)
	}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.wg.Add(1)
	go l.acceptLoop()
	return l
}

// Accept returns the next connection whose handshake succeeded.
func (l *handshakeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ready:
		return c, nil
	case err := <-l.errc:
		return nil, err
	case <-l.ctx.Done():
		return nil, net.ErrClosed
	}
}

// drain closes the socket, so that no new connection is taken, and waits
// until the handshakes in progress are over and their connections handed
// to Accept, or ctx ends: a graceful shutdown serves every connection it
// accepted instead of dropping those still in their handshake. Close
// follows it.
func (l *handshakeListener) drain(ctx context.Context) {
	l.draining.Store(true)
	_ = l.Listener.Close()
	done := make(chan struct{})
	go func() { l.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
	}
}

// Close stops accepting, closes the socket and waits for the handshakes in
// progress, closing their connections.
func (l *handshakeListener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		l.cancel()
		err = l.Listener.Close()
		if l.draining.Load() && errors.Is(err, net.ErrClosed) {
			err = nil // drain closed it
		}
		l.wg.Wait()
	})
	return err
}

func (l *handshakeListener) acceptLoop() {
	defer l.wg.Done()
	var backoff time.Duration
	for {
		raw, err := l.Listener.Accept()
		if err != nil && l.draining.Load() {
			return // the socket closed by drain: nothing for Accept to report
		}
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, syscall.ECONNABORTED) {
				// Out of file descriptors and the like: wait a little and
				// go on, as net/http does.
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				select {
				case <-time.After(backoff):
					continue
				case <-l.ctx.Done():
					return
				}
			}
			select {
			case l.errc <- err:
			case <-l.ctx.Done():
			}
			return
		}
		backoff = 0
		c, handshakeDone, reason := l.admit(raw)
		if reason != "" {
			// Counted, then closed before any TLS state exists for it: a
			// refused connection costs its socket for this long only. (In
			// this order, whoever sees the close sees the count.)
			l.refuse(reason, raw.RemoteAddr(), "")
			_ = raw.Close()
			continue
		}
		l.wg.Add(1)
		go l.handshake(c, handshakeDone)
	}
}

// admit takes a connection's places under the caps, the client address's
// own first so that a greedy address is refused as such: open connections
// and handshakes of its address, then of all listeners. It returns the
// tracked connection, which gives back its places on close, and the
// function to call once when its handshake is over, which gives back its
// handshake places; or the reason it is refused, having taken nothing.
func (l *handshakeListener) admit(raw net.Conn) (*trackedConn, func(), string) {
	ip := hostOf(raw.RemoteAddr())
	if !l.perIP.acquire(ip) {
		return nil, nil, ConnRefusedPerIP
	}
	if !l.handshakesPerIP.acquire(ip) {
		l.perIP.release(ip)
		return nil, nil, ConnRefusedPerIPHandshakes
	}
	if !l.conns.acquire() {
		l.handshakesPerIP.release(ip)
		l.perIP.release(ip)
		return nil, nil, ConnRefusedConns
	}
	if !l.handshakes.acquire() {
		l.conns.release()
		l.handshakesPerIP.release(ip)
		l.perIP.release(ip)
		return nil, nil, ConnRefusedHandshakes
	}

	c := &trackedConn{Conn: raw}
	c.onClose(func() { l.perIP.release(ip) })
	c.onClose(l.conns.release)
	l.open(l.name, 1)
	c.onClose(func() { l.open(l.name, -1) })
	l.handshaking(l.name, 1)
	handshakeDone := func() {
		l.handshakesPerIP.release(ip)
		l.handshakes.release()
		l.handshaking(l.name, -1)
	}
	return c, handshakeDone, ""
}

// handshake runs the TLS handshake of raw and hands the connection to
// Accept; handshakeDone gives back its handshake places once the handshake
// is over, whatever its outcome.
func (l *handshakeListener) handshake(raw *trackedConn, handshakeDone func()) {
	defer l.wg.Done()
	conn := tls.Server(raw, l.cfg)
	// HandshakeContext closes the connection when ctx ends: at the
	// timeout, or when the listener is closed.
	ctx, cancel := context.WithTimeout(l.ctx, l.timeout)
	err := conn.HandshakeContext(ctx)
	cancel()
	handshakeDone()
	if err != nil {
		_ = raw.Close()
		if l.ctx.Err() == nil {
			l.failed(raw.RemoteAddr(), err)
		}
		return
	}
	if l.refuseLeases {
		// pki.ServerTLSConfig refused it in the handshake already; this
		// is for a configuration without that check. No place beyond the
		// handshake's, and the same count and log line.
		if st := conn.ConnectionState(); len(st.PeerCertificates) > 0 && pki.IsLeaseCertificate(st.PeerCertificates[0]) {
			l.failed(raw.RemoteAddr(), &pki.LeaseCertificateError{Certificate: st.PeerCertificates[0]})
			_ = conn.Close()
			return
		}
	}
	if l.admitConn != nil {
		release, reason, who := l.admitConn(conn.ConnectionState(), raw)
		if reason != "" {
			l.refuse(reason, raw.RemoteAddr(), who)
			_ = conn.Close()
			return
		}
		raw.onClose(release)
	}
	if l.perIdentity != nil {
		if id := peerIdentity(conn.ConnectionState()); id != "" {
			if !l.perIdentity.acquire(id) {
				l.refuse(ConnRefusedPerIdentity, raw.RemoteAddr(), id)
				_ = conn.Close()
				return
			}
			raw.onClose(func() { l.perIdentity.release(id) })
		}
	}
	select {
	case l.ready <- conn:
	case <-l.ctx.Done():
		_ = conn.Close()
	}
}

// peerIdentity is the SPIFFE identity of the verified client certificate,
// or "" (a certificate without one is refused by the authentication
// middleware with 401 and not counted per identity; a lease certificate,
// which names none either, never gets this far). A pod certificate counts
// under its workload identity, apart from its cluster's agent.
func peerIdentity(st tls.ConnectionState) string {
	if len(st.PeerCertificates) == 0 {
		return ""
	}
	id, pod, err := chainIdentity(st.PeerCertificates[0], st.VerifiedChains)
	switch {
	case err != nil:
		// Not counted as what it names: the middleware refuses it.
		return ""
	case pod != nil:
		return pod.Identity
	}
	return id
}

// refuse counts a connection refused over a cap and logs it, rate-limited
// with the handshake failures.
func (l *handshakeListener) refuse(reason string, remote net.Addr, identity string) {
	l.refused(l.name, reason)
	fields := []zap.Field{zap.String("reason", reason), zap.String("remote", addrString(remote))}
	if identity != "" {
		fields = append(fields, zap.String("identity", identity))
	}
	l.logLimited(zapcore.WarnLevel, "connection refused: too many connections", fields)
}

// failed counts a failed handshake and logs it, unless too many were
// logged lately. The log carries the remote address and, for a refused
// certificate, its subject and SPIFFE ID, nothing else of it.
func (l *handshakeListener) failed(remote net.Addr, err error) {
	reason := HandshakeFailureReason(err)
	l.failures(l.name, reason)
	level := zapcore.WarnLevel
	if reason == HandshakeClosed {
		level = zapcore.DebugLevel
	}
	fields := []zap.Field{zap.String("reason", reason), zap.String("remote", addrString(remote))}
	var (
		verr  *tls.CertificateVerificationError
		lease *pki.LeaseCertificateError
	)
	if errors.As(err, &lease) && lease.Certificate != nil {
		// Its subject names the lease and the peer it was issued to:
		// whose lease certificate is knocking at the API.
		fields = append(fields, zap.String("subject", lease.Certificate.Subject.String()))
	} else if errors.As(err, &verr) && len(verr.UnverifiedCertificates) > 0 {
		leaf := verr.UnverifiedCertificates[0]
		fields = append(fields, zap.String("subject", leaf.Subject.String()))
		if id, err := pki.IdentityFromCert(leaf); err == nil {
			fields = append(fields, zap.String("identity", id))
		}
	}
	if reason == HandshakeOther {
		// The x509 errors name certificates' contents; the other
		// reasons are fully said by their label.
		fields = append(fields, zap.Error(err))
	}
	l.logLimited(level, "TLS handshake failed", fields)
}

// logLimited writes a log line unless the listener's log budget is spent;
// the next line written says how many were skipped.
func (l *handshakeListener) logLimited(level zapcore.Level, msg string, fields []zap.Field) {
	if !l.log.Core().Enabled(level) {
		return
	}
	l.mu.Lock()
	if !l.logLimit.AllowN(l.now(), 1) {
		l.suppressed++
		l.mu.Unlock()
		return
	}
	suppressed := l.suppressed
	l.suppressed = 0
	l.mu.Unlock()
	if suppressed > 0 {
		fields = append(fields, zap.Int("suppressed", suppressed))
	}
	if ce := l.log.Check(level, msg); ce != nil {
		ce.Write(fields...)
	}
}

// hostOf is the IP of a remote address, the key of the per-address cap.
func hostOf(a net.Addr) string {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.IP.String()
	}
	host, _, err := net.SplitHostPort(addrString(a))
	if err != nil {
		return addrString(a)
	}
	return host
}

// Reasons a connection is refused over a cap, the values of the reason
// label of tokenbroker_connections_refused_total.
const (
	// ConnRefusedPerIP: the client address has Config.MaxConnsPerIP open
	// connections (handshakes included); closed before the handshake.
	ConnRefusedPerIP = "per_ip"
	// ConnRefusedPerIdentity: the verified identity has
	// Config.MaxConnsPerIdentity open connections; closed after the
	// handshake, before any request is read.
	ConnRefusedPerIdentity = "per_identity"
	// ConnRefusedPerIPHandshakes: the client address has
	// Config.MaxHandshakesPerIP connections in their TLS handshake on the
	// listener; closed before the handshake.
	ConnRefusedPerIPHandshakes = "per_ip_handshakes"
	// ConnRefusedConns: the TLS listeners together have Config.MaxConns
	// open connections; closed before the handshake.
	ConnRefusedConns = "conns"
	// ConnRefusedHandshakes: the TLS listeners together have
	// Config.MaxHandshakes connections in their TLS handshake; closed
	// before the handshake.
	ConnRefusedHandshakes = "handshakes"
)

// ConnRefusedReasons lists every reason label value of
// tokenbroker_connections_refused_total, in the order of the documentation
// (and of the checks: a client address's own caps come first).
func ConnRefusedReasons() []string {
	return []string{ConnRefusedPerIP, ConnRefusedPerIPHandshakes, ConnRefusedConns, ConnRefusedHandshakes, ConnRefusedPerIdentity}
}

// connCount counts the connections of all TLS listeners against one cap.
type connCount struct {
	max int64
	n   atomic.Int64
}

func newConnCount(max int) *connCount { return &connCount{max: int64(max)} }

func (c *connCount) acquire() bool {
	if c.n.Add(1) > c.max {
		c.n.Add(-1)
		return false
	}
	return true
}

func (c *connCount) release() { c.n.Add(-1) }

// connLimit counts open connections by key and refuses one over max.
type connLimit struct {
	max  int
	mu   sync.Mutex
	open map[string]int
}

func newConnLimit(max int) *connLimit { return &connLimit{max: max, open: map[string]int{}} }

func (c *connLimit) acquire(key string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.open[key] >= c.max {
		return false
	}
	c.open[key]++
	return true
}

func (c *connLimit) release(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.open[key]--; c.open[key] <= 0 {
		delete(c.open, key) // the map holds only keys with open connections
	}
}

// trackedConn is the TCP connection under a TLS one; closing it (which
// closing the TLS connection does) runs the releases once.
type trackedConn struct {
	net.Conn
	mu       sync.Mutex
	closed   bool
	releases []func()
}

// onClose adds a release; if the connection is already closed, it runs
// at once.
func (c *trackedConn) onClose(f func()) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		f()
		return
	}
	c.releases = append(c.releases, f)
	c.mu.Unlock()
}

func (c *trackedConn) Close() error {
	err := c.Conn.Close()
	c.mu.Lock()
	releases := c.releases
	c.releases, c.closed = nil, true
	c.mu.Unlock()
	for _, f := range releases {
		f()
	}
	return err
}

func addrString(a net.Addr) string {
	if a == nil {
		return ""
	}
	return a.String()
}
