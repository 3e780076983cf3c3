package server

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/util/validation"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

func TestCreateKubeconfig(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		accept string
		ct     string
		yaml   bool
	}{
		{name: "Without Accept the answer is JSON.", yaml: false},
		{name: "Accept */* gets JSON.", accept: "*/*", yaml: false},
		{name: "Accept application/json gets JSON.", accept: "application/json", yaml: false},
		{name: "Accept application/yaml gets the bare kubeconfig.", accept: "application/yaml", yaml: true},
		{name: "Accept application/yaml, */* prefers YAML.", accept: "application/yaml, */*", yaml: true},
		{name: "A higher q-value for YAML wins.", accept: "application/json;q=0.5, application/yaml;q=0.9", yaml: true},
		{name: "A higher q-value for JSON wins.", accept: "application/yaml;q=0.2, application/json", yaml: false},
		{name: "A charset parameter on the Content-Type is accepted.", ct: "application/json; charset=utf-8"},
		{name: "An upper-case charset on the Content-Type is accepted.", ct: "Application/JSON;charset=UTF-8"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var got apiv1.KubeconfigRequest
			h := newHarness(t, &fakeBroker{
				issue: func(_ context.Context, _ broker.Caller, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
					got = req
					return testResponse(), nil
				},
			})
			rq := postKubeconfig(validBody)
			rq.accept = tt.accept
			if tt.ct != "" {
				rq.contentType = tt.ct
			}
			rec := h.do(rq)

			require.Equal(t, http.StatusCreated, rec.Code, rec.Body.String())
			require.Equal(t, "/v1/leases/"+testLeaseID, rec.Header().Get("Location"))
			requireSecurityHeaders(t, rec.Header())
			require.Equal(t, apiv1.KubeconfigRequest{
				Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h", MinTTL: "30m",
				Audiences: []string{"https://kubernetes.default.svc"}, Credential: "token",
			}, got)

			caller := h.broker.lastCaller()
			require.Equal(t, testIdentity, caller.Identity)
			require.Equal(t, pki.Fingerprint(h.pki.client.Cert), caller.CertSHA256)

			if tt.yaml {
				require.Equal(t, apiv1.MediaTypeYAML, rec.Header().Get("Content-Type"))
				require.Equal(t, testKubeconfig, rec.Body.String())
				require.Equal(t, testLeaseID, rec.Header().Get("X-Lease-Id"))
				require.Equal(t, "2030-01-02T03:04:05Z", rec.Header().Get("X-Expires-At"))
				return
			}
			require.Equal(t, apiv1.MediaTypeJSON, rec.Header().Get("Content-Type"))
			require.Empty(t, rec.Header().Get("X-Lease-Id"))
			var resp apiv1.KubeconfigResponse
			require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &resp))
			require.Equal(t, *testResponse(), resp)
		})
	}
}

