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
	// HandshakeProtocolVersion: the client offers no TLS 1.3.
	HandshakeProtocolVersion = "protocol_version"
	// HandshakeRefusedByClient: the client aborted with an alert, usually
	// because it does not trust the server certificate (its ca.crt lacks
	// the CA that signed it).
	HandshakeRefusedByClient = "refused_by_client"
	// HandshakeNotTLS: the first bytes were not TLS (plain HTTP to the TLS
	// port, a scanner).
	HandshakeNotTLS = "not_tls"
	// HandshakeTimeout: the handshake did not finish within the header
	// timeout (a stalled or slowloris client).
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
		HandshakeProtocolVersion, HandshakeRefusedByClient, HandshakeNotTLS, HandshakeTimeout,
		HandshakeClosed, HandshakeOther,
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
	)
	switch {
	case err == nil:
		return ""
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
	cfg      *tls.Config
	name     string
	timeout  time.Duration
	failures func(listener, reason string)
	log      *zap.Logger
	now      func() time.Time

	logLimit   *rate.Limiter
	mu         sync.Mutex
	suppressed int

	conns chan net.Conn
	errc  chan error
	// ctx ends when the listener is closed.
	ctx       context.Context
	cancel    context.CancelFunc
	closeOnce sync.Once
	wg        sync.WaitGroup
}

// newHandshakeListener wraps ln and starts accepting on it; Close stops it.
// cfg is used as is: the caller sets NextProtos.
func (s *Server) newHandshakeListener(ln net.Listener, name string, cfg *tls.Config) *handshakeListener {
	l := &handshakeListener{
		Listener: ln,
		cfg:      cfg,
		name:     name,
		timeout:  s.cfg.ReadHeaderTimeout,
		failures: s.metrics.handshakeFailed,
		log:      s.log.With(zap.String("listener", name)),
		now:      s.cfg.Now,
		logLimit: rate.NewLimiter(rate.Every(handshakeLogEvery), handshakeLogBurst),
		conns:    make(chan net.Conn),
		errc:     make(chan error, 1),
	}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.wg.Add(1)
	go l.acceptLoop()
	return l
}

// Accept returns the next connection whose handshake succeeded.
func (l *handshakeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case err := <-l.errc:
		return nil, err
	case <-l.ctx.Done():
		return nil, net.ErrClosed
	}
}

// Close stops accepting, closes the socket and waits for the handshakes in
// progress, closing their connections.
func (l *handshakeListener) Close() error {
	var err error
	l.closeOnce.Do(func() {
		l.cancel()
		err = l.Listener.Close()
		l.wg.Wait()
	})
	return err
}

func (l *handshakeListener) acceptLoop() {
	defer l.wg.Done()
	var backoff time.Duration
	for {
		raw, err := l.Listener.Accept()
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
		l.wg.Add(1)
		go l.handshake(raw)
	}
}

func (l *handshakeListener) handshake(raw net.Conn) {
	defer l.wg.Done()
	conn := tls.Server(raw, l.cfg)
	// HandshakeContext closes the connection when ctx ends: at the
	// timeout, or when the listener is closed.
	ctx, cancel := context.WithTimeout(l.ctx, l.timeout)
	err := conn.HandshakeContext(ctx)
	cancel()
	if err != nil {
		_ = raw.Close()
		if l.ctx.Err() == nil {
			l.failed(raw.RemoteAddr(), err)
		}
		return
	}
	select {
	case l.conns <- conn:
	case <-l.ctx.Done():
		_ = conn.Close()
	}
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

	fields := []zap.Field{zap.String("reason", reason), zap.String("remote", addrString(remote))}
	var verr *tls.CertificateVerificationError
	if errors.As(err, &verr) && len(verr.UnverifiedCertificates) > 0 {
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
	if suppressed > 0 {
		fields = append(fields, zap.Int("suppressed", suppressed))
	}
	if ce := l.log.Check(level, "TLS handshake failed"); ce != nil {
		ce.Write(fields...)
	}
}

func addrString(a net.Addr) string {
	if a == nil {
		return ""
	}
	return a.String()
}
