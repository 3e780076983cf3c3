package broker

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
		require.Equal(t, ManagedByValue, b.Labels[LabelManagedBy])
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
	t.Run("a bundle someone else made under the name is never overwritten", func(t *testing.T) {
		t.Parallel()
		foreign := &certificatesv1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker.io:east:trust-bundle"},
			Spec:       certificatesv1.ClusterTrustBundleSpec{SignerName: testSigner, TrustBundle: "theirs"},
		}
		f := newCTBFixture(t, foreign)
		err := f.pub.Sync(ctx)
		require.ErrorIs(t, err, ErrBundleNotOwned)
		require.Equal(t, "theirs", f.bundle(t).Spec.TrustBundle)
		require.Equal(t, 0.0, testutil.ToFloat64(f.pub.inSync))
		require.Equal(t, 1.0, testutil.ToFloat64(f.pub.syncs.WithLabelValues("failure")))
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
	leafFrom := func(ca *pki.CA) []*x509.Certificate {
		kp, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
		require.NoError(t, err)
		certs, err := pki.ParseCertificatesPEM(kp.CertPEM)
		require.NoError(t, err)
		return certs
	}

	t.Run("the trust bundle and the serving chain's CAs are published once each", func(t *testing.T) {
		t.Parallel()
		chain := append(leafFrom(inter), inter.Certificate())
		cas, ok := PublishedCAs([]*x509.Certificate{root.Certificate(), partner.Certificate(), root.Certificate()}, chain, time.Now())
		require.True(t, ok)
		require.Len(t, cas, 3)
		require.True(t, cas[2].Equal(inter.Certificate()))
	})
	t.Run("a serving certificate that does not chain to what is published is reported", func(t *testing.T) {
		t.Parallel()
		_, ok := PublishedCAs([]*x509.Certificate{partner.Certificate()}, leafFrom(root), time.Now())
		require.False(t, ok)
	})
}