func TestCreateKubeconfigRefusals(t *testing.T) {
	t.Parallel()
	big := `{"namespace":"argo","serviceAccount":"` + strings.Repeat("a", 2000) + `"}`
	tests := []struct {
		name   string
		rq     request
		status int
		slug   string
		detail string
		fields []apiv1.FieldError
	}{
		{
			name:   "An Accept that allows neither JSON nor YAML is refused with 406 before minting.",
			rq:     func() request { r := postKubeconfig(validBody); r.accept = "text/html"; return r }(),
			status: http.StatusNotAcceptable, slug: "not-acceptable", detail: classNotAcceptable.detail,
		},
		{
			name:   "An Accept that gives every type q=0 is refused with 406.",
			rq:     func() request { r := postKubeconfig(validBody); r.accept = "*/*;q=0"; return r }(),
			status: http.StatusNotAcceptable, slug: "not-acceptable", detail: classNotAcceptable.detail,
		},
		{
			name:   "A missing Content-Type is refused with 415.",
			rq:     func() request { r := postKubeconfig(validBody); r.contentType = ""; return r }(),
			status: http.StatusUnsupportedMediaType, slug: "unsupported-media-type", detail: "The request body must be application/json.",
		},
		{
			name:   "A text/plain Content-Type is refused with 415.",
			rq:     func() request { r := postKubeconfig(validBody); r.contentType = "text/plain"; return r }(),
			status: http.StatusUnsupportedMediaType, slug: "unsupported-media-type", detail: "The request body must be application/json.",
		},
		{
			name: "A non-UTF-8 charset is refused with 415.",
			rq: func() request {
				r := postKubeconfig(validBody)
				r.contentType = "application/json; charset=latin1"
				return r
			}(),
			status: http.StatusUnsupportedMediaType, slug: "unsupported-media-type", detail: "The request body must be application/json.",
		},
		{
			name:   "A body over the limit with a Content-Length is refused with 413.",
			rq:     postKubeconfig(big),
			status: http.StatusRequestEntityTooLarge, slug: "payload-too-large", detail: "The request body is larger than 1024 bytes.",
		},
		{
			name: "A body over the limit without a Content-Length is refused with 413.",
			rq: func() request {
				r := postKubeconfig(big)
				r.unknownLength = true
				return r
			}(),
			status: http.StatusRequestEntityTooLarge, slug: "payload-too-large", detail: "The request body is larger than 1024 bytes.",
		},
		{
			name:   "An empty body is refused with 400.",
			rq:     postKubeconfig(""),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "The request body is empty.",
		},
		{
			name:   "A body of only whitespace is refused with 400.",
			rq:     postKubeconfig(" \n\t "),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "The request body is empty.",
		},
		{
			name:   "Malformed JSON is refused with 400.",
			rq:     postKubeconfig(`{"namespace":`),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "The request body is truncated JSON.",
		},
		{
			name:   "A JSON array is refused with 400.",
			rq:     postKubeconfig(`[{"namespace":"argo"}]`),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "The request body must be a JSON object.",
		},
		{
			name:   "An unknown field is refused with 400 naming it.",
			rq:     postKubeconfig(`{"namespace":"argo","serviceAccount":"sa","admin":true}`),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "the request is invalid",
			fields: []apiv1.FieldError{{Field: "admin", Detail: "unknown field"}},
		},
		{
			name:   "A field spelled in another case is an unknown field.",
			rq:     postKubeconfig(`{"Namespace":"argo","serviceAccount":"sa"}`),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "the request is invalid",
			fields: []apiv1.FieldError{{Field: "Namespace", Detail: "unknown field"}},
		},
		{
			name:   "A duplicate key is refused with 400.",
			rq:     postKubeconfig(`{"namespace":"argo","serviceAccount":"sa","namespace":"kube-system"}`),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "the request is invalid",
			fields: []apiv1.FieldError{{Field: "namespace", Detail: "duplicate field"}},
		},
		{
			name:   "Trailing garbage after the object is refused with 400.",
			rq:     postKubeconfig(`{"namespace":"argo","serviceAccount":"sa"} garbage`),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "The request body has data after the JSON object.",
		},
		{
			name:   "A second object after the first is refused with 400.",
			rq:     postKubeconfig(`{"namespace":"argo","serviceAccount":"sa"}{}`),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "The request body has data after the JSON object.",
		},
		{
			name:   "A wrong field type is refused with 400 naming the field.",
			rq:     postKubeconfig(`{"namespace":"argo","serviceAccount":"sa","audiences":"x"}`),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "The request is invalid.",
			fields: []apiv1.FieldError{{Field: "audiences", Detail: "must be an array of strings"}},
		},
		{
			name:   "An invalid request is refused with 400 listing every field.",
			rq:     postKubeconfig(`{"namespace":"Argo","ttl":"forever","credential":"password"}`),
			status: http.StatusBadRequest, slug: "invalid-request", detail: "the request is invalid",
			fields: []apiv1.FieldError{
				{Field: "namespace", Detail: validation.IsDNS1123Label("Argo")[0]},
				{Field: "serviceAccount", Detail: "is required"},
				{Field: "ttl", Detail: `must be a duration such as "2h" or "90m"`},
				{Field: "credential", Detail: `must be "token" or "clientCertificate"`},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, nil, func(c *Config) { c.MaxBodyBytes = 1024 })
			rec := h.do(tt.rq)

			p := requireProblem(t, rec, tt.status, tt.slug)
			require.Equal(t, tt.detail, p.Detail)
			require.Equal(t, tt.fields, p.Errors)
			require.Equal(t, "/v1/kubeconfigs", p.Instance)
			require.Zero(t, h.broker.calls.Load(), "the broker must not be called")
			requireSecurityHeaders(t, rec.Header())
		})
	}
}

