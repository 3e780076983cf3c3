package server

import (
	"context"
	"crypto/ecdsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/golang-jwt/jwt/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes/fake"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/pki"
)

const revokedIdentity = "spiffe://oc.example/cluster/north"

// withEnrollment gives a harness or a running server an enrollment
// listener with the production enrollment profile over the test PKI's
// server certificate files.
func withEnrollment(t *testing.T, p *testPKI) harnessOption {
	t.Helper()
	reloader, err := pki.NewCertReloader(p.certFile, p.keyFile)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	return func(c *Config) {
		c.EnrollListener = ln
		c.EnrollTLSConfig = pki.EnrollmentTLSConfig(reloader)
	}
}

func postCertificate(body, bearer string, enroll bool) request {
	rq := request{method: http.MethodPost, path: "/v1/certificates", body: body, contentType: apiv1.MediaTypeJSON, enroll: enroll}
	if bearer != "" {
		rq.header = http.Header{"Authorization": {"Bearer " + bearer}}
	}
	return rq
}

func certBody(t *testing.T, identity string) string {
	t.Helper()
	csr, _, err := pki.NewCSR(identity, nil)
	require.NoError(t, err)
	b, err := json.Marshal(apiv1.CertificateRequest{CSR: string(csr)})
	require.NoError(t, err)
	return string(b)
}

func TestTheEnrollmentListenerServesOnlyEnrollmentAndTheTrustBundle(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		rq     request
		status int
	}{
		{"Enrollment with a join token is served.", postCertificate(`{"csr":"x"}`, "a.b.c", true), http.StatusCreated},
		{"The trust bundle is served.", request{method: http.MethodGet, path: "/v1/trust-bundle", enroll: true}, http.StatusOK},
		{"whoami is not there.", request{method: http.MethodGet, path: "/v1/whoami", enroll: true}, http.StatusNotFound},
		{"Kubeconfigs are not there.", request{method: http.MethodPost, path: "/v1/kubeconfigs", body: validBody, contentType: apiv1.MediaTypeJSON, enroll: true}, http.StatusNotFound},
		{"Leases are not there.", request{method: http.MethodGet, path: "/v1/leases", enroll: true}, http.StatusNotFound},
		{"A lease is not there.", request{method: http.MethodDelete, path: "/v1/leases/" + testLeaseID, enroll: true}, http.StatusNotFound},
		{"The operations endpoints are not there.", request{method: http.MethodGet, path: "/metrics", enroll: true}, http.StatusNotFound},
		{"GET on certificates is 405.", request{method: http.MethodGet, path: "/v1/certificates", enroll: true}, http.StatusMethodNotAllowed},
		{"A verified client certificate does not open the API on it.", request{method: http.MethodGet, path: "/v1/leases", enroll: true, tls: newTestPKI(t).verifiedState(newTestPKI(t).client.Cert)}, http.StatusNotFound},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := newHarness(t, nil)
			rec := h.do(tc.rq)
			require.Equal(t, tc.status, rec.Code, rec.Body.String())
			requireSecurityHeaders(t, rec.Header())
			if tc.status >= 400 {
				requireProblem(t, rec, tc.status, map[int]string{404: "not-found", 405: "method-not-allowed"}[tc.status])
				require.Zero(t, h.broker.calls.Load())
			}
		})
	}
}

func TestCertificatesOnTheMutualTLSListenerAreRenewal(t *testing.T) {
	t.Parallel()
	var gotToken atomic.Bool
	b := &fakeBroker{enroll: func(context.Context, string, apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
		gotToken.Store(true)
		return nil, errors.New("enrollment must not be reached on the mTLS listener")
	}}
	h := newHarness(t, b)

	rec := h.do(postCertificate(`{"csr":"pem"}`, "a.join.token", false))
	require.Equal(t, http.StatusCreated, rec.Code, rec.Body.String())
	require.False(t, gotToken.Load(), "a bearer token is ignored on the mTLS listener")
	require.Equal(t, testIdentity, b.lastCaller().Identity)
	var resp apiv1.CertificateResponse
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &resp))
	require.Equal(t, *testCertificateResponse(testIdentity), resp)
	require.Equal(t, apiv1.MediaTypeJSON, rec.Header().Get("Content-Type"))

	// Without a verified certificate, renewal is refused before the handler.
	before := b.calls.Load()
	rec = h.do(request{method: http.MethodPost, path: "/v1/certificates", body: `{"csr":"pem"}`, contentType: apiv1.MediaTypeJSON,
		tls: &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true}})
	requireProblem(t, rec, http.StatusUnauthorized, "unauthenticated")
	require.Equal(t, before, b.calls.Load())
}

