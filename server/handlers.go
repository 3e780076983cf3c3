package server

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"go.uber.org/zap"

	"github.com/tokenbroker/tokenbroker/api/schema"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server/wire"
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

// answered is err, or errNilAnswer when the broker returned neither a
// result nor an error, so that a handler never writes a null answer.
func answered[T any](result *T, err error) error {
	if err == nil && result == nil {
		return errNilAnswer
	}
	return err
}

// acceptOrRefuse picks the media type of the answer from the Accept
// header among offers (the first is the default), or answers 406 and
// returns false. The answer varies by Accept either way.
func acceptOrRefuse(w http.ResponseWriter, r *http.Request, offers ...string) (string, bool) {
	w.Header().Add("Vary", "Accept")
	mediaType, ok := wire.Negotiate(r.Header.Get("Accept"), offers...)
	if !ok {
		writeError(w, r, errNotAcceptable)
	}
	return mediaType, ok
}

// reply writes the broker's answer with status, or its error: the end of
// a handler that has nothing to add.
func reply[T any](w http.ResponseWriter, r *http.Request, status int, result *T, err error) {
	if err = answered(result, err); err != nil {
		writeError(w, r, err)
		return
	}
	writeJSON(w, r, status, result)
}

// leaseNotFound is the answer for an id that does not have the shape of a
// lease id (apiv1.ValidLeaseID), worded as the broker words its own
// not-found. The id is shortened so a long path is not echoed whole.
// callerHandler is a handler of the mutual-TLS listener, given the
// authenticated peer.
type callerHandler func(w http.ResponseWriter, r *http.Request, p peer)

// withPeerOnly adapts h to net/http: it takes the peer the authentication
// middleware put in the context, and answers errNoPeer (a bug: the route
// is served without that middleware) if there is none. A pod certificate
// is the peer only if it is its agent's (caller.Agent).
func withPeerOnly(h callerHandler) http.HandlerFunc {
	return withAnyPeer(func(w http.ResponseWriter, r *http.Request, p peer) {
		if p.pod != nil && p.caller.Agent == nil {
			writeError(w, r, problem.Errorf(problem.KindForbidden, "a pod certificate speaks for its workload, not for its cluster"))
			return
		}
		h(w, r, p)
	})
}

// withClientCertificate is withAnyPeer for the routes of the cluster's
// client certificate alone: renewal (the kubelet renews a pod
// certificate) and the report of the live Pods, which decides whether a
// pod certificate, the agent's too, is honoured: none may write it.
func withClientCertificate(h callerHandler) http.HandlerFunc {
	return withAnyPeer(func(w http.ResponseWriter, r *http.Request, p peer) {
		if p.pod != nil {
			writeError(w, r, problem.Errorf(problem.KindForbidden, "this route takes the cluster's client certificate, never a pod certificate"))
			return
		}
		h(w, r, p)
	})
}

// withAnyPeer adapts h to net/http for every caller, a workload of a pod
// certificate included.
func withAnyPeer(h callerHandler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p, ok := peerFrom(r.Context())
		if !ok {
			writeError(w, r, errNoPeer)
			return
		}
		h(w, r, p)
	}
}

// withCaller is withPeerOnly for the routes where a workload of the
// peer's cluster may say who it is: after the certificate, an
// "Authorization: Bearer" workload token is verified (a request without
// one is the peer's), and a refused one is answered 401 with its reason.
// The agent's pod certificate is the peer's, a token beside it too.
func (s *Server) withCaller(h callerHandler) http.HandlerFunc {
	return withAnyPeer(func(w http.ResponseWriter, r *http.Request, p peer) {
		if len(r.Header.Values("Authorization")) == 0 {
			h(w, r, p)
			return
		}
		if p.pod != nil && p.caller.Agent == nil {
			writeError(w, r, problem.Invalid(apiv1.FieldError{Field: "Authorization",
				Detail: "a pod certificate names its workload already; send no workload token with it"}))
			return
		}
		token, err := workloadToken(r.Header)
		if err == nil && s.workloads == nil {
			err = workload.BadToken(workload.TokenNoTrust, errors.New("this broker verifies no workload tokens"))
		}
		if err == nil {
			p.caller, err = s.workloads.AuthenticateWorkload(r.Context(), p.caller, token)
		}
		if err != nil {
			writeError(w, r, err)
			return
		}
		if info := requestInfoFrom(r.Context()); info != nil {
			info.workload = p.caller.Workload.String()
		}
		h(w, r, p)
	})
}