func TestCreateKubeconfigBrokerAnswers(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		resp   *apiv1.KubeconfigResponse
		err    error
		status int
		slug   string
		detail string
	}{
		{
			name:   "A grant shorter than minTTL is 422 with the broker's detail.",
			err:    problem.Errorf(problem.KindUnprocessable, "granted TTL 10m0s is below minTTL 30m0s"),
			status: http.StatusUnprocessableEntity, slug: "unprocessable", detail: "granted TTL 10m0s is below minTTL 30m0s",
		},
		{
			name:   "A policy denial is 403 with the fixed detail.",
			err:    problem.Errorf(problem.KindForbidden, "peer west has no grant for kube-system/admin"),
			status: http.StatusForbidden, slug: "forbidden", detail: classForbidden.detail,
		},
		{
			name:   "A broker answering neither a result nor an error is 500.",
			status: http.StatusInternalServerError, slug: "internal", detail: classInternal.detail,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, &fakeBroker{
				issue: func(context.Context, broker.Caller, apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
					return tt.resp, tt.err
				},
			})
			rec := h.do(postKubeconfig(validBody))
			p := requireProblem(t, rec, tt.status, tt.slug)
			require.Equal(t, tt.detail, p.Detail)
			require.Empty(t, rec.Header().Get("Location"))
		})
	}
}

