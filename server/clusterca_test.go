package server

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"math/big"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/pki/pkitest"
)

// A cluster CA's name constraint keeps it in its trust domain, not in its
// cluster: a certificate it signs for a cluster identity verifies under
// X.509. The API listener refuses it, so that a cluster with a CA cannot
// become another cluster (or a second copy of itself that no revocation
// of its client certificate's serial reaches).
func TestAClusterIdentitySignedByAClusterCAIsRefused(t *testing.T) {
	t.Parallel()
	root := pkitest.FleetRoot(t, 24*time.Hour)
	clusterCA, ca := pkitest.ClusterCA(t, root, testIdentity, time.Hour)
	keyPEM, err := ca.KeyPEM()
	require.NoError(t, err)
	caKey, err := pki.ParsePrivateKeyPEM(keyPEM)
	require.NoError(t, err)

	for _, id := range []string{"spiffe://oc.example/cluster/north", testIdentity} {
		t.Run(id, func(t *testing.T) {
			t.Parallel()
			key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
			require.NoError(t, err)
			u, err := url.Parse(id)
			require.NoError(t, err)
			der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
				SerialNumber: big.NewInt(42), Subject: pkix.Name{CommonName: id}, URIs: []*url.URL{u},
				NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
				KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
				BasicConstraintsValid: true,
			}, clusterCA.Cert, key.Public(), caKey)
			require.NoError(t, err)
			leaf, err := x509.ParseCertificate(der)
			require.NoError(t, err)
			inter := x509.NewCertPool()
			inter.AddCert(clusterCA.Cert)
			chains, err := leaf.Verify(x509.VerifyOptions{Roots: root.CertPool(), Intermediates: inter,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
			require.NoError(t, err, "X.509 alone accepts it")
			st := &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true,
				PeerCertificates: []*x509.Certificate{leaf, clusterCA.Cert}, VerifiedChains: chains}
			require.Empty(t, peerIdentity(*st), "not counted as the cluster it names")

			h := newHarness(t, nil)
			rq := postKubeconfig(validBody)
			rq.tls = st
			requireProblem(t, h.do(rq), http.StatusUnauthorized, "unauthenticated")
			require.Zero(t, h.broker.calls.Load())
			require.Equal(t, audit.RefusedIdentity, h.broker.refused()[0].code)
		})
	}
}
