package enrollment

import (
	"context"
	"crypto/x509"
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/pki"
)

const testSigner = "tokenbroker.io/east"

type ctbFixture struct {
	client *fake.Clientset
	pub    *ClusterTrustBundlePublisher
	clock  *clocktesting.FakeClock
	reg    *prometheus.Registry
	cas    []*x509.Certificate
}

func newCTBFixture(t *testing.T, objs ...runtime.Object) *ctbFixture {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "east"})
	require.NoError(t, err)
	f := &ctbFixture{client: fake.NewClientset(objs...), clock: clocktesting.NewFakeClock(time.Now()),
		reg: prometheus.NewRegistry(), cas: []*x509.Certificate{ca.Certificate()}}
	f.pub, err = NewClusterTrustBundlePublisher(ClusterTrustBundleConfig{
		Client:     f.client.CertificatesV1().ClusterTrustBundles(),
		SignerName: testSigner,
		Owner:      "east",
		Bundle:     func() []*x509.Certificate { return f.cas },
		Clock:      f.clock,
		Registerer: f.reg,
	})
	require.NoError(t, err)
	return f
}

func (f *ctbFixture) bundle(t *testing.T) *certificatesv1.ClusterTrustBundle {
	t.Helper()
	b, err := f.client.CertificatesV1().ClusterTrustBundles().Get(context.Background(), "tokenbroker.io:east:trust-bundle", metav1.GetOptions{})
	require.NoError(t, err)
	return b
}

func TestClusterTrustBundlePublisher(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("a missing bundle is created, signer-linked and labelled, with the served CAs", func(t *testing.T) {
		t.Parallel()
		f := newCTBFixture(t)
		f.pub.step(ctx)
		b := f.bundle(t)
		require.Equal(t, testSigner, b.Spec.SignerName)
		require.Equal(t, objects.ManagedByValue, b.Labels[objects.LabelManagedBy])
		require.Equal(t, "east", b.Annotations[AnnotationBroker])
		require.Equal(t, string(pki.EncodeCertificatesPEM(f.cas)), b.Spec.TrustBundle)
		require.Equal(t, 1.0, testutil.ToFloat64(f.pub.inSync))
	})
	t.Run("a change of the served CAs is published at the next check, not before", func(t *testing.T) {
		t.Parallel()
		f := newCTBFixture(t)
		f.pub.step(ctx)
		next, err := pki.NewCA(pki.CAOptions{CommonName: "east next"})
		require.NoError(t, err)
		f.cas = append(f.cas, next.Certificate())
		f.pub.step(ctx)
		require.Equal(t, string(pki.EncodeCertificatesPEM(f.cas)), f.bundle(t).Spec.TrustBundle)
		// Nothing changed: no call until the resync.
		calls := len(f.client.Actions())
		f.pub.step(ctx)
		require.Len(t, f.client.Actions(), calls)
		f.clock.Step(DefaultBundleResync)
		f.pub.step(ctx)
		require.Greater(t, len(f.client.Actions()), calls)
	})
	for _, tc := range []struct {
		name        string
		labels      map[string]string
		annotations map[string]string
		signer      string
	}{
		{"made by someone else (no label)", nil, map[string]string{AnnotationBroker: "east"}, testSigner},
		// The label alone is not ownership: another broker given the
		// same signer labels its bundle the same way.
		{"made by another broker with the same signer", map[string]string{objects.LabelManagedBy: objects.ManagedByValue}, map[string]string{AnnotationBroker: "west"}, testSigner},
		{"labelled but naming no broker", map[string]string{objects.LabelManagedBy: objects.ManagedByValue}, nil, testSigner},
		{"labelled and ours but of another signer", map[string]string{objects.LabelManagedBy: objects.ManagedByValue}, map[string]string{AnnotationBroker: "east"}, ""},
	} {
		t.Run("a bundle "+tc.name+" is never overwritten", func(t *testing.T) {
			t.Parallel()
			foreign := &certificatesv1.ClusterTrustBundle{
				ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker.io:east:trust-bundle", Labels: tc.labels, Annotations: tc.annotations},
				Spec:       certificatesv1.ClusterTrustBundleSpec{SignerName: tc.signer, TrustBundle: "theirs"},
			}
			f := newCTBFixture(t, foreign)
			err := f.pub.Sync(ctx)
			require.ErrorIs(t, err, ErrBundleNotOwned)
			require.Equal(t, "theirs", f.bundle(t).Spec.TrustBundle)
			require.Equal(t, 0.0, testutil.ToFloat64(f.pub.inSync))
			require.Equal(t, 1.0, testutil.ToFloat64(f.pub.syncs.WithLabelValues("failure")))
			require.Equal(t, 1.0, testutil.ToFloat64(f.pub.notOwned))
		})
	}
	t.Run("the bundle this broker made is updated", func(t *testing.T) {
		t.Parallel()
		mine := &certificatesv1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker.io:east:trust-bundle",
				Labels: map[string]string{objects.LabelManagedBy: objects.ManagedByValue}, Annotations: map[string]string{AnnotationBroker: "east"}},
			Spec: certificatesv1.ClusterTrustBundleSpec{SignerName: testSigner, TrustBundle: "old"},
		}
		f := newCTBFixture(t, mine)
		require.NoError(t, f.pub.Sync(ctx))
		require.Equal(t, string(pki.EncodeCertificatesPEM(f.cas)), f.bundle(t).Spec.TrustBundle)
		require.Equal(t, 0.0, testutil.ToFloat64(f.pub.notOwned))
	})
	t.Run("a failed write is retried with backoff, and counted", func(t *testing.T) {
		t.Parallel()
		f := newCTBFixture(t)
		fail := true
		f.client.PrependReactor("create", "clustertrustbundles", func(k8stesting.Action) (bool, runtime.Object, error) {
			if fail {
				return true, nil, context.DeadlineExceeded
			}
			return false, nil, nil
		})
		f.pub.step(ctx)
		require.Equal(t, 1, f.pub.failures)
		f.pub.step(ctx) // within the backoff: no try
		require.Equal(t, 1, f.pub.failures)
		f.clock.Step(bundleMinBackoff)
		f.pub.step(ctx)
		require.Equal(t, 2, f.pub.failures)
		fail = false
		f.clock.Step(2 * bundleMinBackoff)
		f.pub.step(ctx)
		require.Equal(t, 0, f.pub.failures)
		require.Equal(t, 2.0, testutil.ToFloat64(f.pub.syncs.WithLabelValues("failure")))
		require.Equal(t, 1.0, testutil.ToFloat64(f.pub.inSync))
	})
	t.Run("nothing to publish is a failure, never an empty bundle", func(t *testing.T) {
		t.Parallel()
		f := newCTBFixture(t)
		f.cas = nil
		require.ErrorContains(t, f.pub.Sync(ctx), "no CA certificate")
		require.Empty(t, f.client.Actions())
	})
}

