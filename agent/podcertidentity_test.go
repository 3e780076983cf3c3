package agent

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
)

// TestAWorkloadsClientPresentsItsPodCertificateButTheAgentNever: an
// identity directory made of a pod certificate (the kubelet's
// podCertificate volume as tls.crt and tls.key, beside ca.crt) is a
// workload's identity for the broker clients of the exec plugin and "get
// kubeconfig", and never the agent's own, which speaks for its cluster.
func TestAWorkloadsClientPresentsItsPodCertificateButTheAgentNever(t *testing.T) {
	t.Parallel()
	root, err := pki.NewCA(pki.CAOptions{PathLen: 1, Lifetime: 48 * time.Hour})
	require.NoError(t, err)
	csrPEM, caKeyPEM, err := pki.NewCSR(westID, nil)
	require.NoError(t, err)
	csr, _, err := pki.ParseCSRPEM(csrPEM)
	require.NoError(t, err)
	kp, err := root.SignClusterCA(csr, westID, 24*time.Hour)
	require.NoError(t, err)
	clusterCA, err := pki.ParseCA(kp.CertPEM, caKeyPEM, pki.CAOptions{})
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	nb := time.Now().Add(-time.Minute).Truncate(time.Second)
	_, chain, err := clusterCA.SignPodCertificate(westID, pki.PodCertificate{Identity: westID + "/ns/argo/sa/runner",
		PublicKey: key.Public(), NotBefore: nb, NotAfter: nb.Add(time.Hour), PodName: "runner-0", PodUID: "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54"})
	require.NoError(t, err)
	der, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
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
