package agent

import (
	"context"
	"crypto/x509"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"

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

func TestClusterTrustKeepsTheCAsInServiceWhenARefreshFindsNothing(t *testing.T) {
	t.Parallel()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "broker"})
	require.NoError(t, err)
	b := ctbOf("tokenbroker.io:east:trust-bundle", ctbSigner, ca.CertPEM())
	client := fake.NewClientset(&b)
	ct, err := newClusterTrust(ClusterTrustBundleSource{SignerName: ctbSigner, Interval: apiv1.Duration(time.Minute)}, "",
		client.CertificatesV1().ClusterTrustBundles(), clocktesting.NewFakeClock(time.Now()), zap.NewNop())
	require.NoError(t, err)
	require.Nil(t, ct.get())

	brokers := newBrokers(&identityHolder{})
	brokers.trust = ct.get
	ctx := context.Background()
	require.NoError(t, ct.refresh(ctx))
	require.Equal(t, string(ca.CertPEM()), string(ct.get().pem))

	require.NoError(t, client.CertificatesV1().ClusterTrustBundles().Delete(ctx, b.Name, metav1.DeleteOptions{}))
	require.Error(t, ct.refresh(ctx))
	require.Equal(t, string(ca.CertPEM()), string(ct.get().pem), "the CAs in service stay")
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
