package server

import (
	"crypto/rand"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"
	"go.uber.org/zap"

	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
)

// headerRequestID carries the request id in both directions.
const headerRequestID = "X-Request-Id"

// maxRequestIDLen bounds a client-supplied request id.
const maxRequestIDLen = 64

// errPanic is what writeError sees for a recovered panic; the panic value
// itself is logged once, with the stack, by recoverPanics.
var errPanic = errors.New("handler panicked")

// chain wraps a listener's router in the middleware, outermost first:
// security headers, body limit, request id, access log and metrics, panic
// recovery and, on the mutual-TLS listener, authentication by client
// certificate. The enrollment listener has no authentication middleware:
// its only authenticated route checks the join token itself.
func (s *Server) chain(listener string, router *chi.Mux) http.Handler {
	mw := chi.Chain(
		securityHeaders,
		s.limitBody,
		s.requestID(listener),
		s.observe(router),
		s.recoverPanics,
	)
	if listener == listenerAPI {
		mw = append(mw, s.authenticate)
	}
	return mw.Handler(router)
}

// securityHeaders sets headers that keep answers out of caches and stop
// browsers from interpreting them, on every response.
func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Cache-Control", "no-store")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'")
		h.Set("Referrer-Policy", "no-referrer")
		next.ServeHTTP(w, r)
	})
}

// limitBody bounds every request body. It wraps the body with the server's
// own ResponseWriter so that net/http closes the connection after an
// oversized body; the decoder turns the read error into 413.
func (s *Server) limitBody(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes)
		next.ServeHTTP(w, r)
	})
}

// requestID gives the request an id, echoed as X-Request-Id. A client's id
// is kept only if it is short and made of [A-Za-z0-9-], so it cannot inject
// anything into logs or headers.
func (s *Server) requestID(listener string) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			id := r.Header.Get(headerRequestID)
			if !validRequestID(id) {
				id = rand.Text()
			}
			w.Header().Set(headerRequestID, id)
			info := &requestInfo{id: id, listener: listener, log: s.log.With(zap.String("request_id", id))}
			// The broker learns the id too, for its audit events.
			ctx := audit.WithRequestID(withRequestInfo(r.Context(), info), id)
			next.ServeHTTP(w, r.WithContext(ctx))
		})
	}
}

func validRequestID(id string) bool {
	if id == "" || len(id) > maxRequestIDLen {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// observe writes the access-log line and the metrics of a request. The
// log line has a constant message and constant keys, and never a header
// value or a body.
func (s *Server) observe(router *chi.Mux) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			start := s.cfg.Now()
			info := requestInfoFrom(r.Context())
			info.route = routeLabel(router, r)
			ww := middleware.NewWrapResponseWriter(w, r.ProtoMajor)

			next.ServeHTTP(ww, r)

			status := ww.Status()
			if status == 0 {
				status = http.StatusOK // net/http's answer when a handler writes nothing
			}
			d := s.cfg.Now().Sub(start)
			method := methodLabel(r.Method)
			s.metrics.observe(info.listener, info.route, method, status, d)
			s.log.Info("request",
				zap.String("request_id", info.id),
				zap.String("listener", info.listener),
				zap.String("method", method),
				zap.String("route", info.route),
				zap.Int("status", status),
				zap.Int("bytes", ww.BytesWritten()),
				zap.Duration("duration", d),
				zap.String("identity", info.identity),
				zap.String("workload", info.workload),
				zap.String("remote", r.RemoteAddr),
			)
		})
	}
}

// routeLabel returns the chi pattern the request matches, or
// routeUnmatched. It is computed up front because authentication may refuse
// the request before the router runs.
func routeLabel(router *chi.Mux, r *http.Request) string {
	path := r.URL.RawPath
	if path == "" {
		path = r.URL.Path
	}
	if p := router.Find(chi.NewRouteContext(), r.Method, path); p != "" {
		return p
	}
	return routeUnmatched
}

// recoverPanics turns a panic into a logged 500 so that one bad request
// never takes the process down.
func (s *Server) recoverPanics(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			v := recover()
			if v == nil {
				return
			}
			loggerFrom(r.Context()).Error("handler panicked",
				zap.String("panic", fmt.Sprint(v)),
				zap.Stack("stack"),
			)
			if ww, ok := w.(middleware.WrapResponseWriter); ok && ww.Status() != 0 {
				return // the answer has begun; the client sees a truncated one
			}
			writeError(w, r, errPanic)
		}()
		next.ServeHTTP(w, r)
	})
}

// authenticate puts the caller, taken from the verified client certificate,
// in the request context. Every failure gets the same 401; the reason is
// only logged, and audited if the broker keeps an audit trail.
func (s *Server) authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, err := s.authenticatePeer(r)
		if err != nil {
			if s.refusals != nil {
				s.refusals.RefuseCaller(r.Context(), p.caller, err.code, err.Error())
			}
			writeError(w, r, &problem.Error{Kind: problem.KindUnauthenticated, Err: err})
			return
		}
		if p.pod != nil {
			var err error
			if s.workloads == nil {
				err = workload.BadPodCertificate(workload.PodCertificatesOff, errors.New("this broker verifies no workloads"))
			} else {
				p.caller, err = s.workloads.AuthenticatePodCertificate(r.Context(), p.caller, p.pod)
			}
			if err != nil {
				writeError(w, r, err)
				return
			}
		}
		if info := requestInfoFrom(r.Context()); info != nil {
			info.identity = p.caller.Identity
			info.workload = p.caller.Workload.String()
		}
		next.ServeHTTP(w, r.WithContext(withPeer(r.Context(), p)))
	})
}