func TestCertificateRequestValidation(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		body   string
		ct     string
		accept string
		status int
		slug   string
		field  string
	}{
		{name: "A missing csr is a field error.", body: `{}`, status: 400, slug: "invalid-request", field: "csr"},
		{name: "A blank csr is a field error.", body: `{"csr":"  "}`, status: 400, slug: "invalid-request", field: "csr"},
		{name: "An oversized csr is a field error.", body: `{"csr":"` + strings.Repeat("A", pki.MaxCSRPEMSize+1) + `"}`, status: 400, slug: "invalid-request", field: "csr"},
		{name: "An unknown field is refused.", body: `{"csr":"x","identity":"spiffe://a/cluster/b"}`, status: 400, slug: "invalid-request", field: "identity"},
		{name: "A csr that is not a string is refused.", body: `{"csr":42}`, status: 400, slug: "invalid-request", field: "csr"},
		{name: "Trailing data is refused.", body: `{"csr":"x"} {}`, status: 400, slug: "invalid-request"},
		{name: "A body over the limit is 413.", body: `{"csr":"` + strings.Repeat("A", DefaultMaxBodyBytes) + `"}`, status: 413, slug: "payload-too-large"},
		{name: "A body that is not JSON is 415.", body: `csr=x`, ct: "application/x-www-form-urlencoded", status: 415, slug: "unsupported-media-type"},
		{name: "Asking for YAML is 406.", body: `{"csr":"x"}`, accept: apiv1.MediaTypeYAML, status: 406, slug: "not-acceptable"},
	}
	for _, tc := range tests {
		for _, enroll := range []bool{false, true} {
			name := tc.name + " (renewal)"
			if enroll {
				name = tc.name + " (enrollment)"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				h := newHarness(t, nil)
				rq := postCertificate(tc.body, "a.b.c", enroll)
				if tc.ct != "" {
					rq.contentType = tc.ct
				}
				rq.accept = tc.accept
				p := requireProblem(t, h.do(rq), tc.status, tc.slug)
				if tc.field != "" {
					require.Len(t, p.Errors, 1, p)
					require.Equal(t, tc.field, p.Errors[0].Field)
				}
				require.Zero(t, h.broker.calls.Load(), "the broker is not reached")
			})
		}
	}
}

func TestTheTrustBundle(t *testing.T) {
	t.Parallel()
	for _, enroll := range []bool{false, true} {
		h := newHarness(t, nil)
		rec := h.do(request{method: http.MethodGet, path: "/v1/trust-bundle", enroll: enroll})
		require.Equal(t, http.StatusOK, rec.Code)
		var tb apiv1.TrustBundle
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &tb))
		require.Equal(t, testBundlePEM, tb.CABundle)
		require.Len(t, tb.Fingerprints, 1)
		require.Contains(t, rec.Header().Values("Vary"), "Accept")

		rec = h.do(request{method: http.MethodGet, path: "/v1/trust-bundle", accept: apiv1.MediaTypePEM, enroll: enroll})
		require.Equal(t, http.StatusOK, rec.Code)
		require.Equal(t, apiv1.MediaTypePEM, rec.Header().Get("Content-Type"))
		require.Equal(t, testBundlePEM, rec.Body.String())
		require.Equal(t, "no-store", rec.Header().Get("Cache-Control"))

		requireProblem(t, h.do(request{method: http.MethodGet, path: "/v1/trust-bundle", accept: "text/html", enroll: enroll}), 406, "not-acceptable")
	}

	t.Run("A broker without a bundle answers 404.", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t, &fakeBroker{trustBundle: func() apiv1.TrustBundle { return apiv1.TrustBundle{} }})
		requireProblem(t, h.do(request{method: http.MethodGet, path: "/v1/trust-bundle"}), 404, "not-found")
	})
	t.Run("A broker that issues no certificates answers 404 on both routes and both listeners.", func(t *testing.T) {
		t.Parallel()
		h := newHarnessWith(t, plainBroker{&fakeBroker{}})
		for _, enroll := range []bool{false, true} {
			requireProblem(t, h.do(request{method: http.MethodGet, path: "/v1/trust-bundle", enroll: enroll}), 404, "not-found")
			requireProblem(t, h.do(postCertificate(`{"csr":"x"}`, "a.b.c", enroll)), 404, "not-found")
		}
	})
}