func TestLeases(t *testing.T) {
	t.Parallel()

	t.Run("Listing returns the caller's leases.", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, nil)
		rec := h.do(request{method: http.MethodGet, path: "/v1/leases"})
		require.Equal(t, http.StatusOK, rec.Code)
		require.Equal(t, apiv1.MediaTypeJSON, rec.Header().Get("Content-Type"))
		var list apiv1.LeaseList
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &list))
		require.Equal(t, []apiv1.Lease{testLease()}, list.Items)
		require.Equal(t, testIdentity, h.broker.lastCaller().Identity)
	})

	t.Run("Listing no leases returns an empty list, not null.", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, &fakeBroker{
			list: func(context.Context, broker.Caller) ([]apiv1.Lease, error) { return nil, nil },
		})
		rec := h.do(request{method: http.MethodGet, path: "/v1/leases"})
		require.Equal(t, http.StatusOK, rec.Code)
		require.JSONEq(t, `{"items":[]}`, rec.Body.String())
	})

	t.Run("Listing passes limit and continue to the broker and answers its continue token.", func(t *testing.T) {
		t.Parallel()
		var got lease.PageRequest
		h := newHarness(t, &fakeBroker{
			page: func(_ context.Context, _ broker.Caller, req lease.PageRequest) (*apiv1.LeaseList, error) {
				got = req
				return &apiv1.LeaseList{Items: []apiv1.Lease{testLease(), testLease()}, Continue: "bDEKZmx1eAo"}, nil
			},
		})
		rec := h.do(request{method: http.MethodGet, path: "/v1/leases?limit=2&continue=bDEKYXJnbwo"})
		require.Equal(t, http.StatusOK, rec.Code)
		require.Equal(t, lease.PageRequest{Limit: 2, Continue: "bDEKYXJnbwo"}, got)
		require.Equal(t, apiv1.MediaTypeJSON, rec.Header().Get("Content-Type"))
		requireSecurityHeaders(t, rec.Header())
		var list apiv1.LeaseList
		dec := json.NewDecoder(rec.Body)
		dec.DisallowUnknownFields()
		require.NoError(t, dec.Decode(&list))
		require.Equal(t, apiv1.LeaseList{Items: []apiv1.Lease{testLease(), testLease()}, Continue: "bDEKZmx1eAo"}, list)
		require.False(t, dec.More(), "one JSON value")
	})

	t.Run("Listing without limit asks the broker for its default page.", func(t *testing.T) {
		t.Parallel()
		var got lease.PageRequest
		h := newHarness(t, &fakeBroker{
			page: func(_ context.Context, _ broker.Caller, req lease.PageRequest) (*apiv1.LeaseList, error) {
				got = req
				return &apiv1.LeaseList{Items: []apiv1.Lease{}}, nil
			},
		})
		rec := h.do(request{method: http.MethodGet, path: "/v1/leases"})
		require.Equal(t, http.StatusOK, rec.Code)
		require.Equal(t, lease.PageRequest{}, got)
		require.JSONEq(t, `{"items":[]}`, rec.Body.String(), "no continue on the last page")
	})

	for _, tc := range []struct{ name, query, field string }{
		{"A limit that is not a number is 400.", "limit=ten", "limit"},
		{"A limit of zero is 400.", "limit=0", "limit"},
		{"A limit over 1000 is 400.", "limit=1001", "limit"},
		{"Two limits are 400.", "limit=1&limit=2", "limit"},
		{"A continue token that is not the broker's is 400.", "continue=" + url.QueryEscape(`{"rv":1}`), "continue"},
		{"Two continue tokens are 400.", "continue=a&continue=b", "continue"},
		{"A continue token that is not valid percent-encoding is 400, not the first page.", "continue=%%%x", "continue"},
		{"A continue token with a semicolon is 400, not the first page.", "continue=bDEKYXJnbwo;x", "continue"},
		{"A limit that is not valid percent-encoding is 400.", "limit=1%G", "limit"},
		{"Any other pair that is not valid percent-encoding is 400 without its key.", "x%zz=1", "query"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, nil)
			rec := h.do(request{method: http.MethodGet, path: "/v1/leases?" + tc.query})
			p := requireProblem(t, rec, http.StatusBadRequest, "invalid-request")
			require.Len(t, p.Errors, 1)
			require.Equal(t, tc.field, p.Errors[0].Field)
			require.Zero(t, h.broker.calls.Load(), "refused before the broker is asked")
		})
	}

	t.Run("Getting a lease returns it.", func(t *testing.T) {
		t.Parallel()
		var gotID string
		h := newHarness(t, &fakeBroker{
			get: func(_ context.Context, _ broker.Caller, id string) (*apiv1.Lease, error) {
				gotID = id
				l := testLease()
				return &l, nil
			},
		})
		rec := h.do(request{method: http.MethodGet, path: "/v1/leases/" + testLeaseID})
		require.Equal(t, http.StatusOK, rec.Code)
		require.Equal(t, testLeaseID, gotID)
		var l apiv1.Lease
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &l))
		require.Equal(t, testLease(), l)
	})

	t.Run("Getting a lease the broker does not find is 404 with its detail.", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, &fakeBroker{
			get: func(context.Context, broker.Caller, string) (*apiv1.Lease, error) {
				return nil, problem.Errorf(problem.KindNotFound, "lease not found")
			},
		})
		rec := h.do(request{method: http.MethodGet, path: "/v1/leases/" + testLeaseID})
		p := requireProblem(t, rec, http.StatusNotFound, "not-found")
		require.Equal(t, "lease not found", p.Detail)
	})

	t.Run("Revoking a lease answers 204 with no body.", func(t *testing.T) {
		t.Parallel()
		var gotID string
		h := newHarness(t, &fakeBroker{
			revoke: func(_ context.Context, _ broker.Caller, id string) error { gotID = id; return nil },
		})
		rec := h.do(request{method: http.MethodDelete, path: "/v1/leases/" + testLeaseID})
		require.Equal(t, http.StatusNoContent, rec.Code)
		require.Empty(t, rec.Body.String())
		require.Equal(t, testLeaseID, gotID)
		requireSecurityHeaders(t, rec.Header())
	})
}

