package broker

import (
	"context"
	"crypto/x509"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

const (
	westID   = "spiffe://oc.example/cluster/west"
	northID  = "spiffe://oc.example/cluster/north"
	brokerNS = "tokenbroker"
)

// staticTrust is a TrustSource over one CA.
type staticTrust struct{ ca *pki.CA }

func (s staticTrust) PEM() []byte { return s.ca.BundlePEM() }
func (s staticTrust) Certificates() []*x509.Certificate {
	return []*x509.Certificate{s.ca.Certificate()}
}

// certEnv is a broker that issues certificates, over a fake clientset:
// the pure logic of enrollment and renewal. That two replicas agree on a
// used token through the real API server is in test/integration.
type certEnv struct {
	b       *Broker
	ca      *pki.CA
	client  *fake.Clientset
	logs    *observer.ObservedLogs
	revoked *enrollment.DenyList
}

func newCertEnv(t *testing.T, pol string, deny ...enrollment.RevocationEntry) *certEnv {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "broker test CA", Lifetime: 365 * 24 * time.Hour})
	require.NoError(t, err)
	core, logs := observer.New(zap.DebugLevel)
	client := fake.NewClientset()
	d := enrollment.NewDenyList(deny)
	b, err := New(Config{
		Secrets:    client.CoreV1(),
		Policy:     policy.NewStore(mustPolicy(t, pol)),
		Logger:     zap.New(core),
		Namespace:  brokerNS,
		Enrollment: enrollment.Config{CA: ca, Trust: staticTrust{ca}, Revocations: enrollment.StaticRevocationList(d)},
	})
	require.NoError(t, err)
	return &certEnv{b: b, ca: ca, client: client, logs: logs, revoked: d}
}

func (e *certEnv) joinToken(t *testing.T, identity string, opts ...func(*pki.JoinTokenOptions)) (string, pki.JoinTokenClaims) {
	t.Helper()
	o := pki.JoinTokenOptions{Identity: identity, Audiences: []string{"east"}}
	for _, f := range opts {
		f(&o)
	}
	tok, claims, err := e.ca.IssueJoinToken(o)
	require.NoError(t, err)
	return tok, claims
}

// callerFrom is the caller that a client certificate ca issued for
// identity authenticates, as the transport layer makes it.
func callerFrom(t *testing.T, ca *pki.CA, identity string) Caller {
	t.Helper()
	kp, err := ca.IssueClient(pki.ClientOptions{Identity: identity, Lifetime: time.Hour})
	require.NoError(t, err)
	return Caller{Identity: identity, CertSHA256: pki.Fingerprint(kp.Cert), Certificate: kp.Cert}
}

func newCSR(t *testing.T, identity string) string {
	t.Helper()
	csr, _, err := pki.NewCSR(identity, nil)
	require.NoError(t, err)
	return string(csr)
}

func requireUniformUnauthenticated(t *testing.T, err error) {
	t.Helper()
	require.Equal(t, problem.KindUnauthenticated, problem.KindOf(err), "%v", err)
	var be *problem.Error
	require.ErrorAs(t, err, &be)
	require.Equal(t, "invalid join token", be.Detail)
	require.Empty(t, be.Fields)
}

