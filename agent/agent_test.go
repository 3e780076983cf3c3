package agent

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// httpBroker is a stand-in for the broker's API over real mutual TLS: it
// enrolls with join tokens, renews, issues and revokes leases, and records
// which client certificate made each request.
type httpBroker struct {
	pki      *testPKI
	srv      *httptest.Server
	verifier *pki.JoinTokenVerifier
	ttl      time.Duration

	mu       sync.Mutex
	down     bool
	n        int
	revoked  []string
	serials  []string // client certificate serial of each POST /v1/kubeconfigs
	enrolled int
}

func newHTTPBroker(t *testing.T, p *testPKI) *httpBroker {
	t.Helper()
	b := &httpBroker{pki: p, ttl: time.Hour,
		verifier: pki.NewJoinTokenVerifier([]*x509.Certificate{p.ca.Certificate()}, p.clock.Now)}
	kp, err := p.ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, Lifetime: 48 * time.Hour})
	require.NoError(t, err)
	cert, err := kp.TLSCertificate()
	require.NoError(t, err)
	b.srv = httptest.NewUnstartedServer(http.HandlerFunc(b.serve))
	b.srv.TLS = &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.VerifyClientCertIfGiven,
		ClientCAs:    p.ca.CertPool(),
		Time:         p.clock.Now, // client certificates are issued on the fake clock
	}
	b.srv.StartTLS()
	t.Cleanup(b.srv.Close)
	return b
}

func (b *httpBroker) problem(w http.ResponseWriter, status int) {
	w.Header().Set("Content-Type", apiv1.MediaTypeProblem)
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(apiv1.Problem{Title: http.StatusText(status), Status: status})
}

func (b *httpBroker) reply(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (b *httpBroker) serve(w http.ResponseWriter, r *http.Request) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var peer string
	if r.TLS != nil && len(r.TLS.VerifiedChains) > 0 {
		peer = r.TLS.PeerCertificates[0].SerialNumber.Text(16)
	}
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/v1/trust-bundle":
		b.reply(w, http.StatusOK, apiv1.TrustBundle{CABundle: string(b.pki.ca.BundlePEM())})
	case r.Method == http.MethodPost && r.URL.Path == "/v1/certificates":
		var req apiv1.CertificateRequest
		if json.NewDecoder(r.Body).Decode(&req) != nil {
			b.problem(w, http.StatusBadRequest)
			return
		}
		if token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			if _, err := b.verifier.Verify(token); err != nil {
				b.problem(w, http.StatusUnauthorized)
				return
			}
			b.enrolled++
		} else if peer == "" {
			b.problem(w, http.StatusUnauthorized)
			return
		}
		resp, err := b.pki.sign([]byte(req.CSR))
		if err != nil {
			b.problem(w, http.StatusBadRequest)
			return
		}
		b.reply(w, http.StatusCreated, resp)
	case peer == "":
		b.problem(w, http.StatusUnauthorized)
	case b.down:
		b.problem(w, http.StatusServiceUnavailable)
	case r.Method == http.MethodPost && r.URL.Path == "/v1/kubeconfigs":
		b.n++
		b.serials = append(b.serials, peer)
		token := fmt.Sprintf("token-%d-SECRET", b.n)
		b.reply(w, http.StatusCreated, apiv1.KubeconfigResponse{
			LeaseID:    leaseID(b.n),
			Kubeconfig: testKubeconfig("https://east.example.com:6443", token),
			Token:      token,
			ExpiresAt:  b.pki.clock.Now().Add(b.ttl),
			GrantedTTL: b.ttl.String(),
		})
	case r.Method == http.MethodDelete && strings.HasPrefix(r.URL.Path, "/v1/leases/"):
		b.revoked = append(b.revoked, strings.TrimPrefix(r.URL.Path, "/v1/leases/"))
		w.WriteHeader(http.StatusNoContent)
	default:
		b.problem(w, http.StatusNotFound)
	}
}

func (b *httpBroker) snapshot() (issued int, revoked, serials []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n, append([]string(nil), b.revoked...), append([]string(nil), b.serials...)
}

func (b *httpBroker) setDown(down bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.down = down
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(body)
}

