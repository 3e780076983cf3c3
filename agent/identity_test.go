package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

const westID = "spiffe://oc.example/cluster/west"

// testPKI is a CA on a fake clock that signs what a broker would.
type testPKI struct {
	ca       *pki.CA
	clock    *fakeClock
	lifetime time.Duration

	mu     sync.Mutex
	fail   error
	renews int
}

func newTestPKI(t *testing.T, clock *fakeClock) *testPKI {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "agent test CA", Now: clock.Now})
	require.NoError(t, err)
	return &testPKI{ca: ca, clock: clock, lifetime: 24 * time.Hour}
}

// identity issues a client certificate for westID, as enrollment would.
func (p *testPKI) identity(t *testing.T) *identity {
	t.Helper()
	kp, err := p.ca.IssueClient(pki.ClientOptions{Identity: westID, Lifetime: p.lifetime})
	require.NoError(t, err)
	id, err := parseIdentity(kp.CertPEM, kp.KeyPEM, p.ca.BundlePEM())
	require.NoError(t, err)
	return id
}

// sign answers a CSR as POST /v1/certificates does.
func (p *testPKI) sign(csrPEM []byte) (*apiv1.CertificateResponse, error) {
	csr, identity, err := pki.ParseCSRPEM(csrPEM)
	if err != nil {
		return nil, err
	}
	kp, err := p.ca.SignClient(csr, identity, p.lifetime)
	if err != nil {
		return nil, err
	}
	return &apiv1.CertificateResponse{
		Identity:     identity,
		Certificate:  string(kp.CertPEM),
		SerialNumber: kp.Cert.SerialNumber.Text(16),
		NotBefore:    kp.Cert.NotBefore,
		NotAfter:     kp.Cert.NotAfter,
		CABundle:     string(p.ca.BundlePEM()),
	}, nil
}

func (p *testPKI) Renew(_ context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fail != nil {
		return nil, p.fail
	}
	p.renews++
	resp, err := p.sign([]byte(req.CSR))
	if err != nil || req.ClusterCACSR == "" {
		return resp, err
	}
	return resp, p.signClusterCA(resp, req.ClusterCACSR)
}

func TestADirectoryIdentityRoundTrips(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t, newFakeClock(time.Now()))
	dir := IdentityDir(filepath.Join(t.TempDir(), "identity"))
	s := dirStore{dir: dir}
	_, err := s.load(context.Background())
	require.ErrorIs(t, err, errNoIdentity)

	id := p.identity(t)
	require.NoError(t, s.save(context.Background(), id))
	got, err := s.load(context.Background())
	require.NoError(t, err)
	require.Equal(t, id.certPEM, got.certPEM)
	require.Equal(t, id.keyPEM, got.keyPEM)
	require.Equal(t, westID, got.spiffeID)
	st, err := os.Stat(dir.Key())
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())

	entries, err := os.ReadDir(string(dir))
	require.NoError(t, err)
	require.Len(t, entries, 3, "no staged or temporary file is left")
}

func TestAnInterruptedReplacementNeverPairsAKeyWithAnotherCertificate(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t, newFakeClock(time.Now()))
	old, next := p.identity(t), p.identity(t)
	stage := func(dir IdentityDir, names ...string) {
		for _, n := range names {
			data := map[string][]byte{KeyFile: next.keyPEM, CertFile: next.certPEM, BundleFile: next.bundlePEM}[n]
			require.NoError(t, os.WriteFile(dir.staged(n), data, 0o600))
		}
	}
	rename := func(dir IdentityDir, names ...string) {
		for _, n := range names {
			require.NoError(t, os.Rename(dir.staged(n), filepath.Join(string(dir), n)))
		}
	}
	for _, tc := range []struct {
		name    string
		crash   func(IdentityDir)
		wantNew bool
	}{
		{"staging stopped after the key", func(d IdentityDir) { stage(d, KeyFile) }, false},
		{"staging stopped after the certificate", func(d IdentityDir) { stage(d, KeyFile, CertFile) }, false},
		{"staging done, nothing renamed", func(d IdentityDir) { stage(d, KeyFile, CertFile, BundleFile) }, true},
		{"the key renamed", func(d IdentityDir) { stage(d, KeyFile, CertFile, BundleFile); rename(d, KeyFile) }, true},
		{"key and certificate renamed", func(d IdentityDir) {
			stage(d, KeyFile, CertFile, BundleFile)
			rename(d, KeyFile, CertFile)
		}, true},
	} {
		dir := IdentityDir(t.TempDir())
		s := dirStore{dir: dir}
		require.NoError(t, s.save(context.Background(), old))
		tc.crash(dir)
		got, err := s.load(context.Background())
		require.NoError(t, err, tc.name)
		want := old
		if tc.wantNew {
			want = next
		}
		require.Equal(t, want.certPEM, got.certPEM, tc.name)
		require.Equal(t, want.keyPEM, got.keyPEM, tc.name)
		entries, err := os.ReadDir(string(dir))
		require.NoError(t, err)
		require.Len(t, entries, 3, tc.name)
	}
}

