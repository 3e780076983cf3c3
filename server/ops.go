package server

import (
	"context"
	"net/http"
	"net/http/pprof"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
)

// opsRoutes builds the operations handler. The operations listener is
// internal (probes and scrapers), so /readyz may say why it is not ready.
func (s *Server) opsRoutes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeText(w, http.StatusOK, "ok")
	})
	mux.HandleFunc("GET /readyz", s.readyz)
	metricsLog, err := zap.NewStdLogAt(s.log.With(zap.String("listener", "ops")), zap.WarnLevel)
	if err != nil {
		metricsLog = nil // only an invalid level can fail
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.cfg.Gatherer, promhttp.HandlerOpts{
		ErrorLog:      metricsLog,
		ErrorHandling: promhttp.ContinueOnError,
	}))
	if s.cfg.Pprof {
		// Profiles show goroutines, heap and CPU: for an operator on the
		// internal listener only, and off unless asked for.
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	}
	return securityHeaders(s.withInstance(mux))
}

// withInstance names this process in every answer of h (InstanceHeader).
func (s *Server) withInstance(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(InstanceHeader, s.instance)
		h.ServeHTTP(w, r)
	})
}

// readyz answers 200 while the broker is ready and the server is not
// shutting down, and 503 with the reason otherwise.
func (s *Server) readyz(w http.ResponseWriter, r *http.Request) {
	if s.draining.Load() {
		writeText(w, http.StatusServiceUnavailable, "not ready: shutting down")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.ReadyTimeout)
	defer cancel()
	if err := s.broker.Ready(ctx); err != nil {
		writeText(w, http.StatusServiceUnavailable, "not ready: "+err.Error())
		return
	}
	writeText(w, http.StatusOK, "ok")
}

func writeText(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write([]byte(msg + "\n")) // a probe that hung up needs no answer
}