func TestLeaseIDShape(t *testing.T) {
	t.Parallel()
	ids := []struct{ name, id, detail string }{
		{"An id one character short is not a lease id.", testLeaseID[:25], `lease "abcdefghijklmnopqrstuvwxy" not found`},
		{"An id one character long is not a lease id.", testLeaseID + "a", `lease "abcdefghijklmnopqrstuvwxyza" not found`},
		{"An upper-case id is not a lease id.", strings.ToUpper(testLeaseID), `lease "ABCDEFGHIJKLMNOPQRSTUVWXYZ" not found`},
		{"An id with a digit outside base32 is not a lease id.", "abcdefghijklmnopqrstuvwxy1", `lease "abcdefghijklmnopqrstuvwxy1" not found`},
		{"An id with punctuation is not a lease id.", "abcdefghijklmnopqrstuvwxy-", `lease "abcdefghijklmnopqrstuvwxy-" not found`},
		{"An escaped slash is not a lease id.", "abcdefghijklm%2Fopqrstuvwxy", `lease "abcdefghijklm%2Fopqrstuvwxy" not found`},
		{"A dot-dot is not a lease id.", "..", `lease ".." not found`},
		{"A long id is shortened when echoed.", strings.Repeat("a", 300), `lease "` + strings.Repeat("a", 64) + `…" not found`},
	}
	for _, tc := range ids {
		for _, method := range []string{http.MethodGet, http.MethodDelete} {
			t.Run(method+" "+tc.name, func(t *testing.T) {
				t.Parallel()
				h := newHarness(t, nil)
				rec := h.do(request{method: method, path: "/v1/leases/" + tc.id})
				p := requireProblem(t, rec, http.StatusNotFound, "not-found")
				require.Equal(t, tc.detail, p.Detail)
				require.Zero(t, h.broker.calls.Load(), "the broker must not be called")
			})
		}
	}
}

func TestWhoAmI(t *testing.T) {
	t.Parallel()

	t.Run("WhoAmI describes the caller, its grants and its certificate.", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, nil)
		rec := h.do(request{method: http.MethodGet, path: "/v1/whoami"})
		require.Equal(t, http.StatusOK, rec.Code)
		var got apiv1.WhoAmI
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &got))
		cert := h.pki.client.Cert
		require.Equal(t, apiv1.WhoAmI{
			Identity: testIdentity,
			Peer:     "west",
			Grants: []apiv1.Grant{{
				Namespaces: []string{"argo"}, ServiceAccounts: []string{"admiralty-source"},
				MaxTTL: "12h", Credential: apiv1.CredentialToken,
			}},
			Certificate: apiv1.CertificateInfo{
				Subject:      cert.Subject.String(),
				SerialNumber: cert.SerialNumber.Text(16),
				NotBefore:    cert.NotBefore.UTC(),
				NotAfter:     cert.NotAfter.UTC(),
				SHA256:       pki.Fingerprint(cert),
			},
		}, got)
	})

	t.Run("WhoAmI for a caller without grants has an empty list, not null.", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, &fakeBroker{whoami: func(broker.Caller) (string, []apiv1.Grant) { return "", nil }})
		rec := h.do(request{method: http.MethodGet, path: "/v1/whoami"})
		require.Equal(t, http.StatusOK, rec.Code)
		var raw map[string]json.RawMessage
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &raw))
		require.Equal(t, "[]", string(raw["grants"]))
		require.NotContains(t, raw, "peer")
	})
}

func TestRouting(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		method string
		path   string
		status int
		slug   string
		allow  string
	}{
		{name: "An unknown path is 404.", method: http.MethodGet, path: "/v2/leases", status: http.StatusNotFound, slug: "not-found"},
		{name: "An unknown path under /v1 is 404.", method: http.MethodGet, path: "/v1/nope", status: http.StatusNotFound, slug: "not-found"},
		{name: "GET on certificates is 405 allowing POST.", method: http.MethodGet, path: "/v1/certificates", status: http.StatusMethodNotAllowed, slug: "method-not-allowed", allow: "POST"},
		{name: "DELETE on the trust bundle is 405 allowing GET.", method: http.MethodDelete, path: "/v1/trust-bundle", status: http.StatusMethodNotAllowed, slug: "method-not-allowed", allow: "GET"},
		{name: "GET on kubeconfigs is 405 allowing POST.", method: http.MethodGet, path: "/v1/kubeconfigs", status: http.StatusMethodNotAllowed, slug: "method-not-allowed", allow: "POST"},
		{name: "PUT on a lease is 405 allowing GET and DELETE.", method: http.MethodPut, path: "/v1/leases/" + testLeaseID, status: http.StatusMethodNotAllowed, slug: "method-not-allowed", allow: "GET, DELETE"},
		{name: "POST on whoami is 405 allowing GET.", method: http.MethodPost, path: "/v1/whoami", status: http.StatusMethodNotAllowed, slug: "method-not-allowed", allow: "GET"},
		{name: "A non-standard method on a route is 405.", method: "BREW", path: "/v1/whoami", status: http.StatusMethodNotAllowed, slug: "method-not-allowed", allow: "GET"},
		{name: "A non-standard method elsewhere is 404.", method: "BREW", path: "/coffee", status: http.StatusNotFound, slug: "not-found"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, nil)
			rec := h.do(request{method: tt.method, path: tt.path})
			p := requireProblem(t, rec, tt.status, tt.slug)
			require.Equal(t, tt.path, p.Instance)
			require.Equal(t, tt.allow, rec.Header().Get("Allow"))
			require.Zero(t, h.broker.calls.Load())
			requireSecurityHeaders(t, rec.Header())
		})
	}
}

