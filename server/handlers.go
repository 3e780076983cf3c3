package server

import (
	"errors"
	"net/http"
	"net/url"
	"time"

	"github.com/go-chi/chi/v5"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
)

// Headers of the YAML answer of POST /v1/kubeconfigs, which has no JSON
// envelope to carry the lease id and the expiry.
const (
	headerLeaseID   = "X-Lease-Id"
	headerExpiresAt = "X-Expires-At"
)

// errNoPeer means a handler ran outside the authentication middleware: a
// wiring bug, never the caller's fault.
var errNoPeer = errors.New("no authenticated peer in request context")

// errNilAnswer means the broker returned neither a result nor an error.
var errNilAnswer = errors.New("broker returned no result and no error")

// leaseNotFound is the answer for an id that does not have the shape of a
// lease id (broker.ValidLeaseID), worded as the broker words its own
// not-found. The id is shortened so a long path is not echoed whole.
func leaseNotFound(id string) error {
	return broker.Errorf(broker.KindNotFound, "lease %q not found", echoKey(id))
}

// createKubeconfig handles POST /v1/kubeconfigs. The Accept header is
// checked before anything is minted, so a credential is never issued that
// cannot be delivered.
func (s *Server) createKubeconfig(w http.ResponseWriter, r *http.Request) {
	w.Header().Add("Vary", "Accept")
	mediaType, ok := negotiate(r.Header.Get("Accept"), apiv1.MediaTypeJSON, apiv1.MediaTypeYAML)
	if !ok {
		writeError(w, r, errNotAcceptable)
		return
	}
	p, ok := peerFrom(r.Context())
	if !ok {
		writeError(w, r, errNoPeer)
		return
	}
	var req apiv1.KubeconfigRequest
	if err := decodeJSONBody(r, s.cfg.MaxBodyBytes, &req); err != nil {
		writeError(w, r, err)
		return
	}
	if fields := validateKubeconfigRequest(req); len(fields) > 0 {
		writeError(w, r, broker.Invalid(fields...))
		return
	}

	resp, err := s.broker.IssueKubeconfig(r.Context(), p.caller, req)
	if err == nil && resp == nil {
		err = errNilAnswer
	}
	if err != nil {
		writeError(w, r, err)
		return
	}

	w.Header().Set("Location", "/v1/leases/"+url.PathEscape(resp.LeaseID))
	if mediaType == apiv1.MediaTypeYAML {
		h := w.Header()
		h.Set("Content-Type", apiv1.MediaTypeYAML)
		h.Set(headerLeaseID, resp.LeaseID)
		h.Set(headerExpiresAt, resp.ExpiresAt.UTC().Format(time.RFC3339))
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(resp.Kubeconfig)) // the client has gone; the lease expires on its own
		return
	}
	writeJSON(w, r, http.StatusCreated, resp)
}

// listLeases handles GET /v1/leases.
func (s *Server) listLeases(w http.ResponseWriter, r *http.Request) {
	p, ok := peerFrom(r.Context())
	if !ok {
		writeError(w, r, errNoPeer)
		return
	}
	leases, err := s.broker.ListLeases(r.Context(), p.caller)
	if err != nil {
		writeError(w, r, err)
		return
	}
	if leases == nil {
		leases = []apiv1.Lease{}
	}
	writeJSON(w, r, http.StatusOK, apiv1.LeaseList{Items: leases})
}

// getLease handles GET /v1/leases/{id}.
func (s *Server) getLease(w http.ResponseWriter, r *http.Request) {
	p, ok := peerFrom(r.Context())
	if !ok {
		writeError(w, r, errNoPeer)
		return
	}
	id := chi.URLParam(r, "id")
	if !broker.ValidLeaseID(id) {
		writeError(w, r, leaseNotFound(id))
		return
	}
	lease, err := s.broker.GetLease(r.Context(), p.caller, id)
	if err == nil && lease == nil {
		err = errNilAnswer
	}
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, r, http.StatusOK, lease)
}

// revokeLease handles DELETE /v1/leases/{id}.
func (s *Server) revokeLease(w http.ResponseWriter, r *http.Request) {
	p, ok := peerFrom(r.Context())
	if !ok {
		writeError(w, r, errNoPeer)
		return
	}
	id := chi.URLParam(r, "id")
	if !broker.ValidLeaseID(id) {
		writeError(w, r, leaseNotFound(id))
		return
	}
	if err := s.broker.RevokeLease(r.Context(), p.caller, id); err != nil {
		writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// whoAmI handles GET /v1/whoami.
func (s *Server) whoAmI(w http.ResponseWriter, r *http.Request) {
	p, ok := peerFrom(r.Context())
	if !ok {
		writeError(w, r, errNoPeer)
		return
	}
	name, grants := s.broker.WhoAmI(p.caller)
	if grants == nil {
		grants = []apiv1.Grant{}
	}
	writeJSON(w, r, http.StatusOK, apiv1.WhoAmI{
		Identity: p.caller.Identity,
		Peer:     name,
		Grants:   grants,
		Certificate: apiv1.CertificateInfo{
			Subject:      p.cert.Subject.String(),
			SerialNumber: p.cert.SerialNumber.Text(16),
			NotBefore:    p.cert.NotBefore.UTC(),
			NotAfter:     p.cert.NotAfter.UTC(),
			SHA256:       p.caller.CertSHA256,
		},
	})
}
