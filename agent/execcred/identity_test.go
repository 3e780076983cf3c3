package execcred

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/pki/pkitest"
)

// TestThePluginsIdentityIsItsClustersOrItsPodCertificatesWorkload: the
// cache key of a cluster's certificate is the cluster, of a pod
// certificate (the kubelet's podCertificate volume) its workload, so that
// a workload's plugin never shares its cluster's cache; a CA is no
// identity.
func TestThePluginsIdentityIsItsClustersOrItsPodCertificatesWorkload(t *testing.T) {
	t.Parallel()
	const west = "spiffe://oc.example/cluster/west"
	root := pkitest.FleetRoot(t, 48*time.Hour)
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

	kp, clusterCA := pkitest.ClusterCA(t, root, west, time.Hour)
	chain, _, _ := pkitest.PodCertificate(t, clusterCA, west, "argo", "runner")
	id, err = PeerIdentity(write("pod.crt", chain))
	require.NoError(t, err)
	require.Equal(t, west+"/ns/argo/sa/runner", id)

	_, err = PeerIdentity(write("ca.crt", kp.CertPEM))
	require.ErrorIs(t, err, pki.ErrInvalidIdentity)
}