func TestAuthentication(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t)
	_, noURI := selfMadeCert(t)
	_, twoURIs := selfMadeCert(t, testIdentity, "spiffe://oc.example/cluster/east")
	_, badURI := selfMadeCert(t, "https://oc.example/cluster/west")

	tests := []struct {
		name string
		rq   request
		now  func() time.Time
	}{
		{name: "A request without TLS is refused.", rq: request{noTLS: true}},
		{name: "A TLS request without a client certificate is refused.", rq: request{tls: &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true}}},
		{
			name: "An unverified client certificate is refused.",
			rq: request{tls: func() *tls.ConnectionState {
				s := p.verifiedState(p.client.Cert)
				s.VerifiedChains = nil
				return s
			}()},
		},
		{name: "A certificate without a URI SAN is refused.", rq: request{tls: p.verifiedState(noURI.Leaf)}},
		{name: "A certificate with two URI SANs is refused.", rq: request{tls: p.verifiedState(twoURIs.Leaf)}},
		{name: "A certificate with a non-SPIFFE URI is refused.", rq: request{tls: p.verifiedState(badURI.Leaf)}},
		{
			name: "A certificate that expired on a long-lived connection is refused.",
			rq:   request{},
			now:  func() time.Time { return time.Now().Add(2 * time.Hour) },
		},
	}
	var bodies []apiv1.Problem
	for _, tt := range tests {
		for _, path := range []string{"/v1/whoami", "/v1/nope"} {
			h := newHarness(t, nil, func(c *Config) {
				if tt.now != nil {
					c.Now = tt.now
				}
			})
			rq := tt.rq
			rq.method, rq.path = http.MethodGet, path
			rec := h.do(rq)
			prob := requireProblem(t, rec, http.StatusUnauthorized, "unauthenticated")
			require.Zero(t, h.broker.calls.Load(), tt.name)
			requireSecurityHeaders(t, rec.Header())
			prob.RequestID, prob.Instance = "", ""
			bodies = append(bodies, prob)

			// The reason is logged, not told.
			failed := h.logs.FilterMessage("request failed").All()
			require.Len(t, failed, 1, tt.name)
			require.NotEmpty(t, failed[0].ContextMap()["error"], tt.name)
		}
	}
	for _, b := range bodies[1:] {
		require.Equal(t, bodies[0], b, "every authentication failure must look the same")
	}
	require.Equal(t, classUnauthenticated.detail, bodies[0].Detail)
}

