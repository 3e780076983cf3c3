package agent

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// newClusterCAPKI is a testPKI whose CA may sign cluster CAs (pki init
// --cluster-cas).
func newClusterCAPKI(t *testing.T, clock *fakeClock) *testPKI {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "agent test fleet CA", Now: clock.Now, PathLen: 1})
	require.NoError(t, err)
	return &testPKI{ca: ca, clock: clock, lifetime: 24 * time.Hour}
}

// signClusterCA adds to resp a cluster CA for csrPEM, as POST
// /v1/certificates does with a clusterCACSR.
func (p *testPKI) signClusterCA(resp *apiv1.CertificateResponse, csrPEM string) error {
	csr, identity, err := pki.ParseCSRPEM([]byte(csrPEM))
	if err != nil {
		return err
	}
	kp, err := p.ca.SignClusterCA(csr, identity, p.lifetime)
	if err != nil {
		return err
	}
	resp.ClusterCA, resp.ClusterCANotAfter = string(kp.CertPEM), &kp.Cert.NotAfter
	return nil
}

// identityWithClusterCA is p.identity with a cluster CA of its own.
func (p *testPKI) identityWithClusterCA(t *testing.T) *identity {
	t.Helper()
	id := p.identity(t)
	csr, key, err := pki.NewCSR(westID, nil)
	require.NoError(t, err)
	var resp apiv1.CertificateResponse
	require.NoError(t, p.signClusterCA(&resp, string(csr)))
	id, err = id.withClusterCA([]byte(resp.ClusterCA), key, p.clock.Now())
	require.NoError(t, err)
	return id
}

func TestAnIdentityWithAClusterCARoundTripsThroughBothStoresAndLosesItWhole(t *testing.T) {
	t.Parallel()
	p := newClusterCAPKI(t, newFakeClock(time.Now()))
	ctx := context.Background()
	withCA, without := p.identityWithClusterCA(t), p.identity(t)
	cs := fake.NewClientset()
	for _, s := range []identityStore{
		dirStore{dir: IdentityDir(filepath.Join(t.TempDir(), "identity"))},
		secretStore{secrets: cs.CoreV1(), ref: config.ObjectRef{Namespace: "tokenbroker-agent", Name: "agent-identity"}},
	} {
		require.NoError(t, s.save(ctx, withCA), s)
		got, err := s.load(ctx)
		require.NoError(t, err, s)
		require.NotNil(t, got.clusterCA, s)
		require.Equal(t, withCA.clusterCA.certPEM, got.clusterCA.certPEM, s)
		require.Equal(t, withCA.clusterCA.keyPEM, got.clusterCA.keyPEM, s)
		h := &identityHolder{}
		h.set(got)
		require.Equal(t, withCA.clusterCA.ca.Certificate().Raw, h.clusterCA().Certificate().Raw, "the signer's CA")

		// A successor without a cluster CA leaves none of the old one.
		require.NoError(t, s.save(ctx, without), s)
		got, err = s.load(ctx)
		require.NoError(t, err, s)
		require.Nil(t, got.clusterCA, s)
		h.set(got)
		require.Nil(t, h.clusterCA())
	}
	sec, err := cs.CoreV1().Secrets("tokenbroker-agent").Get(ctx, "agent-identity", metav1.GetOptions{})
	require.NoError(t, err)
	require.NotContains(t, sec.Data, ClusterCACertFile)
	require.NotContains(t, sec.Data, ClusterCAKeyFile)
	require.Equal(t, corev1.SecretTypeTLS, sec.Type)
}

func TestTheDirectoryStoresTheClusterCAsKeyPrivatelyAndLeavesNoStagedFile(t *testing.T) {
	t.Parallel()
	p := newClusterCAPKI(t, newFakeClock(time.Now()))
	dir := IdentityDir(filepath.Join(t.TempDir(), "identity"))
	id := p.identityWithClusterCA(t)
	require.NoError(t, dirStore{dir: dir}.save(context.Background(), id))
	st, err := os.Stat(dir.ClusterCAKey())
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	data, err := os.ReadFile(dir.ClusterCACert())
	require.NoError(t, err)
	require.Equal(t, id.clusterCA.certPEM, data)
	entries, err := os.ReadDir(string(dir))
	require.NoError(t, err)
	require.Len(t, entries, 5)

	// Without a cluster CA the directory is as before.
	require.NoError(t, dirStore{dir: dir}.save(context.Background(), p.identity(t)))
	entries, err = os.ReadDir(string(dir))
	require.NoError(t, err)
	require.Len(t, entries, 3)
}

