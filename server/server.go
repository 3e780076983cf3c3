package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/go-chi/chi/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/tokenbroker/tokenbroker/server/gateway"
)

// Server serves the tokenbroker API over mutual TLS, enrollment (when
// configured) over TLS without client certificates, and the operations
// endpoints over plain HTTP. Make one with New and start it with Run.
type Server struct {
	cfg         Config
	log         *zap.Logger
	broker      Broker
	certs       CertificateIssuer
	revocations RevocationChecker
	refusals    RefusalAuditor
	workloads   WorkloadAuthenticator
	metrics     *httpMetrics
	// conns and handshakes are the caps of Config.MaxConns and
	// Config.MaxHandshakes, shared by the TLS listeners.
	conns, handshakes *connCount
	// router is the API listener's route table, enrollRouter the
	// enrollment listener's; both are built from routeTable.
	router       *chi.Mux
	enrollRouter *chi.Mux
	api          http.Handler
	enroll       http.Handler
	ops          http.Handler

	// draining is set once Run starts shutting down, so /readyz tells load
	// balancers to stop sending new requests while in-flight ones finish.
	draining atomic.Bool
	// instance names this process on the operations listener
	// (InstanceHeader).
	instance string

	mu      sync.Mutex
	started bool
	// bound are the listeners' addresses, set once Run has bound them.
	bound     boundAddrs
	listening chan struct{}
}

// boundAddrs are the bound addresses of the listeners; nil for one not
// bound (yet, or ever: enrollment and the gateway are optional).
type boundAddrs struct {
	api, enroll, gateway, ops net.Addr
}

// New checks cfg, fills in defaults, registers the HTTP metrics on
// cfg.Registerer and builds the handlers. It opens no socket; Run does.
func New(cfg Config) (*Server, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	m, err := newHTTPMetrics(cfg.Registerer)
	if err != nil {
		return nil, fmt.Errorf("register http metrics: %w", err)
	}
	s := &Server{
		cfg:        cfg,
		log:        cfg.Logger,
		broker:     cfg.Broker,
		metrics:    m,
		conns:      newConnCount(cfg.MaxConns),
		handshakes: newConnCount(cfg.MaxHandshakes),
		listening:  make(chan struct{}),
		instance:   newInstanceID(),
	}
	// Optional abilities of the broker.
	s.certs, _ = cfg.Broker.(CertificateIssuer)
	s.revocations, _ = cfg.Broker.(RevocationChecker)
	s.refusals, _ = cfg.Broker.(RefusalAuditor)
	s.workloads, _ = cfg.Broker.(WorkloadAuthenticator)
	s.router = s.routes(listenerAPI)
	s.enrollRouter = s.routes(listenerEnroll)
	s.api = s.chain(listenerAPI, s.router)
	s.enroll = s.chain(listenerEnroll, s.enrollRouter)
	s.ops = s.opsRoutes()
	return s, nil
}

// Handler returns the API handler with the whole middleware chain. It
// expects the request's TLS state to carry a verified client certificate,
// as the mutual-TLS listener provides.
func (s *Server) Handler() http.Handler { return s.api }

// EnrollHandler returns the handler of the enrollment listener: POST
// /v1/certificates with a join token and GET /v1/trust-bundle, nothing
// else.
func (s *Server) EnrollHandler() http.Handler { return s.enroll }

// OpsHandler returns the handler of the operations listener: /healthz,
// /readyz and /metrics.
func (s *Server) OpsHandler() http.Handler { return s.ops }

// Addr returns the bound address of the API listener, or nil before Run has
// bound it (see Listening).
func (s *Server) Addr() net.Addr { return s.boundAddrs().api }

// EnrollAddr returns the bound address of the enrollment listener, or nil
// before Run has bound it or when enrollment is not configured.
func (s *Server) EnrollAddr() net.Addr { return s.boundAddrs().enroll }

// GatewayAddr returns the bound address of the lease gateway's listener,
// or nil before Run has bound it or without a gateway.
func (s *Server) GatewayAddr() net.Addr { return s.boundAddrs().gateway }

// OpsAddr returns the bound address of the operations listener, or nil
// before Run has bound it.
func (s *Server) OpsAddr() net.Addr { return s.boundAddrs().ops }

func (s *Server) boundAddrs() boundAddrs {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.bound
}

// Listening returns a channel that is closed once Run has bound all
// listeners; Addr, OpsAddr and (if configured) EnrollAddr are then non-nil.
// If binding fails the channel is never closed and Run returns the error,
// so wait on it together with Run's return (or a context that ends when Run
// does).
func (s *Server) Listening() <-chan struct{} { return s.listening }