// workloadToken reads the workload token of an "Authorization: Bearer"
// header: one header, a token of at most pki.MaxWorkloadTokenBytes
// b64token characters.
func workloadToken(h http.Header) (string, error) {
	values := h.Values("Authorization")
	if len(values) != 1 {
		return "", workload.BadToken(pki.TokenMalformed, errors.New("more than one Authorization header"))
	}
	scheme, token, ok := strings.Cut(values[0], " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", workload.BadToken(pki.TokenMalformed, errors.New("authorization is not a Bearer token"))
	}
	token = strings.TrimLeft(token, " ")
	if len(token) > pki.MaxWorkloadTokenBytes {
		return "", workload.BadToken(pki.TokenTooLarge, fmt.Errorf("bearer token of %d bytes", len(token)))
	}
	if !b64token(token) {
		return "", workload.BadToken(pki.TokenMalformed, errors.New("bearer token is empty or has characters a token cannot have"))
	}
	return token, nil
}

// putPeerJWKS handles PUT /v1/peers/self/jwks: the peer uploads its own
// cluster's key set (as served at /openid/v1/jwks).
func (s *Server) putPeerJWKS(w http.ResponseWriter, r *http.Request, p peer) {
	if !jsonRouteAnswerable(w, r, s.workloads != nil) {
		return
	}
	doc, err := wire.ReadJWKS(r, min(s.cfg.MaxBodyBytes, pki.MaxJWKSBytes))
	if err != nil {
		writeError(w, r, err)
		return
	}
	resp, err := s.workloads.PutPeerJWKS(r.Context(), p.caller, doc)
	reply(w, r, http.StatusOK, resp, err)
}

// putPeerPods handles PUT /v1/peers/self/pods: the peer reports the Pods
// that live in its cluster (workloadIdentity.livePodsFromPeer).
func (s *Server) putPeerPods(w http.ResponseWriter, r *http.Request, p peer) {
	if !jsonRouteAnswerable(w, r, s.workloads != nil) {
		return
	}
	var report apiv1.LivePodsReport
	if err := wire.DecodeJSON(r, s.cfg.MaxBodyBytes, &report); err != nil {
		writeError(w, r, err)
		return
	}
	if report.UIDs == nil {
		writeError(w, r, problem.Invalid(apiv1.FieldError{Field: "uids", Detail: "is required (an empty list says no Pod lives)"}))
		return
	}
	resp, err := s.workloads.ReportPeerPods(r.Context(), p.caller, report.UIDs)
	reply(w, r, http.StatusOK, resp, err)
}

func leaseNotFound(id string) error {
	return problem.Errorf(problem.KindNotFound, "lease %q not found", wire.EchoKey(id))
}