func TestTheAgentEnrollsRefreshesRevokesAndRenewsAgainstABrokerOverMutualTLS(t *testing.T) {
	t.Parallel()
	// The fake clock starts at the wall clock: the broker's server
	// certificate is checked against real time by the agent.
	clock := newFakeClock(time.Now().Truncate(time.Second))
	start := clock.Now()
	p := newTestPKI(t, clock)
	p.lifetime = 2 * time.Hour
	b := newHTTPBroker(t, p)

	dir := t.TempDir()
	token, _, err := p.ca.IssueJoinToken(pki.JoinTokenOptions{Identity: westID})
	require.NoError(t, err)
	tokenFile := filepath.Join(dir, "join.token")
	require.NoError(t, os.WriteFile(tokenFile, []byte(token+"\n"), 0o600))
	kubeconfigFile := filepath.Join(dir, "east.kubeconfig")

	cfg, err := config.Parse(fmt.Appendf(nil, `
identity:
  secret: {namespace: tokenbroker-agent, name: agent-identity}
  enroll: {broker: %[1]q, caFingerprint: %[2]q, tokenFile: %[3]q}
targets:
  - name: east
    broker: %[1]q
    request: {namespace: argo, serviceAccount: admiralty-source, ttl: 1h}
    refresh: {revokeGrace: 1m}
    outputs:
      - secret: {namespace: admiralty, name: east, format: admiralty}
      - file: {path: %[4]q}
`, b.srv.URL, pki.Fingerprint(p.ca.Certificate()), tokenFile, kubeconfigFile), "")
	require.NoError(t, err)

	cs := fake.NewClientset()
	core, logs := observer.New(zap.DebugLevel)
	reg := prometheus.NewRegistry()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	a, err := New(cfg, Deps{Kubernetes: cs, Logger: zap.New(core), Registry: reg, Clock: clock, Rand: fixedRand(0), OpsListener: ln})
	require.NoError(t, err)
	ops := "http://" + ln.Addr().String()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()

	eventually := func(msg string, cond func() bool) {
		t.Helper()
		require.Eventually(t, cond, 10*time.Second, 5*time.Millisecond, msg)
	}
	// Idle means both loops (refresher and renewer) wait on their timers.
	idle := func() bool { return clock.Waiters() == 2 }
	secretLease := func() string {
		s, err := cs.CoreV1().Secrets("admiralty").Get(context.Background(), "east", metav1.GetOptions{})
		if err != nil {
			return ""
		}
		return s.Annotations[config.AnnotationLeaseID]
	}

	// Start: enroll, store the identity in its Secret, write both outputs.
	eventually("ready", func() bool { code, _ := httpGet(t, ops+"/readyz"); return code == http.StatusOK })
	eventually("idle after start", idle)
	require.Equal(t, leaseID(1), secretLease())
	id, err := cs.CoreV1().Secrets("tokenbroker-agent").Get(ctx, "agent-identity", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, corev1.SecretTypeTLS, id.Type)
	kc, err := os.ReadFile(kubeconfigFile)
	require.NoError(t, err)
	require.Contains(t, string(kc), "token-1-SECRET")
	code, _ := httpGet(t, ops+"/healthz")
	require.Equal(t, http.StatusOK, code)
	_, _, serials := b.snapshot()
	firstSerial := serials[0]

	// At 2/3 of the hour: a new lease; the old one is revoked a minute later.
	clock.SetTime(start.Add(40 * time.Minute))
	eventually("second lease", func() bool { return secretLease() == leaseID(2) && idle() })
	_, revoked, _ := b.snapshot()
	require.Empty(t, revoked, "not before the grace")
	clock.SetTime(start.Add(41 * time.Minute))
	eventually("revoked", func() bool { _, r, _ := b.snapshot(); return len(r) == 1 && idle() })
	_, revoked, _ = b.snapshot()
	require.Equal(t, []string{leaseID(1)}, revoked)

	// The certificate (2h from issuance, NotBefore backdated 5m) renews at
	// 0.66 of its lifetime from issuance, 79.2 minutes in; the next
	// request presents the new one.
	clock.SetTime(start.Add(79*time.Minute + 30*time.Second))
	eventually("renewed", func() bool {
		return testutil.ToFloat64(a.metrics.renewals.WithLabelValues(resultSuccess)) == 1 && idle()
	})
	stored, err := cs.CoreV1().Secrets("tokenbroker-agent").Get(ctx, "agent-identity", metav1.GetOptions{})
	require.NoError(t, err)
	require.NotEqual(t, id.Data["tls.crt"], stored.Data["tls.crt"], "the renewed certificate is stored")
	clock.SetTime(start.Add(80 * time.Minute))
	eventually("third lease", func() bool { return secretLease() == leaseID(3) && idle() })
	_, _, serials = b.snapshot()
	require.NotEqual(t, firstSerial, serials[len(serials)-1], "the renewed certificate is presented")
	clock.SetTime(start.Add(81 * time.Minute))
	eventually("lease 2 revoked", func() bool { _, r, _ := b.snapshot(); return len(r) == 2 && idle() })

	// The broker goes down at the next refresh: the outputs keep lease 3,
	// the failure shows in the metrics, and the agent recovers.
	b.setDown(true)
	clock.SetTime(start.Add(120 * time.Minute))
	eventually("failure counted", func() bool {
		return testutil.ToFloat64(a.metrics.refresh.WithLabelValues("east", resultFailure)) == 1 && idle()
	})
	require.Equal(t, leaseID(3), secretLease())
	code, _ = httpGet(t, ops+"/healthz")
	require.Equal(t, http.StatusOK, code, "the retry comes long before lease 3 expires")
	b.setDown(false)
	clock.SetTime(start.Add(120*time.Minute + time.Second))
	eventually("recovered", func() bool { return secretLease() == leaseID(4) && idle() })

	// Metrics are served, expiries computed at scrape time.
	_, body := httpGet(t, ops+"/metrics")
	require.Contains(t, body, `tokenbroker_agent_credential_expiry_seconds{target="east"} 3600`)
	require.Contains(t, body, `tokenbroker_agent_refresh_total{result="success",target="east"} 4`)
	require.Contains(t, body, "tokenbroker_agent_certificate_expiry_seconds ")

	// Shutdown revokes nothing: consumers keep working.
	cancel()
	require.NoError(t, <-done)
	issued, revoked, _ := b.snapshot()
	require.Equal(t, 4, issued)
	require.Equal(t, []string{leaseID(1), leaseID(2)}, revoked, "lease 3's grace had not passed; lease 4 is current")
	require.Zero(t, testutil.ToFloat64(a.metrics.revocations.WithLabelValues("east", resultFailure)))

	for _, e := range logs.All() {
		line := fmt.Sprint(e.Message, e.ContextMap())
		require.NotContains(t, line, token, "the join token is never logged")
		require.NotContains(t, line, "SECRET", "no credential is logged")
		require.NotContains(t, line, "PRIVATE KEY")
	}
	require.NotEmpty(t, logs.FilterMessage("the join token was used; it cannot be used again").All())
}