// serving is one listener with its http.Server.
type serving struct {
	name string
	ln   net.Listener
	srv  *http.Server
}

// withALPN returns a copy of cfg offering HTTP/2 and HTTP/1.1 unless it
// names its own protocols, as http.Server.ServeTLS would. A configuration
// chosen per connection (GetConfigForClient) decides for itself.
func withALPN(cfg *tls.Config) *tls.Config {
	c := cfg.Clone()
	if len(c.NextProtos) == 0 {
		c.NextProtos = []string{"h2", "http/1.1"}
	}
	return c
}

// Run serves until ctx is cancelled or a listener fails, then shuts down
// gracefully: it stops accepting connections, reports not-ready, lets
// in-flight requests finish within Config.ShutdownGrace and then closes what
// remains. It returns nil after a clean shutdown. Run may be called once.
func (s *Server) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.started {
		s.mu.Unlock()
		return errors.New("server: Run called more than once")
	}
	s.started = true
	s.mu.Unlock()

	lns, err := s.listen()
	if err != nil {
		return err
	}
	// Serve closes the listeners on shutdown; these cover a Serve that
	// failed before taking them over.
	defer lns.close()
	s.mu.Lock()
	s.bound.api, s.bound.ops = lns.api.Addr(), lns.ops.Addr()
	if lns.enroll != nil {
		s.bound.enroll = lns.enroll.Addr()
	}
	if lns.gateway != nil {
		s.bound.gateway = lns.gateway.Addr()
	}
	s.mu.Unlock()
	close(s.listening)

	// Requests must not be cancelled by ctx, or shutting down would abort
	// the in-flight requests it promises to let finish; baseCtx is
	// cancelled only when the grace period is over.
	baseCtx, cancelBase := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelBase()

	// In shutdown order: the API listeners first, so /readyz keeps
	// answering "shutting down" while requests drain.
	// The TLS listeners do the handshake themselves (handshakeListener),
	// so that its failures are counted by reason.
	servers := []serving{{name: listenerAPI, ln: s.newHandshakeListener(lns.api, listenerAPI, withALPN(s.cfg.TLSConfig)),
		srv: s.httpServer(s.api, baseCtx, listenerAPI)}}
	if lns.enroll != nil {
		servers = append(servers, serving{name: listenerEnroll, ln: s.newHandshakeListener(lns.enroll, listenerEnroll, withALPN(s.cfg.EnrollTLSConfig)),
			srv: s.httpServer(s.enroll, baseCtx, listenerEnroll)})
	}
	if lns.gateway != nil {
		hl := s.newHandshakeListener(lns.gateway, listenerGateway, s.cfg.GatewayTLSConfig, func(l *handshakeListener) {
			l.admitConn = s.cfg.Gateway.AdmitConn
			// Caps of its own: the gateway's long-lived connections must
			// not take the places of the API listener, where leases are
			// revoked.
			l.conns, l.handshakes = newConnCount(s.cfg.MaxConns), newConnCount(s.cfg.MaxHandshakes)
		})
		servers = append(servers, serving{name: listenerGateway, ln: hl, srv: s.gatewayServer(baseCtx)})
	}
	servers = append(servers, serving{name: "ops", ln: lns.ops, srv: s.httpServer(s.ops, baseCtx, "ops")})

	errc := make(chan error, len(servers))
	fields := make([]zap.Field, 0, len(servers))
	for _, sv := range servers {
		go func() { errc <- serveErr(sv.name, sv.srv.Serve(sv.ln)) }()
		fields = append(fields, zap.Stringer(sv.name, sv.ln.Addr()))
	}
	s.log.Info("listening", fields...)

	var errs []error
	pending := len(servers)
	select {
	case <-ctx.Done():
	case err := <-errc:
		pending--
		errs = append(errs, err)
	}

	s.draining.Store(true)
	for _, sv := range servers {
		if sv.name != "ops" {
			sv.srv.SetKeepAlivesEnabled(false) // move peers off while the listeners drain
		}
	}
	s.drainDelay(lns.ops.Addr())
	if s.cfg.Gateway != nil {
		// Watches and streams never end by themselves: end them, so that
		// their clients reconnect to another replica now rather than at
		// the grace period's end.
		s.cfg.Gateway.CloseAll()
	}
	s.log.Info("shutting down", zap.Duration("grace", s.cfg.ShutdownGrace))
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.ShutdownGrace)
	defer cancel()
	// The TLS listeners take no new connection, and hand the ones still in
	// their handshake to their servers, which serve them before they shut
	// down.
	for _, sv := range servers {
		if hl, ok := sv.ln.(*handshakeListener); ok {
			hl.drain(shutdownCtx)
		}
	}
	for _, sv := range servers {
		if err := sv.srv.Shutdown(shutdownCtx); err != nil {
			errs = append(errs, fmt.Errorf("shut down %s listener: %w", sv.name, err))
		}
	}
	// The last answers may have left credential-id annotations and claims
	// to write: wait for them within the same grace.
	if bw, ok := s.broker.(BackgroundWriter); ok {
		if err := bw.WaitWritesAfterAnswers(shutdownCtx); err != nil {
			s.log.Warn("shut down before every write after an answer was made: a credential id missing from its lease Secret is in the issuance's audit event; an unclaimed gateway lease's certificate is good for nothing, and its pooled Secret goes at its deadline", zap.Error(err))
		}
	}
	if shutdownCtx.Err() != nil {
		cancelBase()
		for _, sv := range servers {
			_ = sv.srv.Close() // the grace period is over; the error says no more than that
		}
	}
	for ; pending > 0; pending-- {
		errs = append(errs, <-errc)
	}
	return errors.Join(errs...)
}