// authError is why a caller was refused, with a reason code for the audit
// trail and metrics.
type authError struct {
	code string
	err  error
}

func (e *authError) Error() string { return e.err.Error() }
func (e *authError) Unwrap() error { return e.err }

func refuse(code string, err error) *authError { return &authError{code: code, err: err} }

// authenticatePeer returns the caller; on failure the peer holds what is
// known of the caller (its certificate's fingerprint and identity, when
// there is a certificate) for the audit trail.
func (s *Server) authenticatePeer(r *http.Request) (peer, *authError) {
	st := r.TLS
	if st == nil {
		return peer{}, refuse(audit.RefusedNoCertificate, errors.New("not a TLS connection"))
	}
	// VerifiedChains is set only when the TLS stack verified the chain; a
	// configuration that merely requests a certificate leaves it empty.
	if len(st.VerifiedChains) == 0 || len(st.PeerCertificates) == 0 {
		return peer{}, refuse(audit.RefusedNoCertificate, errors.New("no verified client certificate"))
	}
	cert := st.PeerCertificates[0]
	known := peer{caller: broker.Caller{CertSHA256: pki.Fingerprint(cert), Certificate: cert}, cert: cert}
	// A keep-alive connection can outlive the certificate it was opened
	// with.
	if now := s.cfg.Now(); now.Before(cert.NotBefore) || now.After(cert.NotAfter) {
		return known, refuse(audit.RefusedExpired, fmt.Errorf("client certificate is not valid at %s (valid %s to %s)",
			now.UTC().Format("2006-01-02T15:04:05Z"), cert.NotBefore.UTC().Format("2006-01-02T15:04:05Z"),
			cert.NotAfter.UTC().Format("2006-01-02T15:04:05Z")))
	}
	if pki.IsLeaseCertificate(cert) {
		return known, refuse(audit.RefusedIdentity, errors.New("a lease certificate is for the lease gateway only: it names no cluster identity"))
	}
	id, pod, err := chainIdentity(cert, st.VerifiedChains)
	known.pod = pod
	if err != nil {
		return known, refuse(audit.RefusedIdentity, fmt.Errorf("client certificate identity: %w", err))
	}
	known.caller.Identity = id
	// A keep-alive connection can also outlive the trust in its CA (removed
	// from the bundle at the end of a CA rotation) and the certificate's
	// good standing (revoked).
	if s.cfg.ClientCAs != nil && !anchoredIn(st.VerifiedChains, s.cfg.ClientCAs.Certificates()) {
		return known, refuse(audit.RefusedUntrustedCA, errors.New("client certificate's CA is no longer in the client CA bundle"))
	}
	if s.revocations != nil {
		// Every verified chain, not only the first: a client certificate
		// that also chains through a revoked intermediate or CA (a
		// cross-signed one, a CA kept in the bundle during a rotation)
		// is refused whichever chain the TLS stack listed first.
		if s.revocations.Revoked(id, chainSerials(st.VerifiedChains)...) {
			return known, refuse(audit.RefusedRevoked, fmt.Errorf("client certificate (serial %s) or identity %s is revoked", cert.SerialNumber.Text(16), id))
		}
		if pw := known.pod; pw != nil && (s.revocations.Revoked(pw.Identity) || s.revocations.RevokedPod(pw.PodUID)) {
			return known, refuse(audit.RefusedRevoked, fmt.Errorf("workload %s or its Pod %s/%s (uid %s) is revoked", pw.Identity, pw.Namespace, pw.PodName, pw.PodUID))
		}
	}
	return known, nil
}

// chainSerials returns the serials (lower-case hexadecimal) of the
// certificates of every chain, each once, in the order first seen.
func chainSerials(chains [][]*x509.Certificate) []string {
	var out []string
	seen := map[string]bool{}
	for _, chain := range chains {
		for _, c := range chain {
			if s := c.SerialNumber.Text(16); !seen[s] {
				seen[s] = true
				out = append(out, s)
			}
		}
	}
	return out
}

// anchoredIn reports whether one of the verified chains ends at one of
// anchors.
func anchoredIn(chains [][]*x509.Certificate, anchors []*x509.Certificate) bool {
	for _, chain := range chains {
		if len(chain) == 0 {
			continue
		}
		root := chain[len(chain)-1]
		for _, a := range anchors {
			if root.Equal(a) {
				return true
			}
		}
	}
	return false
}

// chainIdentity reads who a verified chain (leaf cert) names: a cluster
// identity, which is the signing CA's to give and never a cluster CA's
// (one could otherwise name any cluster of its trust domain); or, for a
// pod certificate, the workload of the cluster whose CA signed it (pod),
// never that cluster itself, with its cluster as id.
func chainIdentity(cert *x509.Certificate, chains [][]*x509.Certificate) (id string, pod *pki.PodWorkload, err error) {
	if pki.IsWorkloadCertificate(cert) {
		if pod, err = pki.WorkloadFromChain(chains); err != nil {
			return "", nil, err
		}
		return pod.Cluster, pod, nil
	}
	if id, err = pki.IdentityFromCert(cert); err == nil {
		err = pki.CheckNoClusterCA(chains)
	}
	return id, nil, err
}