func TestEnrollmentIssuesACertificateForTheTokensIdentity(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy)
	tok, claims := e.joinToken(t, westID)
	before := time.Now()
	resp, err := e.b.Enroll(context.Background(), tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.NoError(t, err)

	require.Equal(t, westID, resp.Identity)
	certs, err := pki.ParseCertificatesPEM([]byte(resp.Certificate))
	require.NoError(t, err)
	leaf := certs[0]
	id, err := pki.IdentityFromCert(leaf)
	require.NoError(t, err)
	require.Equal(t, westID, id)
	require.Equal(t, leaf.SerialNumber.Text(16), resp.SerialNumber)
	require.WithinDuration(t, before.Add(pki.DefaultClientLifetime), resp.NotAfter, time.Minute)
	require.Equal(t, string(e.ca.BundlePEM()), resp.CABundle)
	_, err = leaf.Verify(x509.VerifyOptions{Roots: e.ca.CertPool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)

	// The jti is recorded in the broker's namespace, as a kind of its own.
	s, err := e.client.CoreV1().Secrets(brokerNS).Get(context.Background(), enrollment.UsedJoinTokenSecretName(claims.ID), metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, objects.SecretTypeUsedJoinToken, s.Type)
	require.Equal(t, objects.UsedJoinTokenKind, s.Labels[objects.LabelKind])
	require.Equal(t, objects.ManagedByValue, s.Labels[objects.LabelManagedBy])
	require.Equal(t, claims.ID, s.Annotations[enrollment.AnnotationJoinTokenID])
	require.Equal(t, westID, s.Annotations[objects.AnnotationIdentity])
	exp, err := time.Parse(time.RFC3339, s.Annotations[objects.AnnotationExpiresAt])
	require.NoError(t, err)
	require.False(t, exp.Before(claims.ExpiresAt), "the record outlives the token")
	require.Len(t, strings.TrimPrefix(s.Name, "tokenbroker-jti-"), 40)
	require.Empty(t, s.Data)

	// The log names the jti and the identity, never the token or the CSR.
	require.Equal(t, 1, e.logs.FilterMessage("certificate enrolled").FilterField(zap.String("jti", claims.ID)).Len())
	sig := tok[strings.LastIndex(tok, ".")+1:]
	for _, entry := range e.logs.All() {
		for k, v := range entry.ContextMap() {
			s, _ := v.(string)
			require.NotContains(t, s, sig, "field %s holds the token", k)
			require.NotContains(t, s, "CERTIFICATE REQUEST", "field %s holds the CSR", k)
		}
	}
}

func TestEveryJoinTokenFailureIsTheSameUnauthenticatedError(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy, enrollment.RevocationEntry{Kind: enrollment.RevokeIdentity, Value: northID})
	other, err := pki.NewCA(pki.CAOptions{CommonName: "someone else's CA"})
	require.NoError(t, err)
	foreign, _, err := other.IssueJoinToken(pki.JoinTokenOptions{Identity: westID, Audiences: []string{"east"}})
	require.NoError(t, err)
	expired, _ := e.joinToken(t, westID, func(o *pki.JoinTokenOptions) {
		o.Now = func() time.Time { return time.Now().Add(-time.Hour) }
		o.TTL = 10 * time.Minute
	})
	used, _ := e.joinToken(t, westID)
	_, err = e.b.Enroll(context.Background(), used, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.NoError(t, err)
	revoked, _ := e.joinToken(t, northID)
	good, _ := e.joinToken(t, westID)
	parts := strings.Split(good, ".")
	tampered := parts[0] + "." + parts[1] + "." + strings.Repeat("A", len(parts[2]))

	tests := []struct{ name, token, identity string }{
		{"an empty token", "", westID},
		{"a token that is not a JWT", "not-a-jwt", westID},
		{"a token signed by another CA", foreign, westID},
		{"an expired token", expired, westID},
		{"a token with a tampered signature", tampered, westID},
		{"a token used before", used, westID},
		{"a token for a revoked identity", revoked, northID},
		{"an oversized token", strings.Repeat("a", pki.MaxJoinTokenBytes+1), westID},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := e.b.Enroll(context.Background(), tc.token, apiv1.CertificateRequest{CSR: newCSR(t, tc.identity)})
			requireUniformUnauthenticated(t, err)
		})
	}
}

func TestACSRProblemIsReportedAndDoesNotUseTheTokenUp(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy)
	tok, claims := e.joinToken(t, westID)

	_, err := e.b.Enroll(context.Background(), tok, apiv1.CertificateRequest{CSR: "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n"})
	require.Equal(t, problem.KindInvalid, problem.KindOf(err))
	var be *problem.Error
	require.ErrorAs(t, err, &be)
	require.Len(t, be.Fields, 1)
	require.Equal(t, "csr", be.Fields[0].Field)

	_, err = e.b.Enroll(context.Background(), tok, apiv1.CertificateRequest{CSR: newCSR(t, northID)})
	require.Equal(t, problem.KindForbidden, problem.KindOf(err), "a CSR for another identity than the token's subject")

	_, err = e.client.CoreV1().Secrets(brokerNS).Get(context.Background(), enrollment.UsedJoinTokenSecretName(claims.ID), metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "refused requests do not use the token up")
	_, err = e.b.Enroll(context.Background(), tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.NoError(t, err)
}

func TestAnUnreachableAPIServerIsRetryableAndDoesNotUseTheTokenUp(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy)
	e.client.PrependReactor("create", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewServiceUnavailable("etcd is down")
	})
	tok, _ := e.joinToken(t, westID)
	_, err := e.b.Enroll(context.Background(), tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.Equal(t, problem.KindUnavailable, problem.KindOf(err))
	require.True(t, problem.Retryable(err))
}