func TestPanicInBrokerIsA500AndTheServerKeepsServing(t *testing.T) {
	t.Parallel()
	var panicked bool
	h := newHarness(t, &fakeBroker{
		list: func(context.Context, broker.Caller) ([]apiv1.Lease, error) {
			if !panicked {
				panicked = true
				panic("boom with " + testToken[:5])
			}
			return nil, nil
		},
	})

	rec := h.do(request{method: http.MethodGet, path: "/v1/leases"})
	p := requireProblem(t, rec, http.StatusInternalServerError, "internal")
	require.Equal(t, classInternal.detail, p.Detail)
	require.NotContains(t, rec.Body.String(), "boom")
	requireSecurityHeaders(t, rec.Header())

	logged := h.logs.FilterMessage("handler panicked").All()
	require.Len(t, logged, 1)
	require.Equal(t, p.RequestID, logged[0].ContextMap()["request_id"])
	require.Contains(t, logged[0].ContextMap()["stack"], "TestPanicInBrokerIsA500AndTheServerKeepsServing")

	rec = h.do(request{method: http.MethodGet, path: "/v1/leases"})
	require.Equal(t, http.StatusOK, rec.Code)
	require.JSONEq(t, `{"items":[]}`, rec.Body.String())

	access := h.logs.FilterMessage("request").All()
	require.Len(t, access, 2)
	require.EqualValues(t, http.StatusInternalServerError, access[0].ContextMap()["status"])
	require.EqualValues(t, http.StatusOK, access[1].ContextMap()["status"])
}

func TestRequestID(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		sent   string
		echoed bool
	}{
		{name: "A well-formed client request id is echoed.", sent: "trace-0123-ABC", echoed: true},
		{name: "A request id with a space is replaced.", sent: "abc def"},
		{name: "A request id with a backslash is replaced.", sent: `abc\ndef`},
		{name: "A request id with quotes is replaced.", sent: `"abc"`},
		{name: "A request id longer than 64 characters is replaced.", sent: strings.Repeat("a", 65)},
		{name: "A missing request id is generated."},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, nil)
			hdr := http.Header{}
			if tt.sent != "" {
				hdr.Set("X-Request-Id", tt.sent)
			}
			rec := h.do(request{method: http.MethodGet, path: "/v1/whoami", header: hdr})
			got := rec.Header().Get("X-Request-Id")
			if tt.echoed {
				require.Equal(t, tt.sent, got)
			} else {
				require.NotEqual(t, tt.sent, got)
				require.True(t, validRequestID(got), got)
				require.GreaterOrEqual(t, len(got), 26)
			}
			entries := h.logs.FilterMessage("request").All()
			require.Len(t, entries, 1)
			require.Equal(t, got, entries[0].ContextMap()["request_id"])
		})
	}
}

func TestTheBrokerSeesTheRequestIDForItsAuditEvents(t *testing.T) {
	t.Parallel()
	var seen string
	b := &fakeBroker{issue: func(ctx context.Context, _ broker.Caller, _ apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
		seen = audit.RequestID(ctx)
		return testResponse(), nil
	}}
	h := newHarness(t, b)
	rq := postKubeconfig(`{"namespace":"argo","serviceAccount":"admiralty-source"}`)
	rq.header = http.Header{"X-Request-Id": []string{"trace-42"}}
	rec := h.do(rq)
	require.Equal(t, http.StatusCreated, rec.Code, rec.Body.String())
	require.Equal(t, "trace-42", seen)
}

// FuzzStrictQuery feeds arbitrary queries of GET /v1/leases through
// strictQuery. It must never panic; what it accepts is exactly what
// url.ParseQuery accepts, with the same values; what it refuses is a 400
// whose fields are limit, continue or query, never the caller's own key.
func FuzzStrictQuery(f *testing.F) {
	for _, seed := range []string{
		"", "limit=2&continue=bDEKYXJnbwo", "continue=%%%x", "continue=a;b", "limit=1%G", "x%zz=1",
		"continue=%zz&limit=%zz", "&&=&", "continue", "%", "a=b=c", "continue=%E2%82%AC", "l%69mit=%zz",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, raw string) {
		q, err := strictQuery(raw)
		want, wantErr := url.ParseQuery(raw)
		if err == nil {
			require.NoError(t, wantErr)
			require.Equal(t, want, q)
			return
		}
		require.Error(t, wantErr, "refused only what url.ParseQuery refuses")
		var be *problem.Error
		require.ErrorAs(t, err, &be)
		require.Equal(t, problem.KindInvalid, be.Kind)
		require.NotEmpty(t, be.Fields)
		for _, fe := range be.Fields {
			require.Contains(t, []string{"limit", "continue", "query"}, fe.Field)
		}
	})
}