func TestWithoutAnIdentityOrEnrollmentTheAgentFailsClearly(t *testing.T) {
	t.Parallel()
	cfg, err := config.Parse(fmt.Appendf(nil, `
identity: {dir: %q}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: sa}
    outputs: [{file: {path: /tmp/x}}]
`, filepath.Join(t.TempDir(), "identity")), "")
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	a, err := New(cfg, Deps{OpsListener: ln})
	require.NoError(t, err)
	err = a.Run(context.Background())
	require.ErrorIs(t, err, errNoIdentity)
	require.ErrorContains(t, err, "identity.enroll is not set")
	require.ErrorContains(t, a.Run(context.Background()), "Run called twice")
}

func TestNewRefusesASecretOutputWithoutAKubernetesClient(t *testing.T) {
	t.Parallel()
	cfg, err := config.Parse(exampleConfig(t), "")
	require.NoError(t, err)
	_, err = New(cfg, Deps{})
	require.ErrorContains(t, err, "Deps.Kubernetes is required")
}

func TestReadinessWaitsForEveryOutputAndHealthForExpiredCertificates(t *testing.T) {
	t.Parallel()
	cfg, err := config.Parse(exampleConfig(t), "")
	require.NoError(t, err)
	clock := newFakeClock(t0)
	a, err := New(cfg, Deps{Kubernetes: fake.NewClientset(), Clock: clock})
	require.NoError(t, err)
	srv := httptest.NewServer(a.Handler())
	defer srv.Close()

	code, body := httpGet(t, srv.URL+"/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "not ready: no client certificate yet\n", body)

	p := newTestPKI(t, clock)
	a.holder.set(p.identity(t))
	code, body = httpGet(t, srv.URL+"/readyz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Equal(t, "not ready: no credential written yet for east, south\n", body)
	for _, r := range a.targets {
		r.update(func(s *targetStatus) {
			for i := range s.held {
				s.held[i] = &grant{expiresAt: t0.Add(time.Hour)}
			}
			s.nextAttempt = t0.Add(40 * time.Minute)
		})
	}
	code, _ = httpGet(t, srv.URL+"/readyz")
	require.Equal(t, http.StatusOK, code)
	code, _ = httpGet(t, srv.URL+"/healthz")
	require.Equal(t, http.StatusOK, code)

	clock.SetTime(t0.Add(25 * time.Hour))
	code, body = httpGet(t, srv.URL+"/healthz")
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.Contains(t, body, "client certificate expired at")
	require.Contains(t, body, "target east: credential expired at")
}
