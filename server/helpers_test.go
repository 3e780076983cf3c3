package server

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/pki"
)

const (
	testIdentity = "spiffe://oc.example/cluster/west"
	testLeaseID  = "abcdefghijklmnopqrstuvwxyz"
	// testToken is what the fake broker mints; it must never reach a log.
	testToken = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0LXRva2VuLXZhbHVl.signature"
)

const testKubeconfig = "apiVersion: v1\nkind: Config\nusers:\n- name: west\n  user:\n    token: " + testToken + "\n"

// fakeBroker answers with the functions it is given, or with defaults, and
// counts calls so that tests can prove the broker was not reached.
type fakeBroker struct {
	issue func(ctx context.Context, c broker.Caller, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error)
	exec  func(ctx context.Context, c broker.Caller, req apiv1.KubeconfigRequest, brokerURL string) ([]byte, error)
	list  func(ctx context.Context, c broker.Caller) ([]apiv1.Lease, error)
	// page, if set, answers ListLeases instead of list.
	page   func(ctx context.Context, c broker.Caller, req lease.PageRequest) (*apiv1.LeaseList, error)
	get    func(ctx context.Context, c broker.Caller, id string) (*apiv1.Lease, error)
	revoke func(ctx context.Context, c broker.Caller, id string) error
	whoami func(c broker.Caller) (string, []apiv1.Grant)
	ready  func(ctx context.Context) error
	// The optional abilities, CertificateIssuer and RevocationChecker.
	enroll      func(ctx context.Context, token string, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error)
	renew       func(ctx context.Context, c broker.Caller, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error)
	trustBundle func() apiv1.TrustBundle
	revoked     func(identity string, serials ...string) bool
	revokedPod  func(uid string) bool

	calls atomic.Int32

	mu       sync.Mutex
	callers  []broker.Caller
	refusals []refusal
}

var (
	_ Broker            = (*fakeBroker)(nil)
	_ CertificateIssuer = (*fakeBroker)(nil)
	_ RevocationChecker = (*fakeBroker)(nil)
	_ RefusalAuditor    = (*fakeBroker)(nil)
)

// plainBroker hides the optional abilities of the Broker it wraps.
type plainBroker struct{ Broker }

func (f *fakeBroker) record(c broker.Caller) {
	f.calls.Add(1)
	f.mu.Lock()
	f.callers = append(f.callers, c)
	f.mu.Unlock()
}

func (f *fakeBroker) lastCaller() broker.Caller {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.callers[len(f.callers)-1]
}

func testResponse() *apiv1.KubeconfigResponse {
	return &apiv1.KubeconfigResponse{
		LeaseID:      testLeaseID,
		Kubeconfig:   testKubeconfig,
		Token:        testToken,
		ExpiresAt:    time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC),
		RequestedTTL: "2h0m0s",
		GrantedTTL:   "1h0m0s",
		ClampedBy:    "grant.maxTTL",
	}
}

func testLease() apiv1.Lease {
	return apiv1.Lease{
		ID: testLeaseID, Peer: "west", Namespace: "argo", ServiceAccount: "admiralty-source",
		Credential: apiv1.CredentialToken,
		CreatedAt:  time.Date(2030, 1, 2, 2, 4, 5, 0, time.UTC),
		ExpiresAt:  time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC),
	}
}

func (f *fakeBroker) IssueKubeconfig(ctx context.Context, c broker.Caller, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
	f.record(c)
	if f.issue != nil {
		return f.issue(ctx, c, req)
	}
	return testResponse(), nil
}

func (f *fakeBroker) ExecKubeconfig(ctx context.Context, c broker.Caller, req apiv1.KubeconfigRequest, brokerURL string) ([]byte, error) {
	f.record(c)
	if f.exec != nil {
		return f.exec(ctx, c, req, brokerURL)
	}
	return []byte("apiVersion: v1\nkind: Config\n# exec " + brokerURL + "\n"), nil
}

func (f *fakeBroker) ListLeases(ctx context.Context, c broker.Caller, req lease.PageRequest) (*apiv1.LeaseList, error) {
	f.record(c)
	if f.page != nil {
		return f.page(ctx, c, req)
	}
	if f.list != nil {
		items, err := f.list(ctx, c)
		if err != nil {
			return nil, err
		}
		return &apiv1.LeaseList{Items: items}, nil
	}
	return &apiv1.LeaseList{Items: []apiv1.Lease{testLease()}}, nil
}

func (f *fakeBroker) GetLease(ctx context.Context, c broker.Caller, id string) (*apiv1.Lease, error) {
	f.record(c)
	if f.get != nil {
		return f.get(ctx, c, id)
	}
	l := testLease()
	l.ID = id
	return &l, nil
}

func (f *fakeBroker) RevokeLease(ctx context.Context, c broker.Caller, id string) error {
	f.record(c)
	if f.revoke != nil {
		return f.revoke(ctx, c, id)
	}
	return nil
}

