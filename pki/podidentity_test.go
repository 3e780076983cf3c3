package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const testPodUID = "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54"

// chainsOf verifies leaf to root through intermediates at testNow, for
// client authentication, as the broker's TLS stack does.
func chainsOf(t *testing.T, root *CA, leaf *x509.Certificate, intermediates ...*x509.Certificate) [][]*x509.Certificate {
	t.Helper()
	pool := x509.NewCertPool()
	for _, c := range intermediates {
		pool.AddCert(c)
	}
	chains, err := leaf.Verify(x509.VerifyOptions{Roots: root.CertPool(), Intermediates: pool, CurrentTime: testNow,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	return chains
}

// podCertUnder signs a pod certificate of bench/runner in the cluster of
// clusterID with ca, for the Pod runner-0.
func podCertUnder(t *testing.T, ca *CA, clusterID string) *x509.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	id, err := WorkloadIdentity(clusterID, "bench", "runner")
	require.NoError(t, err)
	nb := testNow.Add(-PodCertificateBackdate).Truncate(time.Second)
	cert, _, err := ca.SignPodCertificate(clusterID, PodCertificate{Identity: id, PublicKey: key.Public(),
		NotBefore: nb, NotAfter: nb.Add(time.Hour), PodName: "runner-0", PodUID: testPodUID})
	require.NoError(t, err)
	return cert
}

func TestAPodCertificateOfAClusterCATellsTheWorkloadItsClusterAndItsPod(t *testing.T) {
	t.Parallel()
	root := fleetRoot(t)
	east, err := ClusterIdentity("oc.example", "east")
	require.NoError(t, err)
	kp, ca := signedClusterCA(t, root, east, 24*time.Hour)
	leaf := podCertUnder(t, ca, east)
	require.Equal(t, pkix.Name{CommonName: "runner-0", SerialNumber: testPodUID}.String(), leaf.Subject.String())
	require.True(t, IsWorkloadCertificate(leaf))

	w, err := WorkloadFromChain(chainsOf(t, root, leaf, kp.Cert))
	require.NoError(t, err)
	require.Equal(t, &PodWorkload{Cluster: east, Identity: east + "/ns/bench/sa/runner", Namespace: "bench", ServiceAccount: "runner",
		PodName: "runner-0", PodUID: testPodUID, ClusterCA: kp.Cert}, w)

	// A cluster's own client certificate is no workload certificate.
	require.False(t, IsWorkloadCertificate(issueClient(t, root, "east").Cert))
	require.False(t, IsWorkloadCertificate(kp.Cert))
}

func TestAPodCertificateIsAWorkloadOnlyUnderTheClusterCAOfItsOwnCluster(t *testing.T) {
	t.Parallel()
	root := fleetRoot(t)
	east, err := ClusterIdentity("oc.example", "east")
	require.NoError(t, err)
	west, err := ClusterIdentity("oc.example", "west")
	require.NoError(t, err)
	eastKP, eastCA := signedClusterCA(t, root, east, 24*time.Hour)
	westWorkload := west + "/ns/bench/sa/runner"

	// A compromised east signs a workload of west with its cluster CA's
	// key: it verifies (same trust domain), and is refused.
	forged := forgedUnder(t, eastCA, westWorkload, false, x509.ExtKeyUsageClientAuth).cert
	_, err = WorkloadFromChain(chainsOf(t, root, forged, eastKP.Cert))
	require.ErrorIs(t, err, ErrNotPodCertificate)
	require.ErrorContains(t, err, "signed by the cluster CA of "+east)

	// The fleet CA itself signs no workload: there is no cluster CA.
	direct := forgedUnder(t, root, westWorkload, false, x509.ExtKeyUsageClientAuth).cert
	_, err = WorkloadFromChain(chainsOf(t, root, direct))
	require.ErrorIs(t, err, ErrNotPodCertificate)

	// An intermediate that is not a cluster CA (no name, path length 0)
	// vouches for no cluster.
	other, err := root.NewIntermediate(CAOptions{CommonName: "some intermediate"})
	require.NoError(t, err)
	viaOther := forgedUnder(t, other, westWorkload, false, x509.ExtKeyUsageClientAuth).cert
	_, err = WorkloadFromChain(chainsOf(t, root, viaOther, other.Certificate()))
	require.ErrorIs(t, err, ErrNotPodCertificate)
	require.ErrorIs(t, err, ErrNotClusterCA)

	// A workload certificate that names no Pod is refused.
	noPod := forgedUnder(t, eastCA, east+"/ns/bench/sa/runner", false, x509.ExtKeyUsageClientAuth).cert
	_, err = WorkloadFromChain(chainsOf(t, root, noPod, eastKP.Cert))
	require.ErrorIs(t, err, ErrNotPodCertificate)
	require.ErrorContains(t, err, "does not name a Pod")

	_, err = WorkloadFromChain(nil)
	require.ErrorIs(t, err, ErrNotPodCertificate)
}

func TestAPodCertificateNamesAPodByAUIDOnly(t *testing.T) {
	t.Parallel()
	root := fleetRoot(t)
	east, err := ClusterIdentity("oc.example", "east")
	require.NoError(t, err)
	_, ca := signedClusterCA(t, root, east, 24*time.Hour)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	nb := testNow.Truncate(time.Second)
	for _, c := range []struct{ name, uid string }{
		{"runner-0", "uid-1"},
		{"runner-0", ""},
		{"", testPodUID},
		{"Runner_0", testPodUID},
		{"runner-0", "6F1C2A9E-3B1D-4C55-9A1E-2F0D8C7B6A54"},
	} {
		_, _, err := ca.SignPodCertificate(east, PodCertificate{Identity: east + "/ns/bench/sa/runner", PublicKey: key.Public(),
			NotBefore: nb, NotAfter: nb.Add(time.Hour), PodName: c.name, PodUID: c.uid})
		require.ErrorIs(t, err, ErrInvalidWorkloadIdentity, "%+v", c)
	}
	require.True(t, ValidUID(testPodUID))
	require.False(t, ValidUID(testPodUID+"0"))
	require.False(t, ValidUID("6f1c2a9e_3b1d-4c55-9a1e-2f0d8c7b6a54"))
}