func TestAMissingBrokerNamespaceIsAnInternalError(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy)
	e.client.PrependReactor("create", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewNotFound(schema.GroupResource{Resource: "namespaces"}, brokerNS)
	})
	tok, _ := e.joinToken(t, westID)
	_, err := e.b.Enroll(context.Background(), tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.Equal(t, problem.KindInternal, problem.KindOf(err))
}

func TestThePolicyChoosesThePeersCertificateLifetime(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, strings.Replace(testPolicy, "    identity: spiffe://oc.example/cluster/west\n",
		"    identity: spiffe://oc.example/cluster/west\n    certificateTTL: 2h\n", 1))
	tok, _ := e.joinToken(t, westID)
	resp, err := e.b.Enroll(context.Background(), tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(2*time.Hour), resp.NotAfter, time.Minute)

	// A peer without certificateTTL gets the broker's default.
	resp, err = e.b.Renew(context.Background(), callerFrom(t, e.ca, northID), apiv1.CertificateRequest{CSR: newCSR(t, northID)})
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(pki.DefaultClientLifetime), resp.NotAfter, time.Minute)
}

func TestRenewal(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy, enrollment.RevocationEntry{Kind: enrollment.RevokeIdentity, Value: northID})
	ctx := context.Background()

	t.Run("a caller renews for its own identity with a new key", func(t *testing.T) {
		t.Parallel()
		resp, err := e.b.Renew(ctx, callerFrom(t, e.ca, westID), apiv1.CertificateRequest{CSR: newCSR(t, westID)})
		require.NoError(t, err)
		require.Equal(t, westID, resp.Identity)
	})
	t.Run("a CSR for another identity is forbidden", func(t *testing.T) {
		t.Parallel()
		_, err := e.b.Renew(ctx, callerFrom(t, e.ca, westID), apiv1.CertificateRequest{CSR: newCSR(t, "spiffe://oc.example/cluster/south")})
		require.Equal(t, problem.KindForbidden, problem.KindOf(err))
	})
	t.Run("a revoked identity cannot renew", func(t *testing.T) {
		t.Parallel()
		_, err := e.b.Renew(ctx, callerFrom(t, e.ca, northID), apiv1.CertificateRequest{CSR: newCSR(t, northID)})
		require.Equal(t, problem.KindUnauthenticated, problem.KindOf(err))
	})
	t.Run("a CSR that is not PEM is invalid with a field error", func(t *testing.T) {
		t.Parallel()
		_, err := e.b.Renew(ctx, callerFrom(t, e.ca, westID), apiv1.CertificateRequest{CSR: "hello"})
		var be *problem.Error
		require.ErrorAs(t, err, &be)
		require.Equal(t, problem.KindInvalid, be.Kind)
		require.Equal(t, "csr", be.Fields[0].Field)
	})
	t.Run("renewal never records a join token", func(t *testing.T) {
		t.Parallel()
		require.Empty(t, e.client.Fake.Actions())
	})
}

func TestWithoutACAThereAreNoCertificates(t *testing.T) {
	t.Parallel()
	b, err := New(Config{Secrets: fake.NewClientset().CoreV1(), Policy: policy.NewStore(mustPolicy(t, testPolicy)), Logger: zap.NewNop()})
	require.NoError(t, err)
	_, err = b.Enroll(context.Background(), "x", apiv1.CertificateRequest{CSR: "x"})
	require.Equal(t, problem.KindNotFound, problem.KindOf(err))
	_, err = b.Renew(context.Background(), west, apiv1.CertificateRequest{CSR: "x"})
	require.Equal(t, problem.KindNotFound, problem.KindOf(err))
	tb := b.TrustBundle()
	require.Empty(t, tb.CABundle)
	require.NotNil(t, tb.Fingerprints)
}

func TestTheTrustBundleListsFingerprintsInOrder(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy)
	tb := e.b.TrustBundle()
	require.Equal(t, string(e.ca.BundlePEM()), tb.CABundle)
	require.Equal(t, []string{pki.Fingerprint(e.ca.Certificate())}, tb.Fingerprints)
}

func TestBadConfigsAreRefused(t *testing.T) {
	t.Parallel()
	ca, err := pki.NewCA(pki.CAOptions{})
	require.NoError(t, err)
	base := Config{Secrets: fake.NewClientset().CoreV1(), Policy: policy.NewStore(nil), Logger: zap.NewNop()}
	noNS := base
	noNS.Enrollment.CA = ca
	_, err = New(noNS)
	require.ErrorContains(t, err, "Namespace")
	long := base
	long.Enrollment.CertificateTTL = 1000 * time.Hour
	_, err = New(long)
	require.ErrorContains(t, err, "CertificateTTL")
}