func TestAnInterruptedReplacementNeverPairsAClusterCAWithAnotherIdentity(t *testing.T) {
	t.Parallel()
	p := newClusterCAPKI(t, newFakeClock(time.Now()))
	withCA, nextWithCA, nextWithout := p.identityWithClusterCA(t), p.identityWithClusterCA(t), p.identity(t)
	for _, tc := range []struct {
		name    string
		next    *identity
		staged  int // how many files of next's were staged
		renamed int // and then renamed
		wantNew bool
	}{
		{"staging stopped after the cluster CA's key", nextWithCA, 3, 0, false},
		{"staging stopped after the cluster CA's certificate", nextWithCA, 4, 0, false},
		{"staging done, nothing renamed", nextWithCA, 5, 0, true},
		{"renamed up to the cluster CA's key", nextWithCA, 5, 3, true},
		{"renamed up to the cluster CA's certificate", nextWithCA, 5, 4, true},
		{"staging of a successor without a cluster CA stopped at its emptied key", nextWithout, 3, 0, false},
		{"a successor without a cluster CA renamed up to its emptied key", nextWithout, 5, 3, true},
	} {
		dir := IdentityDir(t.TempDir())
		s := dirStore{dir: dir}
		require.NoError(t, s.save(context.Background(), withCA))
		files := s.identityFiles(tc.next)
		require.Len(t, files, 5, tc.name)
		for _, f := range files[:tc.staged] {
			require.NoError(t, os.WriteFile(dir.staged(f.name), f.data, f.mode))
		}
		for _, f := range files[:tc.renamed] {
			require.NoError(t, os.Rename(dir.staged(f.name), filepath.Join(string(dir), f.name)))
		}
		got, err := s.load(context.Background())
		require.NoError(t, err, tc.name)
		want := withCA
		if tc.wantNew {
			want = tc.next
		}
		require.Equal(t, want.certPEM, got.certPEM, tc.name)
		if want.clusterCA == nil {
			require.Nil(t, got.clusterCA, tc.name)
		} else {
			require.NotNil(t, got.clusterCA, tc.name)
			require.Equal(t, want.clusterCA.certPEM, got.clusterCA.certPEM, tc.name)
			require.Equal(t, want.clusterCA.keyPEM, got.clusterCA.keyPEM, tc.name)
		}
		entries, err := os.ReadDir(string(dir))
		require.NoError(t, err)
		wantFiles := 3
		if want.clusterCA != nil {
			wantFiles = 5
		}
		require.Len(t, entries, wantFiles, tc.name)
	}
}

func TestAStoredClusterCAMustBelongToItsIdentity(t *testing.T) {
	t.Parallel()
	p := newClusterCAPKI(t, newFakeClock(time.Now()))
	id, other := p.identityWithClusterCA(t), p.identityWithClusterCA(t)
	plain := p.identity(t)
	eastKP, err := p.ca.IssueClient(pki.ClientOptions{Identity: "spiffe://oc.example/cluster/east", Lifetime: time.Hour})
	require.NoError(t, err)
	east, err := parseIdentity(eastKP.CertPEM, eastKP.KeyPEM, p.ca.BundlePEM())
	require.NoError(t, err)
	stranger := newClusterCAPKI(t, p.clock)
	strangersCA := stranger.identityWithClusterCA(t)

	for _, tc := range []struct {
		name            string
		base            *identity
		certPEM, keyPEM []byte
		wantErr         string
	}{
		{"a certificate without its key", plain, id.clusterCA.certPEM, nil, "cluster-ca.crt without cluster-ca.key"},
		{"a key without its certificate", plain, nil, id.clusterCA.keyPEM, "cluster-ca.key without cluster-ca.crt"},
		{"another CA's key", id, id.clusterCA.certPEM, other.clusterCA.keyPEM, "cluster CA"},
		{"the CA of another cluster", east, id.clusterCA.certPEM, id.clusterCA.keyPEM, "not of spiffe://oc.example/cluster/east"},
		{"a CA that does not chain to the trust bundle", id, strangersCA.clusterCA.certPEM, strangersCA.clusterCA.keyPEM, "does not chain to the trust bundle"},
		{"a CA that is no cluster CA", id, p.ca.CertPEM(), mustKeyPEM(t, p.ca), "not a cluster CA"},
	} {
		dir := IdentityDir(t.TempDir())
		require.NoError(t, dirStore{dir: dir}.save(context.Background(), tc.base))
		for name, data := range map[string][]byte{ClusterCACertFile: tc.certPEM, ClusterCAKeyFile: tc.keyPEM} {
			if data != nil {
				require.NoError(t, os.WriteFile(filepath.Join(string(dir), name), data, 0o600))
			}
		}
		_, err := dirStore{dir: dir}.load(context.Background())
		require.ErrorContains(t, err, tc.wantErr, tc.name)

		sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "id"}, Data: map[string][]byte{
			CertFile: tc.base.certPEM, KeyFile: tc.base.keyPEM, BundleFile: tc.base.bundlePEM,
			ClusterCACertFile: tc.certPEM, ClusterCAKeyFile: tc.keyPEM,
		}}
		_, err = secretStore{secrets: fake.NewClientset(sec).CoreV1(), ref: config.ObjectRef{Namespace: "ns", Name: "id"}}.load(context.Background())
		require.ErrorContains(t, err, tc.wantErr, tc.name)
	}
}