func (f *fakeBroker) WhoAmI(c broker.Caller) (string, []apiv1.Grant) {
	f.record(c)
	if f.whoami != nil {
		return f.whoami(c)
	}
	return "west", []apiv1.Grant{{
		Namespaces: []string{"argo"}, ServiceAccounts: []string{"admiralty-source"},
		MaxTTL: "12h", Credential: apiv1.CredentialToken,
	}}
}

// testCertificateResponse is what the fake broker issues.
func testCertificateResponse(identity string) *apiv1.CertificateResponse {
	return &apiv1.CertificateResponse{
		Identity:     identity,
		Certificate:  "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
		SerialNumber: "1f",
		NotBefore:    time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC),
		NotAfter:     time.Date(2030, 1, 3, 3, 4, 5, 0, time.UTC),
		CABundle:     testBundlePEM,
	}
}

const testBundlePEM = "-----BEGIN CERTIFICATE-----\nMIIC\n-----END CERTIFICATE-----\n"

func (f *fakeBroker) Enroll(ctx context.Context, token string, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	f.record(broker.Caller{})
	if f.enroll != nil {
		return f.enroll(ctx, token, req)
	}
	return testCertificateResponse(testIdentity), nil
}

func (f *fakeBroker) Renew(ctx context.Context, c broker.Caller, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	f.record(c)
	if f.renew != nil {
		return f.renew(ctx, c, req)
	}
	return testCertificateResponse(c.Identity), nil
}

func (f *fakeBroker) TrustBundle() apiv1.TrustBundle {
	if f.trustBundle != nil {
		return f.trustBundle()
	}
	return apiv1.TrustBundle{CABundle: testBundlePEM, Fingerprints: []string{"sha256:" + strings.Repeat("ab", 32)}}
}

// refusal is one RefuseCaller call.
type refusal struct {
	caller       broker.Caller
	code, reason string
	requestID    string
}

func (f *fakeBroker) RefuseCaller(ctx context.Context, c broker.Caller, code, reason string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refusals = append(f.refusals, refusal{c, code, reason, audit.RequestID(ctx)})
}

func (f *fakeBroker) refused() []refusal {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]refusal(nil), f.refusals...)
}

func (f *fakeBroker) Revoked(identity string, serials ...string) bool {
	if f.revoked != nil {
		return f.revoked(identity, serials...)
	}
	return false
}

func (f *fakeBroker) RevokedPod(uid string) bool {
	return f.revokedPod != nil && f.revokedPod(uid)
}

func (f *fakeBroker) Ready(ctx context.Context) error {
	if f.ready != nil {
		return f.ready(ctx)
	}
	return nil
}

// testPKI is a CA with a server and a client certificate, written to files
// for the production TLS profile.
type testPKI struct {
	ca       *pki.CA
	server   *pki.KeyPair
	client   *pki.KeyPair
	certFile string
	keyFile  string
}

func newTestPKI(t *testing.T) *testPKI {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "test CA", Lifetime: 24 * time.Hour})
	require.NoError(t, err)
	srv, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, Lifetime: time.Hour})
	require.NoError(t, err)
	cli, err := ca.IssueClient(pki.ClientOptions{Identity: testIdentity, Lifetime: time.Hour})
	require.NoError(t, err)
	dir := t.TempDir()
	p := &testPKI{ca: ca, server: srv, client: cli, certFile: dir + "/tls.crt", keyFile: dir + "/tls.key"}
	require.NoError(t, srv.WriteFiles(p.certFile, p.keyFile))
	return p
}

// serverTLSConfig is the production profile over the test files; extra
// CAs are also trusted for client certificates.
func (p *testPKI) serverTLSConfig(t *testing.T, extraCAs ...*x509.Certificate) *tls.Config {
	t.Helper()
	reloader, err := pki.NewCertReloader(p.certFile, p.keyFile)
	require.NoError(t, err)
	pool := p.ca.CertPool()
	for _, c := range extraCAs {
		pool.AddCert(c)
	}
	return pki.ServerTLSConfig(reloader, pool)
}

// verifiedState is the TLS state the handshake leaves for a verified cert.
func (p *testPKI) verifiedState(cert *x509.Certificate) *tls.ConnectionState {
	return &tls.ConnectionState{
		Version:           tls.VersionTLS13,
		HandshakeComplete: true,
		PeerCertificates:  []*x509.Certificate{cert},
		VerifiedChains:    [][]*x509.Certificate{{cert, p.ca.Certificate()}},
	}
}

// selfMadeCert makes, with the standard library only, a CA and a client
// certificate it signs carrying the given URI SANs: certificates pki would
// refuse to issue.
func selfMadeCert(t *testing.T, uris ...string) (caCert *x509.Certificate, leaf tls.Certificate) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "other CA"},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	require.NoError(t, err)
	caCert, err = x509.ParseCertificate(caDER)
	require.NoError(t, err)

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "no identity"},
		NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	for _, u := range uris {
		parsed, err := url.Parse(u)
		require.NoError(t, err)
		tmpl.URIs = append(tmpl.URIs, parsed)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return caCert, tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: cert}
}