func TestUsedJoinTokenRecordsAreCollectedAfterExpiryAndNeverListedAsLeases(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy)
	ctx := context.Background()
	tok, claims := e.joinToken(t, westID)
	_, err := e.b.Enroll(ctx, tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.NoError(t, err)

	leases, err := allLeases(ctx, e.b, Caller{Identity: westID})
	require.NoError(t, err)
	require.Empty(t, leases)

	n, err := e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "the record is kept while the token could still be presented")

	// Past exp, but within the margin the verifier's leeway needs.
	e.b.cfg.Clock = clocktesting.NewFakeClock(claims.ExpiresAt.Add(time.Minute))
	n, err = e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Zero(t, n)

	e.b.cfg.Clock = clocktesting.NewFakeClock(claims.ExpiresAt.Add(enrollment.UsedJoinTokenMargin + time.Second))
	n, err = e.b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	_, err = e.client.CoreV1().Secrets(brokerNS).Get(ctx, enrollment.UsedJoinTokenSecretName(claims.ID), metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err))
}

func TestLeaseSecretsCarryTheLeaseKind(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)
	s, err := e.client.CoreV1().Secrets("argo").Get(context.Background(), objects.LeaseSecretPrefix+resp.LeaseID, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, objects.LeaseKind, s.Labels[objects.LabelKind])
}

func TestACertificateNeverOutlivesItsCA(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy)
	ca, err := pki.NewCA(pki.CAOptions{Lifetime: 3 * time.Hour})
	require.NoError(t, err)
	e.b.cfg.Enrollment.CA = ca
	resp, err := e.b.Renew(context.Background(), callerFrom(t, ca, westID), apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.NoError(t, err)
	require.False(t, resp.NotAfter.After(ca.Certificate().NotAfter))
	require.WithinDuration(t, ca.Certificate().NotAfter, resp.NotAfter, 2*time.Minute)
	require.Equal(t, 1, e.logs.FilterMessage("certificate lifetime shortened: the signing CA expires sooner; rotate the CA").Len())
}

