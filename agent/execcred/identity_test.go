package execcred

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
)

// TestThePluginsIdentityIsItsClustersOrItsPodCertificatesWorkload: the
// cache key of a cluster's certificate is the cluster, of a pod
// certificate (the kubelet's podCertificate volume) its workload, so that
// a workload's plugin never shares its cluster's cache; a CA is no
// identity.
func TestThePluginsIdentityIsItsClustersOrItsPodCertificatesWorkload(t *testing.T) {
	t.Parallel()
	const west = "spiffe://oc.example/cluster/west"
	root, err := pki.NewCA(pki.CAOptions{PathLen: 1, Lifetime: 48 * time.Hour})
	require.NoError(t, err)
	dir := t.TempDir()
	write := func(name string, pem []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, pem, 0o600))
		return p
	}

	client, err := root.IssueClient(pki.ClientOptions{Identity: west})
	require.NoError(t, err)
	id, err := PeerIdentity(write("cluster.crt", client.CertPEM))
	require.NoError(t, err)
	require.Equal(t, west, id)

	csrPEM, keyPEM, err := pki.NewCSR(west, nil)
	require.NoError(t, err)
	csr, _, err := pki.ParseCSRPEM(csrPEM)
	require.NoError(t, err)
	kp, err := root.SignClusterCA(csr, west, time.Hour)
	require.NoError(t, err)
	clusterCA, err := pki.ParseCA(kp.CertPEM, keyPEM, pki.CAOptions{})
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	nb := time.Now().Truncate(time.Second)
	_, chain, err := clusterCA.SignPodCertificate(west, pki.PodCertificate{Identity: west + "/ns/argo/sa/runner", PublicKey: key.Public(),
		NotBefore: nb, NotAfter: nb.Add(time.Hour), PodName: "runner-0", PodUID: "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54"})
	require.NoError(t, err)
	id, err = PeerIdentity(write("pod.crt", chain))
	require.NoError(t, err)
	require.Equal(t, west+"/ns/argo/sa/runner", id)

	_, err = PeerIdentity(write("ca.crt", kp.CertPEM))
	require.ErrorIs(t, err, pki.ErrInvalidIdentity)
}