func TestAMismatchedKeyIsRefused(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t, newFakeClock(time.Now()))
	a, b := p.identity(t), p.identity(t)
	_, err := parseIdentity(a.certPEM, b.keyPEM, a.bundlePEM)
	require.Error(t, err)
}

func TestASecretIdentityRoundTripsAndKeepsAPrecreatedSecretsType(t *testing.T) {
	t.Parallel()
	p := newTestPKI(t, newFakeClock(time.Now()))
	ctx := context.Background()
	cs := fake.NewClientset()
	s := secretStore{secrets: cs.CoreV1(), ref: config.ObjectRef{Namespace: "tokenbroker-agent", Name: "agent-identity"}}
	_, err := s.load(ctx)
	require.ErrorIs(t, err, errNoIdentity)

	id := p.identity(t)
	require.NoError(t, s.save(ctx, id))
	sec, err := cs.CoreV1().Secrets("tokenbroker-agent").Get(ctx, "agent-identity", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, corev1.SecretTypeTLS, sec.Type)
	require.Equal(t, id.keyPEM, sec.Data["tls.key"])
	got, err := s.load(ctx)
	require.NoError(t, err)
	require.Equal(t, id.certPEM, got.certPEM)

	// An empty Opaque Secret made ahead of time (so that RBAC can name it)
	// holds no identity and is filled in place.
	pre := fake.NewClientset(&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "id"}, Type: corev1.SecretTypeOpaque})
	s = secretStore{secrets: pre.CoreV1(), ref: config.ObjectRef{Namespace: "ns", Name: "id"}}
	_, err = s.load(ctx)
	require.ErrorIs(t, err, errNoIdentity)
	require.NoError(t, s.save(ctx, id))
	sec, err = pre.CoreV1().Secrets("ns").Get(ctx, "id", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, corev1.SecretTypeOpaque, sec.Type)
	_, err = s.load(ctx)
	require.NoError(t, err)
}

type renewerFixture struct {
	r     *renewer
	clock *fakeClock
	pki   *testPKI
	store dirStore
	reg   *prometheus.Registry
	calls int
}

func newRenewerFixture(t *testing.T) *renewerFixture {
	t.Helper()
	clock := newFakeClock(t0)
	p := newTestPKI(t, clock)
	store := dirStore{dir: IdentityDir(t.TempDir())}
	id := p.identity(t)
	require.NoError(t, store.save(context.Background(), id))
	holder := &identityHolder{}
	holder.set(id)
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg)
	require.NoError(t, err)
	f := &renewerFixture{clock: clock, pki: p, store: store, reg: reg}
	f.r = &renewer{
		store: store, holder: holder, api: p, clock: clock, log: zap.NewNop(), metrics: m,
		sched:     schedule{fraction: 0.66, jitter: 0.1, minBackoff: time.Second, maxBackoff: 5 * time.Minute, rand: fixedRand(0)},
		onRenewed: func() { f.calls++ },
	}
	return f
}