func TestTheCAsSigningErrorsAreNotTheCallersFault(t *testing.T) {
	t.Parallel()
	e := newCertEnv(t, testPolicy)
	e.b.cfg.Enrollment.CA = failingCA{e.ca}
	_, err := e.b.Renew(context.Background(), callerFrom(t, e.ca, westID), apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	require.Equal(t, problem.KindInternal, problem.KindOf(err))
}

type failingCA struct{ *pki.CA }

func (failingCA) SignClient(*x509.CertificateRequest, string, time.Duration) (*pki.KeyPair, error) {
	return nil, errors.New("sign client certificate: " + pki.ErrLifetimeExceedsCA.Error())
}

// swappableCA is a CertificateAuthority whose CA the test replaces, as a
// pki.CAReloader's is replaced when its files change.
type swappableCA struct{ atomic.Pointer[pki.CA] }

func (s *swappableCA) SignClient(csr *x509.CertificateRequest, identity string, lifetime time.Duration) (*pki.KeyPair, error) {
	return s.Load().SignClient(csr, identity, lifetime)
}
func (s *swappableCA) Certificate() *x509.Certificate { return s.Load().Certificate() }

// bundleTrust is a TrustSource over the CAs the test sets.
type bundleTrust struct{ cas atomic.Pointer[[]*pki.CA] }

func (b *bundleTrust) set(cas ...*pki.CA) { b.cas.Store(&cas) }
func (b *bundleTrust) PEM() []byte {
	var out []byte
	for _, ca := range *b.cas.Load() {
		out = append(out, ca.BundlePEM()...)
	}
	return out
}
func (b *bundleTrust) Certificates() []*x509.Certificate {
	var out []*x509.Certificate
	for _, ca := range *b.cas.Load() {
		out = append(out, ca.Certificate())
	}
	return out
}

func TestTheOldSigningCAWorksOnlyWhileItIsNamedThePreviousCA(t *testing.T) {
	t.Parallel()
	mk := func(name string) *pki.CA {
		ca, err := pki.NewCA(pki.CAOptions{CommonName: name})
		require.NoError(t, err)
		return ca
	}
	oldCA, newCA, partner := mk("old"), mk("new"), mk("partner")
	var signing swappableCA
	signing.Store(oldCA)
	var trust, previous bundleTrust
	trust.set(oldCA, partner)
	previous.set()
	b, err := New(Config{
		Secrets: fake.NewClientset().CoreV1(), Policy: policy.NewStore(mustPolicy(t, testPolicy)), Logger: zap.NewNop(),
		Namespace: brokerNS, Enrollment: enrollment.Config{CA: &signing, Trust: &trust, PreviousCA: &previous, Revocations: enrollment.StaticRevocationList(enrollment.NewDenyList(nil))},
	})
	require.NoError(t, err)
	enroll := func(ca *pki.CA) (*apiv1.CertificateResponse, error) {
		tok, _, err := ca.IssueJoinToken(pki.JoinTokenOptions{Identity: westID, Audiences: []string{"east"}})
		require.NoError(t, err)
		return b.Enroll(context.Background(), tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
	}
	renew := func(ca *pki.CA) error {
		_, err := b.Renew(context.Background(), callerFrom(t, ca, westID), apiv1.CertificateRequest{CSR: newCSR(t, westID)})
		return err
	}
	issuer := func(resp *apiv1.CertificateResponse) *x509.Certificate {
		certs, err := pki.ParseCertificatesPEM([]byte(resp.Certificate))
		require.NoError(t, err)
		return certs[0]
	}

	// A partner CA of the bundle authenticates peers but is no signing CA.
	_, err = enroll(partner)
	requireUniformUnauthenticated(t, err)
	require.Equal(t, problem.KindForbidden, problem.KindOf(renew(partner)))

	// The rotation: the new CA signs, the old one is named the previous CA.
	trust.set(newCA, oldCA, partner)
	signing.Store(newCA)
	previous.set(oldCA)
	for _, ca := range []*pki.CA{oldCA, newCA} {
		resp, err := enroll(ca)
		require.NoError(t, err, "a token of %s during the overlap", ca.Certificate().Subject.CommonName)
		require.NoError(t, issuer(resp).CheckSignatureFrom(newCA.Certificate()), "signed by the CA in force")
		require.NoError(t, renew(ca), "a certificate of %s renews during the overlap", ca.Certificate().Subject.CommonName)
	}

	// The old CA is no longer named previous: its tokens and certificates
	// stop working here even while it stays in the bundle.
	previous.set()
	_, err = enroll(oldCA)
	requireUniformUnauthenticated(t, err)
	require.Equal(t, problem.KindForbidden, problem.KindOf(renew(oldCA)))
	_, err = enroll(newCA)
	require.NoError(t, err)
}

func TestAJoinTokenMustNameThisBroker(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		names   []string // Config.BrokerNames
		unbound bool     // Config.AcceptUnboundJoinTokens
		aud     []string // nil: an unbound token
		cluster string   // the policy's cluster.name, if not east; stored as a policy that skipped validation
		wantErr bool
	}{
		{name: "by default the policy's cluster.name is this broker's name", aud: []string{"east"}},
		{name: "a token naming this broker among others enrolls", aud: []string{"south", "east"}},
		{name: "a token for another broker of the CA is refused", aud: []string{"south"}, wantErr: true},
		{name: "an unbound token is refused by default", wantErr: true},
		{name: "an unbound token enrolls where unbound tokens are accepted", unbound: true},
		{name: "a bound token for another broker stays refused where unbound tokens are accepted", unbound: true, aud: []string{"south"}, wantErr: true},
		{name: "configured names replace the cluster.name", names: []string{"east-broker.example.com"}, aud: []string{"east"}, wantErr: true},
		{name: "a token naming a configured name enrolls", names: []string{"east-a", "east-b"}, aud: []string{"east-b"}},
		{name: "a cluster.name that is the unbound audience does not make this broker take unbound tokens", cluster: pki.JoinTokenAudience, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newCertEnv(t, testPolicy)
			e.b.cfg.Enrollment.BrokerNames, e.b.cfg.Enrollment.AcceptUnboundJoinTokens = tc.names, tc.unbound
			if tc.cluster != "" {
				p := *e.b.cfg.Policy.Load()
				p.Cluster.Name = tc.cluster
				e.b.cfg.Policy.Store(&p)
			}
			tok, claims := e.joinToken(t, westID, func(o *pki.JoinTokenOptions) { o.Audiences = tc.aud })
			if tc.aud == nil {
				require.Equal(t, []string{pki.JoinTokenAudience}, claims.Audiences)
			}
			_, err := e.b.Enroll(context.Background(), tok, apiv1.CertificateRequest{CSR: newCSR(t, westID)})
			if tc.wantErr {
				requireUniformUnauthenticated(t, err)
				return
			}
			require.NoError(t, err)
		})
	}
}