// createKubeconfig handles POST /v1/kubeconfigs. The Accept header is
// checked before anything is minted, so a credential is never issued that
// cannot be delivered.
func (s *Server) createKubeconfig(w http.ResponseWriter, r *http.Request, p peer) {
	format := r.URL.Query().Get("format")
	if format != "" && format != formatExec {
		writeError(w, r, problem.Invalid(apiv1.FieldError{Field: "format", Detail: `must be "exec" or absent`}))
		return
	}
	mediaType, ok := acceptOrRefuse(w, r, apiv1.MediaTypeJSON, apiv1.MediaTypeYAML)
	if !ok {
		return
	}
	var req apiv1.KubeconfigRequest
	if err := wire.DecodeJSON(r, s.cfg.MaxBodyBytes, &req); err != nil {
		writeError(w, r, err)
		return
	}
	if fields := validateKubeconfigRequest(req); len(fields) > 0 {
		writeError(w, r, problem.Invalid(fields...))
		return
	}
	if format == formatExec {
		s.execKubeconfig(w, r, p, req, mediaType)
		return
	}

	resp, err := s.broker.IssueKubeconfig(r.Context(), p.caller, req)
	if err = answered(resp, err); err != nil {
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

// formatExec is POST /v1/kubeconfigs?format=exec: a kubeconfig that runs
// the exec credential plugin, and no lease.
const formatExec = "exec"

// execKubeconfig answers POST /v1/kubeconfigs?format=exec with 200 (nothing
// is created): the kubeconfig as YAML, or {"kubeconfig": …} as JSON. The
// plugin in it asks this broker at the URL the caller used (the request's
// host, which must be a host[:port] as a URL allows).
func (s *Server) execKubeconfig(w http.ResponseWriter, r *http.Request, p peer, req apiv1.KubeconfigRequest, mediaType string) {
	brokerURL := "https://" + r.Host
	if prob := schema.URLProblem(brokerURL, "", "https"); prob != "" {
		writeError(w, r, problem.Invalid(apiv1.FieldError{Field: "Host", Detail: prob}))
		return
	}
	kc, err := s.broker.ExecKubeconfig(r.Context(), p.caller, req, brokerURL)
	if err == nil && len(kc) == 0 {
		err = errNilAnswer
	}
	if err != nil {
		writeError(w, r, err)
		return
	}
	if mediaType == apiv1.MediaTypeYAML {
		w.Header().Set("Content-Type", apiv1.MediaTypeYAML)
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(kc)
		return
	}
	writeJSON(w, r, http.StatusOK, &apiv1.ExecKubeconfigResponse{Kubeconfig: string(kc)})
}

// listLeases handles GET /v1/leases[?limit=N][&continue=TOKEN]: one page.
// An unparsable limit is validated as -1.
func (s *Server) listLeases(w http.ResponseWriter, r *http.Request, p peer) {
	q, err := strictQuery(r.URL.RawQuery)
	if err != nil {
		writeError(w, r, err)
		return
	}
	for _, key := range []string{"limit", "continue"} {
		if len(q[key]) > 1 {
			writeError(w, r, problem.Invalid(apiv1.FieldError{Field: key, Detail: "must be given once"}))
			return
		}
	}
	req := lease.PageRequest{Continue: q.Get("continue")}
	if v := q.Get("limit"); q.Has("limit") {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			n = -1
		}
		req.Limit = n
	}
	if err := req.Validate(); err != nil {
		writeError(w, r, err)
		return
	}
	page, err := s.broker.ListLeases(r.Context(), p.caller, req)
	if err != nil {
		writeError(w, r, err)
		return
	}
	writeLeaseList(w, r, page)
}

// strictQuery parses a query as url.ParseQuery does, but where a pair is not
// valid percent-encoding (or holds a ';', which Go no longer takes for a
// separator) it is 400 naming the field ("query" unless the key is limit
// or continue), not a pair dropped: url.URL.Query drops it silently, so
// that a mangled continue token answered the first page again.
func strictQuery(raw string) (url.Values, error) {
	q, err := url.ParseQuery(raw)
	if err == nil {
		return q, nil
	}
	var fields []apiv1.FieldError
	for pair := range strings.SplitSeq(raw, "&") {
		key, value, _ := strings.Cut(pair, "=")
		k, kerr := url.QueryUnescape(key)
		_, verr := url.QueryUnescape(value)
		if kerr == nil && verr == nil && !strings.Contains(pair, ";") {
			continue
		}
		field := "query" // the caller's key is not echoed
		if kerr == nil && (k == "limit" || k == "continue") {
			field = k
		}
		fields = append(fields, apiv1.FieldError{Field: field, Detail: "is not valid percent-encoding"})
	}
	if len(fields) == 0 { // not reached: ParseQuery fails on a pair only
		fields = append(fields, apiv1.FieldError{Field: "query", Detail: "is not valid percent-encoding"})
	}
	return nil, problem.Invalid(fields...)
}

// writeLeaseList answers 200 with page, encoded one lease at a time into a
// small buffer rather than as one slice of bytes the size of the page.
// Nothing in a Lease can fail to encode; should it anyway, the body stops
// short, which no client takes for a complete list.
func writeLeaseList(w http.ResponseWriter, r *http.Request, page *apiv1.LeaseList) {
	w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
	w.WriteHeader(http.StatusOK)
	bw := bufio.NewWriterSize(w, 16<<10)
	enc := json.NewEncoder(bw) // each value ends in a newline, which JSON allows
	_, _ = bw.WriteString(`{"items":[`)
	for i := range page.Items {
		if i > 0 {
			_ = bw.WriteByte(',')
		}
		if err := enc.Encode(&page.Items[i]); err != nil {
			loggerFrom(r.Context()).Error("encoding a lease failed; the list is cut short", zap.Error(err))
			_ = bw.Flush()
			return
		}
	}
	_ = bw.WriteByte(']')
	if page.Continue != "" {
		_, _ = bw.WriteString(`,"continue":`)
		_ = enc.Encode(page.Continue)
	}
	_ = bw.WriteByte('}')
	_ = bw.Flush() // the client has gone; nothing left to tell it
}

// getLease handles GET /v1/leases/{id}.
func (s *Server) getLease(w http.ResponseWriter, r *http.Request, p peer) {
	id := chi.URLParam(r, "id")
	if !apiv1.ValidLeaseID(id) {
		writeError(w, r, leaseNotFound(id))
		return
	}
	lease, err := s.broker.GetLease(r.Context(), p.caller, id)
	reply(w, r, http.StatusOK, lease, err)
}

// revokeLease handles DELETE /v1/leases/{id}.
func (s *Server) revokeLease(w http.ResponseWriter, r *http.Request, p peer) {
	id := chi.URLParam(r, "id")
	if !apiv1.ValidLeaseID(id) {
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
func (s *Server) whoAmI(w http.ResponseWriter, r *http.Request, p peer) {
	name, grants := s.broker.WhoAmI(p.caller)
	if grants == nil {
		grants = []apiv1.Grant{}
	}
	var limits *apiv1.PeerLimits
	if lr, ok := s.broker.(LimitsReporter); ok {
		limits = lr.Limits(p.caller)
	}
	var wl *apiv1.WorkloadInfo
	if cw := p.caller.Workload; cw != nil {
		wl = &apiv1.WorkloadInfo{Namespace: cw.Namespace, ServiceAccount: cw.ServiceAccount, UID: cw.UID, Pod: cw.Pod}
	}
	writeJSON(w, r, http.StatusOK, apiv1.WhoAmI{
		Limits:   limits,
		Identity: p.caller.Identity,
		Peer:     name,
		Workload: wl,
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

// errNoJoinToken is the cause, for the log, of an enrollment without a
// usable bearer token; the caller sees the same 401 as for a bad token.
var errNoJoinToken = errors.New("no bearer token, or not one a join token can be")

// jsonRouteAnswerable answers 404 when this server does not serve the
// route (served is false: no certificate issuer, no workload trust) and
// 406 when the client does not accept JSON, and says whether the handler
// may go on.
func jsonRouteAnswerable(w http.ResponseWriter, r *http.Request, served bool) bool {
	if !served {
		writeError(w, r, errRouteNotFound)
		return false
	}
	if _, ok := wire.Negotiate(r.Header.Get("Accept"), apiv1.MediaTypeJSON); !ok {
		writeError(w, r, errNotAcceptable)
		return false
	}
	return true
}

// enrollCertificate handles POST /v1/certificates on the enrollment
// listener: a cluster without a certificate presents a join token as its
// bearer token and a CSR for the token's identity.
func (s *Server) enrollCertificate(w http.ResponseWriter, r *http.Request) {
	if !jsonRouteAnswerable(w, r, s.certs != nil) {
		return
	}
	token, ok := bearerToken(r.Header)
	if !ok {
		writeError(w, r, &problem.Error{Kind: problem.KindUnauthenticated, Err: errNoJoinToken})
		return
	}
	req, err := s.decodeCertificateRequest(r)
	if err != nil {
		writeError(w, r, err)
		return
	}
	ctx := r.Context()
	if host, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		ctx = broker.WithRemoteAddr(ctx, host)
	}
	resp, err := s.certs.Enroll(ctx, token, req)
	if err = answered(resp, err); err != nil {
		writeError(w, r, err)
		return
	}
	if info := requestInfoFrom(r.Context()); info != nil {
		info.identity = resp.Identity
	}
	writeJSON(w, r, http.StatusCreated, resp)
}

// renewCertificate handles POST /v1/certificates on the mutual-TLS
// listener: the caller's verified certificate authorizes a new one for the
// same identity. A bearer token is ignored here; a pod certificate, the
// agent's too, never gets here (withClientCertificate).
func (s *Server) renewCertificate(w http.ResponseWriter, r *http.Request, p peer) {
	if !jsonRouteAnswerable(w, r, s.certs != nil) {
		return
	}
	req, err := s.decodeCertificateRequest(r)
	if err != nil {
		writeError(w, r, err)
		return
	}
	resp, err := s.certs.Renew(r.Context(), p.caller, req)
	reply(w, r, http.StatusCreated, resp, err)
}

func (s *Server) decodeCertificateRequest(r *http.Request) (apiv1.CertificateRequest, error) {
	var req apiv1.CertificateRequest
	if err := wire.DecodeJSON(r, s.cfg.MaxBodyBytes, &req); err != nil {
		return req, err
	}
	if fields := validateCertificateRequest(req); len(fields) > 0 {
		return req, problem.Invalid(fields...)
	}
	return req, nil
}

// trustBundle handles GET /v1/trust-bundle on both listeners: JSON with
// the fingerprints, or the bare PEM bundle for Accept:
// application/x-pem-file (so that "curl … > ca.crt" works).
func (s *Server) trustBundle(w http.ResponseWriter, r *http.Request) {
	mediaType, ok := acceptOrRefuse(w, r, apiv1.MediaTypeJSON, apiv1.MediaTypePEM)
	if !ok {
		return
	}
	var tb apiv1.TrustBundle
	if s.certs != nil {
		tb = s.certs.TrustBundle()
	}
	if tb.CABundle == "" {
		writeError(w, r, problem.Errorf(problem.KindNotFound, "This broker serves no trust bundle."))
		return
	}
	if tb.Fingerprints == nil {
		tb.Fingerprints = []string{}
	}
	if mediaType == apiv1.MediaTypePEM {
		h := w.Header()
		h.Set("Content-Type", apiv1.MediaTypePEM)
		h.Set("Content-Length", strconv.Itoa(len(tb.CABundle)))
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(tb.CABundle)) // the client has gone; nothing left to tell it
		return
	}
	writeJSON(w, r, http.StatusOK, tb)
}

// bearerToken returns the token of an "Authorization: Bearer <token>"
// header (RFC 6750): exactly one such header, the scheme in any case, a
// token of b64token characters no longer than a join token may be.
func bearerToken(h http.Header) (string, bool) {
	values := h.Values("Authorization")
	if len(values) != 1 {
		return "", false
	}
	scheme, token, ok := strings.Cut(values[0], " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	token = strings.TrimLeft(token, " ")
	if len(token) > pki.MaxJoinTokenBytes || !b64token(token) {
		return "", false
	}
	return token, true
}

// b64token reports whether token is a non-empty RFC 6750 b64token.
func b64token(token string) bool {
	if token == "" {
		return false
	}
	for i := 0; i < len(token); i++ {
		c := token[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			c == '-' || c == '.' || c == '_' || c == '~' || c == '+' || c == '/' || c == '=') {
			return false
		}
	}
	return true
}