// listeners are the sockets Run serves; enroll is nil when enrollment is
// not configured.
type listeners struct {
	api, enroll, gateway, ops net.Listener
}

func (l listeners) close() {
	for _, ln := range []net.Listener{l.api, l.enroll, l.gateway, l.ops} {
		if ln != nil {
			_ = ln.Close()
		}
	}
}

// listen returns the configured listeners or opens them. On failure nothing
// stays open.
func (s *Server) listen() (lns listeners, err error) {
	lns = listeners{api: s.cfg.Listener, enroll: s.cfg.EnrollListener, gateway: s.cfg.GatewayListener, ops: s.cfg.OpsListener}
	open := func(ln *net.Listener, name, addr string) error {
		if *ln != nil || addr == "" {
			return nil
		}
		lc := listenConfig(s.cfg.ReusePort)
		l, err := lc.Listen(context.Background(), "tcp", addr)
		if err != nil {
			return fmt.Errorf("listen on %s address %q: %w", name, addr, err)
		}
		*ln = l
		return nil
	}
	for _, o := range []struct {
		ln         *net.Listener
		name, addr string
	}{
		{&lns.api, listenerAPI, s.cfg.Addr},
		{&lns.enroll, listenerEnroll, s.cfg.EnrollAddr},
		{&lns.gateway, listenerGateway, s.cfg.GatewayAddr},
		{&lns.ops, "ops", s.cfg.OpsAddr},
	} {
		if err := open(o.ln, o.name, o.addr); err != nil {
			lns.close()
			return listeners{}, err
		}
	}
	return lns, nil
}

func (s *Server) httpServer(h http.Handler, base context.Context, name string) *http.Server {
	errLog, err := zap.NewStdLogAt(s.log.With(zap.String("listener", name)), zapcore.WarnLevel)
	if err != nil {
		// Only an invalid level can fail, and WarnLevel is valid.
		errLog = nil
	}
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: s.cfg.ReadHeaderTimeout,
		ReadTimeout:       s.cfg.ReadTimeout,
		WriteTimeout:      s.cfg.WriteTimeout,
		IdleTimeout:       s.cfg.IdleTimeout,
		MaxHeaderBytes:    s.cfg.MaxHeaderBytes,
		ErrorLog:          errLog,
		BaseContext:       func(net.Listener) context.Context { return base },
	}
}

// gatewayServer is the lease gateway's http.Server: the listeners'
// settings, then the gateway's own (gateway.ConfigureServer).
func (s *Server) gatewayServer(base context.Context) *http.Server {
	srv := s.httpServer(s.cfg.Gateway, base, listenerGateway)
	gateway.ConfigureServer(srv)
	return srv
}

// GatewayHandler is the lease gateway (gateway.Gateway): its handler, the
// admission of its connections, and their end at shutdown.
type GatewayHandler interface {
	http.Handler
	AdmitConn(st tls.ConnectionState, c io.Closer) (release func(), reason, who string)
	CloseAll()
}

func serveErr(name string, err error) error {
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return fmt.Errorf("serve %s listener: %w", name, err)
}
