package agent

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

const ctbSigner = "tokenbroker.io/east"

func ctbOf(name, signer string, pem []byte) certificatesv1.ClusterTrustBundle {
	return certificatesv1.ClusterTrustBundle{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       certificatesv1.ClusterTrustBundleSpec{SignerName: signer, TrustBundle: string(pem)},
	}
}

func TestSelectTrust(t *testing.T) {
	t.Parallel()
	broker, err := pki.NewCA(pki.CAOptions{CommonName: "broker", PathLen: 1})
	require.NoError(t, err)
	next, err := broker.NewIntermediate(pki.CAOptions{CommonName: "broker's next"})
	require.NoError(t, err)
	attacker, err := pki.NewCA(pki.CAOptions{CommonName: "attacker"})
	require.NoError(t, err)
	leaf, err := broker.IssueClient(pki.ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	require.NoError(t, err)
	now := time.Now()
	log := zap.NewNop()
	ours := ctbOf("tokenbroker.io:east:trust-bundle", ctbSigner, broker.CertPEM())

	t.Run("bundles of the signer are merged", func(t *testing.T) {
		t.Parallel()
		certs, err := selectTrust([]certificatesv1.ClusterTrustBundle{ours,
			ctbOf("tokenbroker.io:east:second", ctbSigner, pki.EncodeCertificatesPEM([]*x509.Certificate{next.Certificate()}))}, ctbSigner, "", now, log)
		require.NoError(t, err)
		require.Len(t, certs, 2)
	})
	t.Run("a bundle without a signer or of another signer never counts", func(t *testing.T) {
		t.Parallel()
		certs, err := selectTrust([]certificatesv1.ClusterTrustBundle{ours,
			ctbOf("attacker", "", attacker.CertPEM()),
			ctbOf("tokenbroker.io:west:trust-bundle", "tokenbroker.io/west", attacker.CertPEM()),
			// Named for our signer but linked to another: the API server
			// refuses it, a tampered answer must not slip it in.
			ctbOf("tokenbroker.io:east:x", "tokenbroker.io/west", attacker.CertPEM()),
			// Linked to our signer but not named for it: the API server
			// refuses it, a tampered answer must not slip it in.
			ctbOf("attacker", ctbSigner, attacker.CertPEM()),
			ctbOf("tokenbroker.io:eastern:trust-bundle", ctbSigner, attacker.CertPEM()),
		}, ctbSigner, "", now, log)
		require.NoError(t, err)
		require.Len(t, certs, 1)
		require.True(t, certs[0].Equal(broker.Certificate()))
	})
	t.Run("malformed, empty and non-CA bundles are skipped", func(t *testing.T) {
		t.Parallel()
		certs, err := selectTrust([]certificatesv1.ClusterTrustBundle{
			ctbOf("tokenbroker.io:east:a", ctbSigner, []byte("garbage")),
			ctbOf("tokenbroker.io:east:b", ctbSigner, nil),
			ctbOf("tokenbroker.io:east:c", ctbSigner, append(append([]byte(nil), leaf.CertPEM...), attacker.CertPEM()...)),
			ours,
		}, ctbSigner, "", now, log)
		require.NoError(t, err)
		require.Len(t, certs, 1)
		require.True(t, certs[0].Equal(broker.Certificate()))
	})
	t.Run("nothing usable is an error", func(t *testing.T) {
		t.Parallel()
		_, err := selectTrust([]certificatesv1.ClusterTrustBundle{ctbOf("tokenbroker.io:east:a", ctbSigner, []byte("garbage"))}, ctbSigner, "", now, log)
		require.ErrorContains(t, err, "no CA certificate")
		_, err = selectTrust(nil, ctbSigner, "", now, log)
		require.Error(t, err)
	})
	t.Run("with a pin, an attacker CA written under the signer is dropped", func(t *testing.T) {
		t.Parallel()
		certs, err := selectTrust([]certificatesv1.ClusterTrustBundle{
			ctbOf("tokenbroker.io:east:evil", ctbSigner, attacker.CertPEM()), ours,
			ctbOf("tokenbroker.io:east:next", ctbSigner, pki.EncodeCertificatesPEM([]*x509.Certificate{next.Certificate()})),
		}, ctbSigner, pki.Fingerprint(broker.Certificate()), now, log)
		require.NoError(t, err)
		require.Len(t, certs, 2)
		require.True(t, certs[0].Equal(broker.Certificate()))
		require.True(t, certs[1].Equal(next.Certificate()))
	})
	t.Run("with a pin, bundles without the pinned CA are refused", func(t *testing.T) {
		t.Parallel()
		_, err := selectTrust([]certificatesv1.ClusterTrustBundle{ctbOf("tokenbroker.io:east:evil", ctbSigner, attacker.CertPEM())},
			ctbSigner, pki.Fingerprint(broker.Certificate()), now, log)
		require.ErrorIs(t, err, pki.ErrFingerprintMismatch)
	})
}

type ctFixture struct {
	ct      *clusterTrust
	client  *fake.Clientset
	clock   *clocktesting.FakeClock
	brokers *brokers
}

func newCTFixture(t *testing.T, objs ...runtime.Object) *ctFixture {
	t.Helper()
	f := &ctFixture{client: fake.NewClientset(objs...), clock: clocktesting.NewFakeClock(time.Now())}
	var err error
	f.ct, err = newClusterTrust(config.ClusterTrustBundleSource{SignerName: ctbSigner, Interval: apiv1.Duration(time.Minute)}, "",
		f.client.CertificatesV1().ClusterTrustBundles(), f.clock, zap.NewNop())
	require.NoError(t, err)
	h := &identityHolder{}
	h.set(&identity{})
	f.brokers = newBrokers(h)
	f.brokers.trust = f.ct.get
	return f
}

func TestClusterTrustTrustsNothingOnceTheBundlesYieldNothing(t *testing.T) {
	t.Parallel()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "broker"})
	require.NoError(t, err)
	b := ctbOf("tokenbroker.io:east:trust-bundle", ctbSigner, ca.CertPEM())
	f := newCTFixture(t, &b)
	require.Nil(t, f.ct.get())
	ctx := context.Background()
	require.NoError(t, f.ct.refresh(ctx))
	require.Equal(t, string(ca.CertPEM()), string(f.ct.get().pem))
	_, err = f.brokers.client("https://east:8443")
	require.NoError(t, err)

	// An operator deletes the bundle to cut a compromised CA off: the
	// answer is authoritative, the agent trusts no broker.
	bundles := f.client.CertificatesV1().ClusterTrustBundles()
	require.NoError(t, bundles.Delete(ctx, b.Name, metav1.DeleteOptions{}))
	require.ErrorIs(t, f.ct.refresh(ctx), errNoTrust)
	_, err = f.brokers.client("https://east:8443")
	require.ErrorIs(t, err, errNoTrust)
	require.Empty(t, f.brokers.clients, "no client kept for the CAs dropped")

	// A bundle that holds nothing usable is the same.
	bad := ctbOf("tokenbroker.io:east:trust-bundle", ctbSigner, []byte("garbage"))
	_, err = bundles.Create(ctx, &bad, metav1.CreateOptions{})
	require.NoError(t, err)
	require.ErrorIs(t, f.ct.refresh(ctx), errNoTrust)
	_, err = f.brokers.client("https://east:8443")
	require.ErrorIs(t, err, errNoTrust)

	// Trust comes back with a good bundle.
	_, err = bundles.Update(ctx, &b, metav1.UpdateOptions{})
	require.NoError(t, err)
	require.NoError(t, f.ct.refresh(ctx))
	_, err = f.brokers.client("https://east:8443")
	require.NoError(t, err)
}

