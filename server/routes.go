package server

import (
	"net/http"
	"strings"

	"github.com/go-chi/chi/v5"
)

// The listeners that serve the API routes, as named in the access log and
// the listener label of the HTTP metrics.
const (
	// listenerAPI is the mutual-TLS listener: every request carries a
	// verified client certificate before any handler runs.
	listenerAPI = "api"
	// listenerEnroll is the enrollment listener: TLS without a client
	// certificate, for clusters that have none yet. It serves only
	// enrollment with a join token and the trust bundle.
	listenerEnroll = "enroll"
	// listenerGateway is the lease gateway's listener.
	listenerGateway = "gateway"
)

// route is one entry of the route table: a method and pattern under /v1
// and the handler each listener serves it with. A nil handler means the
// listener does not have the route (404).
type route struct {
	method, pattern string
	api, enroll     http.HandlerFunc
}

// routeTable is the one route table of the API, for both listeners.
func (s *Server) routeTable() []route {
	return []route{
		{method: http.MethodPost, pattern: "/kubeconfigs", api: s.withCaller(s.createKubeconfig)},
		{method: http.MethodGet, pattern: "/leases", api: s.withCaller(s.listLeases)},
		{method: http.MethodGet, pattern: "/leases/{id}", api: s.withCaller(s.getLease)},
		{method: http.MethodDelete, pattern: "/leases/{id}", api: s.withCaller(s.revokeLease)},
		{method: http.MethodGet, pattern: "/whoami", api: s.withCaller(s.whoAmI)},
		{method: http.MethodPut, pattern: "/peers/self/jwks", api: withPeerOnly(s.putPeerJWKS)},
		{method: http.MethodPut, pattern: "/peers/self/pods", api: withClientCertificate(s.putPeerPods)},
		// Renewal with the client certificate on the mTLS listener (never
		// a pod certificate), enrollment with a join token on the
		// enrollment listener. Its bearer token, if any, is not a workload
		// token.
		{method: http.MethodPost, pattern: "/certificates", api: withClientCertificate(s.renewCertificate), enroll: s.enrollCertificate},
		{method: http.MethodGet, pattern: "/trust-bundle", api: s.trustBundle, enroll: s.trustBundle},
	}
}

// routes builds the router of one listener from the route table.
func (s *Server) routes(listener string) *chi.Mux {
	r := chi.NewRouter()
	// Set before Route so the /v1 subrouter inherits them.
	r.NotFound(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, r, errRouteNotFound)
	})
	r.MethodNotAllowed(methodNotAllowed(r))

	r.Route("/v1", func(sub chi.Router) {
		for _, rt := range s.routeTable() {
			h := rt.api
			if listener == listenerEnroll {
				h = rt.enroll
			}
			if h != nil {
				sub.Method(rt.method, rt.pattern, h)
			}
		}
	})
	return r
}

// methodNotAllowed answers 405 with the Allow header that chi's default
// handler would have set (chi does not pass the methods to a custom one).
func methodNotAllowed(router *chi.Mux) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		path := r.URL.RawPath
		if path == "" {
			path = r.URL.Path
		}
		var allowed []string
		for _, m := range []string{
			http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut,
			http.MethodPatch, http.MethodDelete, http.MethodOptions,
		} {
			if router.Find(chi.NewRouteContext(), m, path) != "" {
				allowed = append(allowed, m)
			}
		}
		if len(allowed) == 0 {
			// Only a non-standard method lands here for a path without routes.
			writeError(w, r, errRouteNotFound)
			return
		}
		w.Header().Set("Allow", strings.Join(allowed, ", "))
		writeError(w, r, errMethodNotAllowed)
	}
}
