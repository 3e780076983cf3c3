package server

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/go-chi/chi/v5"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Server serves the tokenbroker API over mutual TLS and the operations
// endpoints over plain HTTP. Make one with New and start it with Run.
type Server struct {
	cfg     Config
	log     *zap.Logger
	broker  Broker
	metrics *httpMetrics
	router  *chi.Mux
	api     http.Handler
	ops     http.Handler

	// draining is set once Run starts shutting down, so /readyz tells load
	// balancers to stop sending new requests while in-flight ones finish.
	draining atomic.Bool

	mu        sync.Mutex
	started   bool
	apiAddr   net.Addr
	opsAddr   net.Addr
	listening chan struct{}
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
		cfg:       cfg,
		log:       cfg.Logger,
		broker:    cfg.Broker,
		metrics:   m,
		listening: make(chan struct{}),
	}
	s.router = s.routes()
	s.api = s.apiChain(s.router)
	s.ops = s.opsRoutes()
	return s, nil
}

// Handler returns the API handler with the whole middleware chain. It
// expects the request's TLS state to carry a verified client certificate,
// as the mutual-TLS listener provides.
func (s *Server) Handler() http.Handler { return s.api }

// OpsHandler returns the handler of the operations listener: /healthz,
// /readyz and /metrics.
func (s *Server) OpsHandler() http.Handler { return s.ops }

// Addr returns the bound address of the API listener, or nil before Run has
// bound it (see Listening).
func (s *Server) Addr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.apiAddr
}

// OpsAddr returns the bound address of the operations listener, or nil
// before Run has bound it.
func (s *Server) OpsAddr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.opsAddr
}

// Listening returns a channel that is closed once Run has bound both
// listeners; Addr and OpsAddr are then non-nil. If binding fails the
// channel is never closed and Run returns the error, so wait on it together
// with Run's return (or a context that ends when Run does).
func (s *Server) Listening() <-chan struct{} { return s.listening }

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

	apiLn, opsLn, err := s.listen()
	if err != nil {
		return err
	}
	// Serve closes the listeners on shutdown; these cover a Serve that
	// failed before taking them over.
	defer func() { _ = apiLn.Close() }()
	defer func() { _ = opsLn.Close() }()
	s.mu.Lock()
	s.apiAddr, s.opsAddr = apiLn.Addr(), opsLn.Addr()
	s.mu.Unlock()
	close(s.listening)

	// Requests must not be cancelled by ctx, or shutting down would abort
	// the in-flight requests it promises to let finish; baseCtx is
	// cancelled only when the grace period is over.
	baseCtx, cancelBase := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelBase()

	apiSrv := s.httpServer(s.api, baseCtx, "api")
	apiSrv.TLSConfig = s.cfg.TLSConfig
	opsSrv := s.httpServer(s.ops, baseCtx, "ops")

	errc := make(chan error, 2)
	go func() {
		// Empty file names: the certificate comes from TLSConfig, which
		// reloads it. ServeTLS adds the ALPN protocols.
		errc <- serveErr("api", apiSrv.ServeTLS(apiLn, "", ""))
	}()
	go func() { errc <- serveErr("ops", opsSrv.Serve(opsLn)) }()
	s.log.Info("listening", zap.Stringer("api", apiLn.Addr()), zap.Stringer("ops", opsLn.Addr()))

	var errs []error
	pending := 2
	select {
	case <-ctx.Done():
	case err := <-errc:
		pending--
		errs = append(errs, err)
	}

	s.draining.Store(true)
	s.log.Info("shutting down", zap.Duration("grace", s.cfg.ShutdownGrace))
	shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.ShutdownGrace)
	defer cancel()
	// The API first, so /readyz keeps answering "shutting down" while
	// requests drain.
	if err := apiSrv.Shutdown(shutdownCtx); err != nil {
		errs = append(errs, fmt.Errorf("shut down api listener: %w", err))
	}
	if err := opsSrv.Shutdown(shutdownCtx); err != nil {
		errs = append(errs, fmt.Errorf("shut down ops listener: %w", err))
	}
	if shutdownCtx.Err() != nil {
		cancelBase()
		_ = apiSrv.Close() // the grace period is over; the error says no more than that
		_ = opsSrv.Close()
	}
	for ; pending > 0; pending-- {
		errs = append(errs, <-errc)
	}
	return errors.Join(errs...)
}

// listen returns the configured listeners or opens them. On failure nothing
// stays open.
func (s *Server) listen() (api, ops net.Listener, err error) {
	api, ops = s.cfg.Listener, s.cfg.OpsListener
	closeAll := func() {
		if api != nil {
			_ = api.Close()
		}
		if ops != nil {
			_ = ops.Close()
		}
	}
	if api == nil {
		if api, err = net.Listen("tcp", s.cfg.Addr); err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("listen on api address %q: %w", s.cfg.Addr, err)
		}
	}
	if ops == nil {
		if ops, err = net.Listen("tcp", s.cfg.OpsAddr); err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("listen on ops address %q: %w", s.cfg.OpsAddr, err)
		}
	}
	return api, ops, nil
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

func serveErr(name string, err error) error {
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return fmt.Errorf("serve %s listener: %w", name, err)
}