func mustKeyPEM(t *testing.T, ca *pki.CA) []byte {
	t.Helper()
	key, err := ca.KeyPEM()
	require.NoError(t, err)
	return key
}

// renewReqFunc is a renewAPI that sees the whole request.
type renewReqFunc func(context.Context, apiv1.CertificateRequest) (*apiv1.CertificateResponse, error)

func (f renewReqFunc) Renew(ctx context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
	return f(ctx, req)
}

func TestRenewalAsksForTheClusterCAOnlyWhenTheAgentWantsOne(t *testing.T) {
	t.Parallel()
	p := newClusterCAPKI(t, newFakeClock(time.Now()))
	for _, tc := range []struct {
		name   string
		cur    *identity
		want   bool
		wantCA bool
	}{
		{"an identity with a cluster CA gets a new one with a new key", p.identityWithClusterCA(t), true, true},
		{"an agent that signs pod certificates asks for one though its identity has none", p.identity(t), true, true},
		{"an identity without one, in an agent that wants none, asks for none", p.identity(t), false, false},
		{"an identity with one, in an agent that no longer signs, asks for none and loses it", p.identityWithClusterCA(t), false, false},
	} {
		var asked apiv1.CertificateRequest
		api := renewReqFunc(func(ctx context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
			asked = req
			return p.Renew(ctx, req)
		})
		next, _, err := renewIdentity(context.Background(), api, tc.cur, tc.cur.bundlePEM, p.clock.Now(), tc.want)
		require.NoError(t, err, tc.name)
		if !tc.wantCA {
			require.Empty(t, asked.ClusterCACSR, tc.name)
			require.Nil(t, next.clusterCA, tc.name)
			continue
		}
		require.NotEmpty(t, asked.ClusterCACSR, tc.name)
		caCSR, _, err := pki.ParseCSRPEM([]byte(asked.ClusterCACSR))
		require.NoError(t, err)
		csr, _, err := pki.ParseCSRPEM([]byte(asked.CSR))
		require.NoError(t, err)
		require.NotEqual(t, csr.RawSubjectPublicKeyInfo, caCSR.RawSubjectPublicKeyInfo, "%s: two keys", tc.name)
		require.NotNil(t, next.clusterCA, tc.name)
		require.Equal(t, caCSR.RawSubjectPublicKeyInfo, next.clusterCA.ca.Certificate().RawSubjectPublicKeyInfo, tc.name)
		if tc.cur.clusterCA != nil {
			require.NotEqual(t, tc.cur.clusterCA.keyPEM, next.clusterCA.keyPEM, tc.name)
			require.NotEqual(t, tc.cur.clusterCA.certPEM, next.clusterCA.certPEM, tc.name)
		}
	}
}

func TestARenewalAnswerWithoutAGoodClusterCAIsRefusedWhole(t *testing.T) {
	t.Parallel()
	p := newClusterCAPKI(t, newFakeClock(time.Now()))
	cur := p.identityWithClusterCA(t)
	stranger := newClusterCAPKI(t, p.clock)
	withCA := func(sign func(resp *apiv1.CertificateResponse, req apiv1.CertificateRequest) error) renewAPI {
		return renewReqFunc(func(_ context.Context, req apiv1.CertificateRequest) (*apiv1.CertificateResponse, error) {
			resp, err := p.sign([]byte(req.CSR))
			if err != nil {
				return nil, err
			}
			return resp, sign(resp, req)
		})
	}
	for _, tc := range []struct {
		name    string
		api     renewAPI
		wantErr string
	}{
		{"an answer without a cluster CA (the broker was not told to sign them)", withCA(func(*apiv1.CertificateResponse, apiv1.CertificateRequest) error { return nil }),
			"the broker signs no cluster CA: run it with --sign-cluster-cas"},
		{"the CA of another cluster", withCA(func(resp *apiv1.CertificateResponse, _ apiv1.CertificateRequest) error {
			csr, _, err := pki.NewCSR("spiffe://oc.example/cluster/east", nil)
			if err != nil {
				return err
			}
			return p.signClusterCA(resp, string(csr))
		}), "cluster CA"},
		{"a CA that does not chain to the trust bundle", withCA(func(resp *apiv1.CertificateResponse, req apiv1.CertificateRequest) error {
			return stranger.signClusterCA(resp, req.ClusterCACSR)
		}), "does not chain to the trust bundle"},
		{"a CA for another key", withCA(func(resp *apiv1.CertificateResponse, _ apiv1.CertificateRequest) error {
			resp.ClusterCA = string(cur.clusterCA.certPEM)
			return nil
		}), "cluster CA"},
	} {
		next, _, err := renewIdentity(context.Background(), tc.api, cur, cur.bundlePEM, p.clock.Now(), true)
		require.ErrorContains(t, err, tc.wantErr, tc.name)
		require.Nil(t, next, tc.name)
	}
	_, _, err := renewIdentity(context.Background(), withCA(func(*apiv1.CertificateResponse, apiv1.CertificateRequest) error { return nil }), cur, cur.bundlePEM, p.clock.Now(), true)
	require.ErrorIs(t, err, errNoClusterCA)
}