// realBrokerEnv is a broker.Broker that issues certificates from a real CA,
// over a fake clientset, with one identity revoked.
type realBrokerEnv struct {
	ca *pki.CA
	b  *broker.Broker
}

func newRealBroker(t *testing.T) *realBrokerEnv {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "enrollment test CA", Lifetime: 48 * time.Hour})
	require.NoError(t, err)
	pol, err := policy.Parse([]byte("cluster: {name: east, server: 'https://east.example.com', caData: x}\nlimits: {enrollmentsPerMinute: 1000}\n"))
	require.NoError(t, err)
	b, err := broker.New(broker.Config{
		Secrets:   fake.NewClientset().CoreV1(),
		Policy:    policy.NewStore(pol),
		Logger:    zap.NewNop(),
		Namespace: "tokenbroker",
		Enrollment: enrollment.Config{CA: ca, Revocations: enrollment.StaticRevocationList(enrollment.NewDenyList([]enrollment.RevocationEntry{
			{Kind: enrollment.RevokeIdentity, Value: revokedIdentity},
		}))},
	})
	require.NoError(t, err)
	return &realBrokerEnv{ca: ca, b: b}
}

// signed makes a JWT with the CA's key and the given claims and method,
// for the tokens pki would never issue.
func (e *realBrokerEnv) signed(t *testing.T, claims jwt.RegisteredClaims) string {
	t.Helper()
	keyPEM, err := e.ca.KeyPEM()
	require.NoError(t, err)
	key, err := pki.ParsePrivateKeyPEM(keyPEM)
	require.NoError(t, err)
	tok, err := jwt.NewWithClaims(jwt.SigningMethodES256, claims).SignedString(key.(*ecdsa.PrivateKey))
	require.NoError(t, err)
	return tok
}

func goodClaims() jwt.RegisteredClaims {
	now := time.Now()
	return jwt.RegisteredClaims{
		Issuer:    pki.JoinTokenIssuer,
		Subject:   testIdentity,
		Audience:  jwt.ClaimStrings{"east"}, // the policy's cluster.name
		ExpiresAt: jwt.NewNumericDate(now.Add(10 * time.Minute)),
		NotBefore: jwt.NewNumericDate(now),
		IssuedAt:  jwt.NewNumericDate(now),
		ID:        strings.Repeat("0123456789abcdef", 2),
	}
}