func TestTheCertificateIsRenewedAtRenewAtOfItsLifetime(t *testing.T) {
	t.Parallel()
	f := newRenewerFixture(t)
	ctx := context.Background()
	old := f.r.holder.get()
	// Measured from issuance, not from the backdated NotBefore.
	issued := old.leaf().NotBefore.Add(pki.Backdate)
	lifetime := old.leaf().NotAfter.Sub(issued)
	due := issued.Add(time.Duration(0.66 * float64(lifetime)))

	require.Equal(t, due, f.r.step(ctx))
	f.clock.SetTime(due.Add(-time.Second))
	require.Equal(t, due, f.r.step(ctx))
	require.Zero(t, f.pki.renews)

	f.clock.SetTime(due)
	wake := f.r.step(ctx)
	cur := f.r.holder.get()
	require.NotEqual(t, old.leaf().SerialNumber, cur.leaf().SerialNumber)
	require.NotEqual(t, old.keyPEM, cur.keyPEM, "a new key with every certificate")
	require.Equal(t, 1, f.calls, "clients are told to present the new certificate")
	stored, err := f.store.load(ctx)
	require.NoError(t, err)
	require.Equal(t, cur.certPEM, stored.certPEM, "the store holds what is in service")
	newIssued := cur.leaf().NotBefore.Add(pki.Backdate)
	require.Equal(t, newIssued.Add(time.Duration(0.66*float64(cur.leaf().NotAfter.Sub(newIssued)))), wake)
	require.Equal(t, 1.0, testutil.ToFloat64(f.r.metrics.renewals.WithLabelValues("success")))
}

func TestAFailedRenewalKeepsTheWorkingCertificateAndBacksOff(t *testing.T) {
	t.Parallel()
	f := newRenewerFixture(t)
	ctx := context.Background()
	old := f.r.holder.get()
	due := f.r.step(ctx)
	f.pki.fail = errors.New("broker down")
	f.clock.SetTime(due)
	var delays []time.Duration
	for range 4 {
		now := f.clock.Now()
		wake := f.r.step(ctx)
		delays = append(delays, wake.Sub(now))
		f.clock.SetTime(wake)
	}
	require.Equal(t, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second}, delays)
	require.Same(t, old, f.r.holder.get(), "never replaced by a failed renewal")
	stored, err := f.store.load(ctx)
	require.NoError(t, err)
	require.Equal(t, old.certPEM, stored.certPEM)
	require.Equal(t, 4.0, testutil.ToFloat64(f.r.metrics.renewals.WithLabelValues("failure")))
	require.Zero(t, f.calls)

	// A certificate that cannot be stored does not go into service either.
	f.pki.fail = nil
	f.r.store = dirStore{dir: IdentityDir(filepath.Join(string(f.store.dir), "tls.crt", "not-a-dir"))}
	f.r.step(ctx)
	require.Same(t, old, f.r.holder.get())
	require.Equal(t, 5.0, testutil.ToFloat64(f.r.metrics.renewals.WithLabelValues("failure")))
}

func TestACertificateForAnotherIdentityIsRefused(t *testing.T) {
	t.Parallel()
	f := newRenewerFixture(t)
	cur := f.r.holder.get()
	// A broker that signs our key for another cluster's identity.
	evil := renewFunc(func(_ context.Context, csrPEM []byte) (*apiv1.CertificateResponse, error) {
		csr, _, err := pki.ParseCSRPEM(csrPEM)
		require.NoError(t, err)
		kp, err := f.pki.ca.SignClient(csr, "spiffe://oc.example/cluster/east", time.Hour)
		require.NoError(t, err)
		return &apiv1.CertificateResponse{Certificate: string(kp.CertPEM), CABundle: string(f.pki.ca.BundlePEM())}, nil
	})
	_, _, err := renewIdentity(context.Background(), evil, cur, cur.bundlePEM, f.clock.Now(), false)
	require.ErrorContains(t, err, "not "+westID)
}

// renewFunc is a renewAPI that answers the client certificate's CSR.
type renewFunc func(context.Context, []byte) (*apiv1.CertificateResponse, error)

func (f renewFunc) Renew(ctx context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	return f(ctx, []byte(req.CSR))
}
