package server

import (
	"net/http"
	"strings"

	"github.com/go-chi/chi/v5"
)

// routes is the one route table of the API.
func (s *Server) routes() *chi.Mux {
	r := chi.NewRouter()
	// Set before Route so the /v1 subrouter inherits them.
	r.NotFound(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, r, errRouteNotFound)
	})
	r.MethodNotAllowed(s.methodNotAllowed)

	r.Route("/v1", func(r chi.Router) {
		r.Post("/kubeconfigs", s.createKubeconfig)
		r.Get("/leases", s.listLeases)
		r.Get("/leases/{id}", s.getLease)
		r.Delete("/leases/{id}", s.revokeLease)
		r.Get("/whoami", s.whoAmI)
	})
	return r
}

// methodNotAllowed answers 405 with the Allow header that chi's default
// handler would have set (chi does not pass the methods to a custom one).
func (s *Server) methodNotAllowed(w http.ResponseWriter, r *http.Request) {
	path := r.URL.RawPath
	if path == "" {
		path = r.URL.Path
	}
	var allowed []string
	for _, m := range []string{
		http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut,
		http.MethodPatch, http.MethodDelete, http.MethodOptions,
	} {
		if s.router.Find(chi.NewRouteContext(), m, path) != "" {
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