func TestEveryEnrollmentFailureIsTheSame401(t *testing.T) {
	t.Parallel()
	e := newRealBroker(t)
	h := newHarnessWith(t, e.b)
	join := func(identity string, now time.Time) string {
		tok, _, err := e.ca.IssueJoinToken(pki.JoinTokenOptions{Identity: identity, Audiences: []string{"east"}, Now: func() time.Time { return now }})
		require.NoError(t, err)
		return tok
	}
	used := join(testIdentity, time.Now())
	rec := h.do(postCertificate(certBody(t, testIdentity), used, true))
	require.Equal(t, http.StatusCreated, rec.Code, rec.Body.String())

	other, err := pki.NewCA(pki.CAOptions{CommonName: "other"})
	require.NoError(t, err)
	foreign, _, err := other.IssueJoinToken(pki.JoinTokenOptions{Identity: testIdentity, Audiences: []string{"east"}})
	require.NoError(t, err)
	wrongAud := goodClaims()
	wrongAud.Audience = jwt.ClaimStrings{"kubernetes"}
	otherBroker := goodClaims()
	otherBroker.Audience = jwt.ClaimStrings{"south"}
	unbound := goodClaims()
	unbound.Audience = jwt.ClaimStrings{pki.JoinTokenAudience}
	wrongIss := goodClaims()
	wrongIss.Issuer = "someone"
	noneHeader := base64.RawURLEncoding.EncodeToString([]byte(`{"alg":"none","typ":"JWT"}`))
	claimsJSON, err := json.Marshal(goodClaims())
	require.NoError(t, err)
	algNone := noneHeader + "." + base64.RawURLEncoding.EncodeToString(claimsJSON) + "."
	good := join(testIdentity, time.Now())
	parts := strings.Split(good, ".")
	tampered := parts[0] + "." + base64.RawURLEncoding.EncodeToString([]byte(`{"sub":"spiffe://oc.example/cluster/root"}`)) + "." + parts[2]

	tests := []struct {
		name   string
		header http.Header
	}{
		{"no Authorization header", nil},
		{"a Basic credential", http.Header{"Authorization": {"Basic dXNlcjpwYXNz"}}},
		{"an empty bearer token", http.Header{"Authorization": {"Bearer "}}},
		{"two Authorization headers", http.Header{"Authorization": {"Bearer " + good, "Bearer " + good}}},
		{"a token with characters no JWT has", http.Header{"Authorization": {`Bearer a"b`}}},
		{"an oversized token", http.Header{"Authorization": {"Bearer " + strings.Repeat("a", pki.MaxJoinTokenBytes+1)}}},
		{"a token that is not a JWT", http.Header{"Authorization": {"Bearer not.a.jwt"}}},
		{"an expired token", http.Header{"Authorization": {"Bearer " + join(testIdentity, time.Now().Add(-time.Hour))}}},
		{"a token for another audience", http.Header{"Authorization": {"Bearer " + e.signed(t, wrongAud)}}},
		{"a token for another broker of the same CA", http.Header{"Authorization": {"Bearer " + e.signed(t, otherBroker)}}},
		{"an unbound token (no broker named)", http.Header{"Authorization": {"Bearer " + e.signed(t, unbound)}}},
		{"a token from another issuer", http.Header{"Authorization": {"Bearer " + e.signed(t, wrongIss)}}},
		{"an unsigned alg none token", http.Header{"Authorization": {"Bearer " + algNone}}},
		{"a token with a changed payload", http.Header{"Authorization": {"Bearer " + tampered}}},
		{"a token from another CA", http.Header{"Authorization": {"Bearer " + foreign}}},
		{"a token used before", http.Header{"Authorization": {"Bearer " + used}}},
		{"a token for a revoked identity", http.Header{"Authorization": {"Bearer " + join(revokedIdentity, time.Now())}}},
	}
	var first *apiv1.Problem
	for _, tc := range tests {
		rq := postCertificate(certBody(t, testIdentity), "", true)
		rq.header = tc.header
		if tc.name == "a token for a revoked identity" {
			rq.body = certBody(t, revokedIdentity)
		}
		rec := h.do(rq)
		p := requireProblem(t, rec, http.StatusUnauthorized, "unauthenticated")
		require.Equal(t, `Bearer realm="tokenbroker-enrollment"`, rec.Header().Get("WWW-Authenticate"), tc.name)
		p.RequestID = ""
		if first == nil {
			first = &p
			require.Equal(t, enrollUnauthenticatedDetail, p.Detail)
			continue
		}
		require.Equal(t, *first, p, "%s must look like every other failure", tc.name)
	}

	// No log line holds a token.
	for _, entry := range h.logs.All() {
		for k, v := range entry.ContextMap() {
			s, _ := json.Marshal(v)
			require.NotContains(t, string(s), parts[2], "field %s", k)
			require.NotContains(t, string(s), strings.Split(used, ".")[2], "field %s", k)
		}
	}
}

