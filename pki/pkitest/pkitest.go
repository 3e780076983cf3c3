// Package pkitest makes the chains of pod certificates for tests of the
// packages that verify them: a fleet root that may sign cluster CAs, a
// cluster's CA (pki.SignClusterCA, from a CSR as a cluster sends it) and
// a pod certificate under it (pki.SignPodCertificate).
package pkitest

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
)

// PodUID is the uid of the Pod PodCertificate names by default.
const PodUID = "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54"

// FleetRoot is a root of lifetime that may sign cluster CAs.
func FleetRoot(t testing.TB, lifetime time.Duration) *pki.CA {
	t.Helper()
	root, err := pki.NewCA(pki.CAOptions{CommonName: "fleet root", PathLen: 1, Lifetime: lifetime})
	require.NoError(t, err)
	return root
}

// ClusterCA has root sign the CA of cluster (a cluster identity) for
// lifetime, from a CSR of a fresh key, and returns what the broker
// answers (the certificate, then root's chain below it) and the CA as the
// cluster holds it, with its key.
func ClusterCA(t testing.TB, root *pki.CA, cluster string, lifetime time.Duration) (*pki.KeyPair, *pki.CA) {
	t.Helper()
	csrPEM, keyPEM, err := pki.NewCSR(cluster, nil)
	require.NoError(t, err)
	csr, _, err := pki.ParseCSRPEM(csrPEM)
	require.NoError(t, err)
	kp, err := root.SignClusterCA(csr, cluster, lifetime)
	require.NoError(t, err)
	ca, err := pki.ParseCA(kp.CertPEM, keyPEM, pki.CAOptions{})
	require.NoError(t, err)
	return kp, ca
}

// PodCertificate has ca, the CA of cluster, sign the pod certificate of
// namespace/serviceAccount for the Pod runner-0 (PodUID), valid for an
// hour from a minute ago, and returns its chain's PEM (leaf first, as the
// kubelet writes it), the leaf, and its key's PEM.
func PodCertificate(t testing.TB, ca *pki.CA, cluster, namespace, serviceAccount string) (chainPEM []byte, leaf *x509.Certificate, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	id, err := pki.WorkloadIdentity(cluster, namespace, serviceAccount)
	require.NoError(t, err)
	nb := time.Now().Add(-time.Minute).Truncate(time.Second)
	leaf, chainPEM, err = ca.SignPodCertificate(cluster, pki.PodCertificate{Identity: id, PublicKey: crypto.PublicKey(key.Public()),
		NotBefore: nb, NotAfter: nb.Add(time.Hour), PodName: "runner-0", PodUID: PodUID})
	require.NoError(t, err)
	der, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	return chainPEM, leaf, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
}