func TestClusterTrustOutlivesFailedReadsOnlyForTheGrace(t *testing.T) {
	t.Parallel()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "broker"})
	require.NoError(t, err)
	b := ctbOf("tokenbroker.io:east:trust-bundle", ctbSigner, ca.CertPEM())
	f := newCTFixture(t, &b)
	ctx := context.Background()
	require.NoError(t, f.ct.refresh(ctx))

	f.client.PrependReactor("list", "clustertrustbundles", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("connection refused")
	})
	grace := trustGraceIntervals * time.Minute
	f.clock.Step(grace)
	require.ErrorContains(t, f.ct.refresh(ctx), "the CAs in service stay")
	require.NoError(t, f.ct.get().err)
	_, err = f.brokers.client("https://east:8443")
	require.NoError(t, err, "within the grace the CAs in service stay")

	f.clock.Step(time.Second)
	require.ErrorIs(t, f.ct.refresh(ctx), errNoTrust)
	_, err = f.brokers.client("https://east:8443")
	require.ErrorIs(t, err, errNoTrust, "past the grace no broker is trusted")
}

func TestClusterTrustTakesExactlyTheLimitAndRefusesMore(t *testing.T) {
	t.Parallel()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "broker"})
	require.NoError(t, err)
	var objs []runtime.Object
	for i := range maxTrustBundles {
		b := ctbOf(fmt.Sprintf("tokenbroker.io:east:b%02d", i), ctbSigner, ca.CertPEM())
		objs = append(objs, &b)
	}
	f := newCTFixture(t, objs...)
	ctx := context.Background()
	require.NoError(t, f.ct.refresh(ctx), "exactly the limit is fine")
	var limit int64
	for _, a := range f.client.Actions() {
		if l, ok := a.(k8stesting.ListActionImpl); ok {
			limit = l.ListOptions.Limit
		}
	}
	require.Equal(t, int64(maxTrustBundles+1), limit)

	more := ctbOf("tokenbroker.io:east:more", ctbSigner, ca.CertPEM())
	_, err = f.client.CertificatesV1().ClusterTrustBundles().Create(ctx, &more, metav1.CreateOptions{})
	require.NoError(t, err)
	err = f.ct.refresh(ctx)
	require.ErrorIs(t, err, errNoTrust)
	require.ErrorContains(t, err, "more than 64")
}

func TestABrokerClientWaitsForTheFirstClusterTrustBundle(t *testing.T) {
	t.Parallel()
	h := &identityHolder{}
	h.set(&identity{})
	b := newBrokers(h)
	b.trust = func() *trustState { return nil }
	_, err := b.client("https://east:8443")
	require.ErrorIs(t, err, errNoTrustYet)
}
