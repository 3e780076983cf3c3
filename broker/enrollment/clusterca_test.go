package enrollment

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/limits"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/policy/policytest"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

const (
	westID   = "spiffe://oc.example/cluster/west"
	northID  = "spiffe://oc.example/cluster/north"
	brokerNS = "tokenbroker"
)

// events is an audit.Auditor and audit.Observer that keeps the events
// and denial codes it is given.
type events struct {
	mu      sync.Mutex
	all     []audit.Event
	denials []string
}

func (e *events) ObserveAudit(string, string, error) {}

func (e *events) ObserveDenial(_, reason string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.denials = append(e.denials, reason)
}

func (e *events) lastDenial(t *testing.T) string {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	require.NotEmpty(t, e.denials)
	return e.denials[len(e.denials)-1]
}

func (e *events) Audit(ev audit.Event) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.all = append(e.all, ev)
	return nil
}

func (e *events) last(t *testing.T) audit.Event {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	require.NotEmpty(t, e.all)
	return e.all[len(e.all)-1]
}

// staticTrust is a TrustSource over one CA.
type staticTrust struct{ ca *pki.CA }

func (s staticTrust) PEM() []byte { return s.ca.BundlePEM() }
func (s staticTrust) Certificates() []*x509.Certificate {
	return []*x509.Certificate{s.ca.Certificate()}
}

// authorityEnv is an Authority over a fake clientset (it records used
// join tokens only; the API server's part is in test/integration).
type authorityEnv struct {
	auth   *Authority
	ca     *pki.CA
	client *fake.Clientset
	events *events
}

// newAuthorityEnv makes an Authority whose signing CA is ca (a fleet
// root that may sign cluster CAs when nil) and signs cluster CAs if sign.
func newAuthorityEnv(t *testing.T, ca *pki.CA, sign bool, deny ...RevocationEntry) *authorityEnv {
	t.Helper()
	if ca == nil {
		var err error
		ca, err = pki.NewCA(pki.CAOptions{CommonName: "fleet root", PathLen: 1, Lifetime: 365 * 24 * time.Hour})
		require.NoError(t, err)
	}
	p, err := policy.Parse([]byte(policytest.Basic))
	require.NoError(t, err)
	store := policy.NewStore(p)
	clock := clocktesting.NewFakePassiveClock(time.Now())
	client := fake.NewClientset()
	ev := &events{}
	auth := &Authority{
		Config: Config{CA: ca, Trust: staticTrust{ca}, SignClusterCAs: sign,
			Revocations: StaticRevocationList(NewDenyList(deny))},
		Policy: store, Secrets: client.CoreV1(), Namespace: brokerNS,
		Limits: &limits.Admission{Buckets: limits.NewLimiter(clock), Enrollments: limits.NewEnrollLimiter(clock), Reads: limits.NewInFlight()},
		Audit:  &audit.Recorder{Auditor: ev, Metrics: ev, Now: clock.Now, Logger: zap.NewNop()},
		Clock:  clock, Logger: zap.NewNop(),
		Timed: func(context.Context, string, time.Time, error) time.Duration { return 0 },
	}
	auth.JoinTokens = NewCAJoinTokens(ca, nil, func() []string { return []string{"east"} }, clock.Now)
	return &authorityEnv{auth: auth, ca: ca, client: client, events: ev}
}

func (e *authorityEnv) joinToken(t *testing.T, identity string) string {
	t.Helper()
	tok, _, err := e.ca.IssueJoinToken(pki.JoinTokenOptions{Identity: identity, Audiences: []string{"east"}})
	require.NoError(t, err)
	return tok
}

func (e *authorityEnv) usedJoinTokens(t *testing.T) int {
	t.Helper()
	l, err := e.client.CoreV1().Secrets(brokerNS).List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	return len(l.Items)
}

// csrFor is a new key's CSR for identity, and the key.
func csrFor(t *testing.T, identity string) (csrPEM string, keyPEM []byte) {
	t.Helper()
	csr, key, err := pki.NewCSR(identity, nil)
	require.NoError(t, err)
	return string(csr), key
}

// peerOf is the renewing peer of a client certificate ca issued.
func peerOf(t *testing.T, ca *pki.CA, identity string) Peer {
	t.Helper()
	kp, err := ca.IssueClient(pki.ClientOptions{Identity: identity, Lifetime: time.Hour})
	require.NoError(t, err)
	return Peer{Identity: identity, CertSHA256: pki.Fingerprint(kp.Cert), Certificate: kp.Cert}
}

