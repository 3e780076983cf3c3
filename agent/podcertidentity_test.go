package agent

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/pki/pkitest"
)

// TestAWorkloadsClientPresentsItsPodCertificateButTheAgentNever: an
// identity directory made of a pod certificate (the kubelet's
// podCertificate volume as tls.crt and tls.key, beside ca.crt) is a
// workload's identity for the broker clients of the exec plugin and "get
// kubeconfig", and never the agent's own, which speaks for its cluster.
func TestAWorkloadsClientPresentsItsPodCertificateButTheAgentNever(t *testing.T) {
	t.Parallel()
	root := pkitest.FleetRoot(t, 48*time.Hour)
	_, clusterCA := pkitest.ClusterCA(t, root, westID, 24*time.Hour)
	chain, _, keyPEM := pkitest.PodCertificate(t, clusterCA, westID, "argo", "runner")
	dir := t.TempDir()
	for name, data := range map[string][]byte{CertFile: chain, KeyFile: keyPEM, BundleFile: root.BundlePEM()} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o600))
	}

	c, err := NewIdentityClient(context.Background(), "https://east.example.com:8443", IdentityDir(dir))
	require.NoError(t, err, "a workload's client presents its pod certificate")
	c.CloseIdleConnections()

	_, err = dirStore{dir: IdentityDir(dir)}.load(context.Background())
	require.ErrorIs(t, err, pki.ErrInvalidIdentity, "the agent's own identity is its cluster's, never a workload's")
}