func TestEnrollmentAfterAValidToken(t *testing.T) {
	t.Parallel()
	e := newRealBroker(t)
	h := newHarnessWith(t, e.b)
	tok, _, err := e.ca.IssueJoinToken(pki.JoinTokenOptions{Identity: testIdentity, Audiences: []string{"east"}})
	require.NoError(t, err)

	t.Run("A CSR that does not parse is 400 on the csr field.", func(t *testing.T) {
		p := requireProblem(t, h.do(postCertificate(`{"csr":"-----BEGIN CERTIFICATE REQUEST-----\nAA==\n-----END CERTIFICATE REQUEST-----\n"}`, tok, true)), 400, "invalid-request")
		require.Equal(t, "csr", p.Errors[0].Field)
	})
	t.Run("A CSR for another identity is 403.", func(t *testing.T) {
		requireProblem(t, h.do(postCertificate(certBody(t, "spiffe://oc.example/cluster/east"), tok, true)), 403, "forbidden")
	})
	t.Run("The right CSR is 201 with a certificate for the identity; the access log names it.", func(t *testing.T) {
		rec := h.do(postCertificate(certBody(t, testIdentity), tok, true))
		require.Equal(t, http.StatusCreated, rec.Code, rec.Body.String())
		var resp apiv1.CertificateResponse
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &resp))
		require.Equal(t, testIdentity, resp.Identity)
		line := h.logs.FilterMessage("request").All()
		last := line[len(line)-1].ContextMap()
		require.Equal(t, "enroll", last["listener"])
		require.Equal(t, testIdentity, last["identity"])
	})
	t.Run("The same token again is 401.", func(t *testing.T) {
		requireProblem(t, h.do(postCertificate(certBody(t, testIdentity), tok, true)), 401, "unauthenticated")
	})
}

// fakeAnchors is a client-CA bundle that tests change.
type fakeAnchors struct {
	mu    sync.Mutex
	certs []*x509.Certificate
}

func (f *fakeAnchors) Certificates() []*x509.Certificate {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.certs
}

func (f *fakeAnchors) set(certs ...*x509.Certificate) {
	f.mu.Lock()
	f.certs = certs
	f.mu.Unlock()
}

func TestAClientWhoseCAWasRemovedFromTheBundleIsRefused(t *testing.T) {
	t.Parallel()
	anchors := &fakeAnchors{}
	b := &fakeBroker{}
	h := newHarness(t, b, func(c *Config) { c.ClientCAs = anchors })
	anchors.set(h.pki.ca.Certificate())
	require.Equal(t, http.StatusOK, h.do(request{method: http.MethodGet, path: "/v1/whoami"}).Code)

	other, err := pki.NewCA(pki.CAOptions{})
	require.NoError(t, err)
	anchors.set(other.Certificate())
	p := requireProblem(t, h.do(request{method: http.MethodGet, path: "/v1/whoami"}), 401, "unauthenticated")
	require.Equal(t, classUnauthenticated.detail, p.Detail)

	// The refusal is audited with what is known of the caller.
	refused := b.refused()
	require.Len(t, refused, 1)
	require.Equal(t, audit.RefusedUntrustedCA, refused[0].code)
	require.Equal(t, testIdentity, refused[0].caller.Identity)
	require.Equal(t, pki.Fingerprint(h.pki.client.Cert), refused[0].caller.CertSHA256)
	require.Equal(t, p.RequestID, refused[0].requestID)
	require.Contains(t, refused[0].reason, "no longer in the client CA bundle")
}

func TestARevokedCallerIsAuditedAndAnAcceptedOneIsNot(t *testing.T) {
	t.Parallel()
	var revoked atomic.Bool
	b := &fakeBroker{revoked: func(string, ...string) bool { return revoked.Load() }}
	h := newHarness(t, b)
	require.Equal(t, http.StatusOK, h.do(request{method: http.MethodGet, path: "/v1/whoami"}).Code)
	require.Empty(t, b.refused())
	revoked.Store(true)
	requireProblem(t, h.do(request{method: http.MethodGet, path: "/v1/whoami"}), 401, "unauthenticated")
	refused := b.refused()
	require.Len(t, refused, 1)
	require.Equal(t, audit.RefusedRevoked, refused[0].code)
	require.Equal(t, testIdentity, refused[0].caller.Identity)
}