func TestNewClusterTrustBundlePublisherRefusesAnInvalidSigner(t *testing.T) {
	t.Parallel()
	_, err := NewClusterTrustBundlePublisher(ClusterTrustBundleConfig{
		Client:     fake.NewClientset().CertificatesV1().ClusterTrustBundles(),
		SignerName: "east",
		Owner:      "east",
		Bundle:     func() []*x509.Certificate { return nil },
	})
	require.ErrorContains(t, err, "signer name")
}

func TestPublishedCAs(t *testing.T) {
	t.Parallel()
	root, err := pki.NewCA(pki.CAOptions{CommonName: "root", PathLen: 1})
	require.NoError(t, err)
	inter, err := root.NewIntermediate(pki.CAOptions{CommonName: "serving intermediate"})
	require.NoError(t, err)
	partner, err := pki.NewCA(pki.CAOptions{CommonName: "partner"})
	require.NoError(t, err)
	signing, err := pki.NewCA(pki.CAOptions{CommonName: "signing"})
	require.NoError(t, err)
	previous, err := pki.NewCA(pki.CAOptions{CommonName: "previous"})
	require.NoError(t, err)
	acme, err := pki.NewCA(pki.CAOptions{CommonName: "acme issuer"})
	require.NoError(t, err)
	leafFrom := func(ca *pki.CA) []*x509.Certificate {
		kp, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
		require.NoError(t, err)
		certs, err := pki.ParseCertificatesPEM(kp.CertPEM)
		require.NoError(t, err)
		return certs
	}
	has := func(cas []*x509.Certificate, c *pki.CA) bool { return containsCertificate(cas, c.Certificate()) }

	t.Run("partner CAs of the client-CA bundle are never published", func(t *testing.T) {
		t.Parallel()
		cas, ok := PublishedCAs(PublishSources{
			ServingChain: append(leafFrom(inter), inter.Certificate()),
			ClientCAs:    []*x509.Certificate{root.Certificate(), partner.Certificate(), root.Certificate()},
		}, time.Now())
		require.True(t, ok)
		require.Len(t, cas, 1, "the root the serving certificate verifies to, once")
		require.True(t, has(cas, root))
		require.False(t, has(cas, partner), "a partner CA published would be an anchor for a server certificate of the broker's name")
		require.False(t, has(cas, inter), "an intermediate the broker sends is not an anchor")
	})
	t.Run("the signing CA and the previous one are published during a rotation", func(t *testing.T) {
		t.Parallel()
		cas, ok := PublishedCAs(PublishSources{
			ServingChain: leafFrom(previous),
			ClientCAs:    []*x509.Certificate{previous.Certificate(), signing.Certificate(), partner.Certificate()},
			Signing:      signing.Certificate(),
			Previous:     []*x509.Certificate{previous.Certificate()},
		}, time.Now())
		require.True(t, ok)
		require.Len(t, cas, 2)
		require.True(t, has(cas, previous))
		require.True(t, has(cas, signing))
		require.False(t, has(cas, partner))
	})
	t.Run("a serving chain from a CA that is not the operator's is not published and is reported", func(t *testing.T) {
		t.Parallel()
		cas, ok := PublishedCAs(PublishSources{
			ServingChain: append(leafFrom(acme), acme.Certificate()),
			ClientCAs:    []*x509.Certificate{partner.Certificate()},
			Signing:      signing.Certificate(),
		}, time.Now())
		require.False(t, ok)
		require.Len(t, cas, 1)
		require.True(t, has(cas, signing))
		require.False(t, has(cas, acme), "an ACME or corporate issuer is nobody's anchor for this broker")
		require.False(t, has(cas, partner))
	})
	t.Run("a serving certificate that verifies only to a partner CA publishes that CA, as it is the broker's anchor", func(t *testing.T) {
		t.Parallel()
		// Not a partner then: the operator got the server certificate
		// from it. Listed to pin down the rule: what the serving
		// certificate verifies to, nothing else.
		cas, ok := PublishedCAs(PublishSources{ServingChain: leafFrom(partner),
			ClientCAs: []*x509.Certificate{partner.Certificate(), root.Certificate()}}, time.Now())
		require.True(t, ok)
		require.Len(t, cas, 1)
		require.True(t, has(cas, partner))
	})
}