// harness is a Server built for handler tests, with its log and registry.
type harness struct {
	t      *testing.T
	pki    *testPKI
	broker *fakeBroker
	srv    *Server
	logs   *observer.ObservedLogs
	reg    *prometheus.Registry
}

type harnessOption func(*Config)

func newHarness(t *testing.T, b *fakeBroker, opts ...harnessOption) *harness {
	t.Helper()
	if b == nil {
		b = &fakeBroker{}
	}
	h := newHarnessWith(t, b, opts...)
	h.broker = b
	return h
}

// newHarnessWith is newHarness for any Broker; h.broker is nil.
func newHarnessWith(t *testing.T, b Broker, opts ...harnessOption) *harness {
	t.Helper()
	p := newTestPKI(t)
	core, logs := observer.New(zapcore.DebugLevel)
	reg := prometheus.NewRegistry()
	cfg := Config{
		Addr:       "127.0.0.1:0",
		OpsAddr:    "127.0.0.1:0",
		TLSConfig:  p.serverTLSConfig(t),
		Logger:     zap.New(core),
		Registerer: reg,
		Gatherer:   reg,
		Broker:     b,
	}
	for _, o := range opts {
		o(&cfg)
	}
	srv, err := New(cfg)
	require.NoError(t, err)
	return &harness{t: t, pki: p, srv: srv, logs: logs, reg: reg}
}

// request is one API call in a handler test.
type request struct {
	method      string
	path        string
	body        string
	contentType string
	accept      string
	header      http.Header
	// tls overrides the verified state of the test client certificate;
	// noTLS sends a request without TLS state.
	tls   *tls.ConnectionState
	noTLS bool
	// unknownLength sends the body without a Content-Length.
	unknownLength bool
	// enroll sends the request to the enrollment listener's handler, with
	// a TLS state that has no client certificate (unless tls is set).
	enroll bool
}

func (h *harness) do(rq request) *httptest.ResponseRecorder {
	h.t.Helper()
	var body io.Reader = http.NoBody
	if rq.body != "" {
		body = strings.NewReader(rq.body)
	}
	r := httptest.NewRequest(rq.method, "https://broker.test"+rq.path, body)
	for k, vs := range rq.header {
		for _, v := range vs {
			r.Header.Add(k, v)
		}
	}
	if rq.contentType != "" {
		r.Header.Set("Content-Type", rq.contentType)
	}
	if rq.accept != "" {
		r.Header.Set("Accept", rq.accept)
	}
	if rq.unknownLength {
		r.ContentLength = -1
	}
	switch {
	case rq.noTLS:
		r.TLS = nil
	case rq.tls != nil:
		r.TLS = rq.tls
	case rq.enroll:
		r.TLS = &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true}
	default:
		r.TLS = h.pki.verifiedState(h.pki.client.Cert)
	}
	rec := httptest.NewRecorder()
	if rq.enroll {
		h.srv.EnrollHandler().ServeHTTP(rec, r)
	} else {
		h.srv.Handler().ServeHTTP(rec, r)
	}
	return rec
}

// postKubeconfig is a valid POST /v1/kubeconfigs.
func postKubeconfig(body string) request {
	return request{method: http.MethodPost, path: "/v1/kubeconfigs", body: body, contentType: "application/json"}
}

const validBody = `{"namespace":"argo","serviceAccount":"admiralty-source","ttl":"2h","minTTL":"30m","audiences":["https://kubernetes.default.svc"],"credential":"token"}`

// requireProblem checks a problem+json answer and returns it.
func requireProblem(t *testing.T, rec *httptest.ResponseRecorder, status int, slug string) apiv1.Problem {
	t.Helper()
	require.Equal(t, status, rec.Code, "body: %s", rec.Body.String())
	require.Equal(t, apiv1.MediaTypeProblem, rec.Header().Get("Content-Type"))
	var p apiv1.Problem
	dec := json.NewDecoder(rec.Body)
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(&p))
	require.Equal(t, "urn:tokenbroker:problem:"+slug, p.Type)
	require.Equal(t, http.StatusText(status), p.Title)
	require.Equal(t, status, p.Status)
	require.NotEmpty(t, p.RequestID)
	require.Equal(t, rec.Header().Get("X-Request-Id"), p.RequestID)
	return p
}

// requireSecurityHeaders checks the headers every answer carries.
func requireSecurityHeaders(t *testing.T, h http.Header) {
	t.Helper()
	require.Equal(t, "no-store", h.Get("Cache-Control"))
	require.Equal(t, "nosniff", h.Get("X-Content-Type-Options"))
	require.Equal(t, "DENY", h.Get("X-Frame-Options"))
	require.NotEmpty(t, h.Get("X-Request-Id"))
}