func TestTheRenewerPutsTheClusterCAIntoServiceWithTheStoredIdentity(t *testing.T) {
	t.Parallel()
	f := newRenewerFixture(t)
	// The fixture's CA signs no cluster CA: one that can, for this test.
	p := newClusterCAPKI(t, f.clock)
	id := p.identity(t)
	require.NoError(t, f.store.save(context.Background(), id))
	f.r.holder.set(id)
	f.r.api, f.r.wantClusterCA = p, true
	require.Nil(t, f.r.holder.clusterCA())

	f.clock.SetTime(f.r.step(context.Background()))
	f.r.step(context.Background())
	ca := f.r.holder.clusterCA()
	require.NotNil(t, ca, "the signer's CA is in service")
	got, err := pki.ClusterCAIdentity(ca.Certificate())
	require.NoError(t, err)
	require.Equal(t, westID, got)
	stored, err := f.store.load(context.Background())
	require.NoError(t, err)
	require.Equal(t, f.r.holder.get().clusterCA.certPEM, stored.clusterCA.certPEM, "stored before it went into service")
}

func TestEnrollmentWithClusterCAStoresItOrNothing(t *testing.T) {
	t.Parallel()
	fleet, err := pki.NewCA(pki.CAOptions{CommonName: "pinned fleet CA", PathLen: 1})
	require.NoError(t, err)
	leafOnly, err := pki.NewCA(pki.CAOptions{CommonName: "leaf-only CA"})
	require.NoError(t, err)
	for _, tc := range []struct {
		name    string
		ca      *pki.CA
		wantErr string
	}{
		{"a broker that signs cluster CAs", fleet, ""},
		{"a broker whose CA cannot sign one refuses, and nothing is stored", leafOnly, "422"},
	} {
		srv := newPinServer(t, pinServerOptions{signer: tc.ca, bundle: tc.ca.BundlePEM(), real: tc.ca, caBundle: tc.ca.BundlePEM()})
		token, _, err := tc.ca.IssueJoinToken(pki.JoinTokenOptions{Identity: westID})
		require.NoError(t, err)
		dir := IdentityDir(filepath.Join(t.TempDir(), "identity"))
		_, err = Enroll(context.Background(), EnrollOptions{BrokerURL: srv.srv.URL, Fingerprint: pki.Fingerprint(tc.ca.Certificate()), Token: token, Dir: dir, ClusterCA: true})
		if tc.wantErr != "" {
			require.ErrorContains(t, err, tc.wantErr, tc.name)
			_, statErr := os.Stat(string(dir))
			require.ErrorIs(t, statErr, os.ErrNotExist, tc.name)
			continue
		}
		require.NoError(t, err, tc.name)
		id, err := dirStore{dir: dir}.load(context.Background())
		require.NoError(t, err)
		require.NotNil(t, id.clusterCA)
		require.NotEqual(t, id.keyPEM, id.clusterCA.keyPEM, "two keys")
	}
}

// TestTheRenewerAsksAtOnceWhenThePodSignerHasNoCA: a pod signer turned on
// for an identity without a cluster CA gets one from the first step, not
// at the certificate's half-life.
func TestTheRenewerAsksAtOnceWhenThePodSignerHasNoCA(t *testing.T) {
	t.Parallel()
	f := newRenewerFixture(t)
	p := newClusterCAPKI(t, f.clock)
	id := p.identity(t)
	require.NoError(t, f.store.save(context.Background(), id))
	f.r.holder.set(id)
	f.r.api, f.r.wantClusterCA = p, true
	start := f.clock.Now()
	next := f.r.step(context.Background())
	require.NotNil(t, f.r.holder.clusterCA(), "renewed in the first step")
	require.True(t, f.clock.Now().Equal(start), "without waiting")
	require.True(t, next.After(start.Add(time.Minute)), "then at the new certificate's renewal time")

	// With a CA in service, the renewal waits for its time again.
	f.r.step(context.Background())
	require.Equal(t, next, f.r.nextAttempt())
}