func TestRevocationEndsKeepAliveConnections(t *testing.T) {
	t.Parallel()
	var (
		mu              sync.Mutex
		revokedSerial   string
		revokedIdentity string
	)
	b := &fakeBroker{revoked: func(identity string, serials ...string) bool {
		mu.Lock()
		defer mu.Unlock()
		if identity == revokedIdentity {
			return true
		}
		for _, s := range serials {
			if s == revokedSerial {
				return true
			}
		}
		return false
	}}
	r := startServer(t, b, nil)
	c := r.client(r.goodClientCert(t))
	serial := r.pki.client.Cert.SerialNumber.Text(16)

	var reused atomic.Bool
	get := func() int {
		t.Helper()
		trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused.Store(i.Reused) }}
		req, err := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), http.MethodGet, r.apiURL("/v1/whoami"), nil)
		require.NoError(t, err)
		resp, err := c.Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusOK, get())

	mu.Lock()
	revokedSerial = serial
	mu.Unlock()
	require.Equal(t, http.StatusUnauthorized, get())
	require.True(t, reused.Load(), "the refusal came on the kept-alive connection")

	mu.Lock()
	revokedSerial, revokedIdentity = "", testIdentity
	mu.Unlock()
	require.Equal(t, http.StatusUnauthorized, get())
	require.True(t, reused.Load())

	mu.Lock()
	revokedIdentity = ""
	mu.Unlock()
	require.Equal(t, http.StatusOK, get())
}

func TestEnrollmentOverRealTLS(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t)
	var got atomic.Value
	b := &fakeBroker{enroll: func(_ context.Context, token string, _ apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
		got.Store(token)
		return testCertificateResponse(testIdentity), nil
	}}
	r := startServer(t, b, nil, withEnrollment(t, p))
	require.NotNil(t, r.srv.EnrollAddr())
	base := "https://" + r.srv.EnrollAddr().String()

	// No client certificate at all, as a cluster that is joining. (The
	// enrollment listener here has its own test PKI.)
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: pki.ClientTLSConfig(p.ca.CertPool(), nil)}}
	req, err := http.NewRequest(http.MethodPost, base+"/v1/certificates", strings.NewReader(`{"csr":"x"}`))
	require.NoError(t, err)
	req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
	req.Header.Set("Authorization", "Bearer the.join.token")
	resp, err := c.Do(req)
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Equal(t, "the.join.token", got.Load())

	resp, err = c.Get(base + "/v1/whoami")
	require.NoError(t, err)
	_ = resp.Body.Close()
	require.Equal(t, http.StatusNotFound, resp.StatusCode)

	// A client without a certificate is refused by the mTLS listener in
	// the handshake, even for the trust bundle.
	resp, err = r.client(nil).Get(r.apiURL("/v1/trust-bundle"))
	if resp != nil {
		_ = resp.Body.Close()
	}
	require.Error(t, err)

	// The enrollment listener offers TLS 1.3 only.
	cfg := pki.ClientTLSConfig(p.ca.CertPool(), nil)
	cfg.MinVersion, cfg.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
	_, err = tls.Dial("tcp", r.srv.EnrollAddr().String(), cfg)
	require.ErrorContains(t, err, "protocol version")
}

func TestNewRefusesABadEnrollmentConfig(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t)
	base := Config{Addr: ":0", OpsAddr: ":0", TLSConfig: p.serverTLSConfig(t), Broker: &fakeBroker{}}

	noTLS := base
	noTLS.EnrollAddr = ":0"
	_, err := New(noTLS)
	require.ErrorContains(t, err, "EnrollTLSConfig is required")

	old := base
	old.EnrollAddr = ":0"
	old.EnrollTLSConfig = &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{{}}}
	_, err = New(old)
	require.ErrorContains(t, err, "TLS 1.3")

	noCert := base
	noCert.EnrollAddr = ":0"
	noCert.EnrollTLSConfig = &tls.Config{MinVersion: tls.VersionTLS13}
	_, err = New(noCert)
	require.ErrorContains(t, err, "no server certificate")
}

func FuzzBearerToken(f *testing.F) {
	f.Add("Bearer eyJhbGciOiJFUzI1NiJ9.e30.c2ln")
	f.Add("bearer  a.b.c")
	f.Add("Basic dXNlcjpwYXNz")
	f.Add("Bearer ")
	f.Add("Bearer a b")
	f.Fuzz(func(t *testing.T, value string) {
		tok, ok := bearerToken(http.Header{"Authorization": {value}})
		if !ok {
			require.Empty(t, tok)
			return
		}
		require.NotEmpty(t, tok)
		require.LessOrEqual(t, len(tok), pki.MaxJoinTokenBytes)
		require.NotContains(t, tok, " ")
		require.True(t, strings.HasSuffix(value, tok))
	})
}