// requireClusterCA checks that resp carries a cluster CA for identity
// that the broker's CA verifies, with the client certificate's lifetime,
// that signs pod certificates of its cluster.
func requireClusterCA(t *testing.T, e *authorityEnv, resp *apiv1.CertificateResponse, identity string, keyPEM []byte) {
	t.Helper()
	chain, err := pki.ParseCertificatesPEM([]byte(resp.ClusterCA))
	require.NoError(t, err)
	require.Len(t, chain, 1, "the cluster CA under a root; the root is in caBundle")
	got, err := pki.ClusterCAIdentity(chain[0])
	require.NoError(t, err)
	require.Equal(t, identity, got)
	require.NotNil(t, resp.ClusterCANotAfter)
	require.Equal(t, chain[0].NotAfter.UTC(), *resp.ClusterCANotAfter)
	require.WithinDuration(t, resp.NotAfter, *resp.ClusterCANotAfter, time.Second, "the client certificate's lifetime")
	_, err = chain[0].Verify(x509.VerifyOptions{Roots: e.ca.CertPool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)

	cluster, err := pki.ParseCA([]byte(resp.ClusterCA), keyPEM, pki.CAOptions{})
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	workload, err := pki.WorkloadIdentity(identity, "argo", "runner")
	require.NoError(t, err)
	nb := time.Now().Truncate(time.Second)
	pod, podChain, err := cluster.SignPodCertificate(identity, pki.PodCertificate{Identity: workload, PublicKey: key.Public(), NotBefore: nb, NotAfter: nb.Add(time.Hour)})
	require.NoError(t, err)
	certs, err := pki.ParseCertificatesPEM(podChain)
	require.NoError(t, err)
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	_, err = pod.Verify(x509.VerifyOptions{Roots: e.ca.CertPool(), Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
}

func TestEnrollmentAnswersAClusterCAWithTheCertificate(t *testing.T) {
	t.Parallel()
	e := newAuthorityEnv(t, nil, true)
	csr, _ := csrFor(t, westID)
	caCSR, caKey := csrFor(t, westID)
	resp, err := e.auth.Enroll(context.Background(), "", e.joinToken(t, westID), apiv1.CertificateRequest{CSR: csr, ClusterCACSR: caCSR})
	require.NoError(t, err)
	require.Equal(t, westID, resp.Identity)
	requireClusterCA(t, e, resp, westID, caKey)

	ev := e.events.last(t)
	require.Equal(t, audit.ActionEnroll, ev.Action)
	require.Equal(t, audit.DecisionAllow, ev.Decision)
	chain, err := pki.ParseCertificatesPEM([]byte(resp.ClusterCA))
	require.NoError(t, err)
	require.Equal(t, chain[0].SerialNumber.Text(16), ev.ClusterCASerial)
	require.Equal(t, resp.ClusterCANotAfter.Format(time.RFC3339), ev.ClusterCANotAfter)
	require.Equal(t, resp.SerialNumber, ev.Serial)

	t.Run("Without a clusterCACSR the answer has no cluster CA.", func(t *testing.T) {
		t.Parallel()
		csr, _ := csrFor(t, westID)
		resp, err := e.auth.Enroll(context.Background(), "", e.joinToken(t, westID), apiv1.CertificateRequest{CSR: csr})
		require.NoError(t, err)
		require.Empty(t, resp.ClusterCA)
		require.Nil(t, resp.ClusterCANotAfter)
	})
}

func TestRenewalAnswersAClusterCAOfTheSigningCAInForce(t *testing.T) {
	t.Parallel()
	old, err := pki.NewCA(pki.CAOptions{CommonName: "old fleet root", PathLen: 1})
	require.NoError(t, err)
	e := newAuthorityEnv(t, nil, true)
	e.auth.PreviousCA = staticTrust{old}
	csr, _ := csrFor(t, westID)
	caCSR, caKey := csrFor(t, westID)
	// A client certificate of the previous CA renews into the new one,
	// and so does the cluster CA.
	resp, err := e.auth.Renew(context.Background(), peerOf(t, old, westID), apiv1.CertificateRequest{CSR: csr, ClusterCACSR: caCSR})
	require.NoError(t, err)
	requireClusterCA(t, e, resp, westID, caKey)
	ev := e.events.last(t)
	require.Equal(t, audit.ActionRenew, ev.Action)
	require.NotEmpty(t, ev.ClusterCASerial)
}

func TestAClusterCAIsRefusedWholeWhenTheBrokerDoesNotSignThem(t *testing.T) {
	t.Parallel()
	e := newAuthorityEnv(t, nil, false)
	csr, _ := csrFor(t, westID)
	caCSR, _ := csrFor(t, westID)
	req := apiv1.CertificateRequest{CSR: csr, ClusterCACSR: caCSR}

	for name, call := range map[string]func() (*apiv1.CertificateResponse, error){
		"enroll": func() (*apiv1.CertificateResponse, error) {
			return e.auth.Enroll(context.Background(), "", e.joinToken(t, westID), req)
		},
		"renew": func() (*apiv1.CertificateResponse, error) {
			return e.auth.Renew(context.Background(), peerOf(t, e.ca, westID), req)
		},
	} {
		resp, err := call()
		require.Nil(t, resp, name)
		require.Equal(t, problem.KindUnprocessable, problem.KindOf(err), "%s: %v", name, err)
		var be *problem.Error
		require.ErrorAs(t, err, &be)
		require.Equal(t, "this broker does not sign cluster CAs", be.Detail)
		require.Len(t, be.Fields, 1)
		require.Equal(t, "clusterCACSR", be.Fields[0].Field)
		require.Contains(t, be.Fields[0].Detail, "--sign-cluster-cas")
		ev := e.events.last(t)
		require.Equal(t, audit.DecisionDeny, ev.Decision, name)
		require.Equal(t, "this broker does not sign cluster CAs", ev.Reason, name)
		require.Equal(t, audit.DenyDisabled, e.events.lastDenial(t), name)
	}
	require.Zero(t, e.usedJoinTokens(t), "the join token is not used up")

	t.Run("A signing CA of path length 0 signs none, and uses up no join token.", func(t *testing.T) {
		t.Parallel()
		leafOnly, err := pki.NewCA(pki.CAOptions{})
		require.NoError(t, err)
		e := newAuthorityEnv(t, leafOnly, true)
		_, err = e.auth.Enroll(context.Background(), "", e.joinToken(t, westID), req)
		require.ErrorIs(t, err, pki.ErrCannotSignCAs)
		require.Equal(t, problem.KindInternal, problem.KindOf(err))
		require.Zero(t, e.usedJoinTokens(t))
	})
}

func TestAClusterCACSRIsCheckedLikeTheClientCSR(t *testing.T) {
	t.Parallel()
	e := newAuthorityEnv(t, nil, true, RevocationEntry{Kind: RevokeIdentity, Value: northID})
	csr, key := csrFor(t, westID)

	// A CSR for the client certificate's key, made by hand.
	block, _ := pem.Decode(key)
	k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	require.NoError(t, err)
	u, err := url.Parse(westID)
	require.NoError(t, err)
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: westID}, URIs: []*url.URL{u}}, k)
	require.NoError(t, err)
	sameKey := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}))

	northCSR, _ := csrFor(t, northID)
	for _, tc := range []struct {
		name   string
		caCSR  string
		kind   problem.Kind
		denial string
	}{
		{name: "A CSR that does not parse is invalid, on its field.", caCSR: "not a CSR", kind: problem.KindInvalid, denial: audit.DenyInvalid},
		{name: "A CSR for another identity is forbidden.", caCSR: northCSR, kind: problem.KindForbidden, denial: audit.DenyIdentityMismatch},
		{name: "A CSR for the client certificate's key is invalid.", caCSR: sameKey, kind: problem.KindInvalid, denial: audit.DenyInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := e.auth.Enroll(context.Background(), "", e.joinToken(t, westID), apiv1.CertificateRequest{CSR: csr, ClusterCACSR: tc.caCSR})
			require.Nil(t, resp)
			require.Equal(t, tc.kind, problem.KindOf(err), "%v", err)
			if tc.kind == problem.KindInvalid {
				var be *problem.Error
				require.ErrorAs(t, err, &be)
				require.Len(t, be.Fields, 1)
				require.Equal(t, "clusterCACSR", be.Fields[0].Field)
			}
			require.Equal(t, audit.DecisionDeny, e.events.last(t).Decision)
			require.Equal(t, tc.denial, e.events.lastDenial(t))
			require.Zero(t, e.usedJoinTokens(t), "nothing used up")
		})
	}

	t.Run("A revoked identity gets neither.", func(t *testing.T) {
		caCSR, _ := csrFor(t, northID)
		csr, _ := csrFor(t, northID)
		_, err := e.auth.Enroll(context.Background(), "", e.joinToken(t, northID), apiv1.CertificateRequest{CSR: csr, ClusterCACSR: caCSR})
		require.Equal(t, problem.KindUnauthenticated, problem.KindOf(err))
		_, err = e.auth.Renew(context.Background(), peerOf(t, e.ca, northID), apiv1.CertificateRequest{CSR: csr, ClusterCACSR: caCSR})
		require.Equal(t, problem.KindUnauthenticated, problem.KindOf(err))
	})
}
