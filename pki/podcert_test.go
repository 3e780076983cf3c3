package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const (
	eastID = "spiffe://oc.example/cluster/east"
	westID = "spiffe://oc.example/cluster/west"
)

func TestAWorkloadIdentityIsItsClustersPathToItsServiceAccount(t *testing.T) {
	t.Parallel()
	id, err := WorkloadIdentity(eastID, "argo", "runner.v1")
	require.NoError(t, err)
	require.Equal(t, eastID+"/ns/argo/sa/runner.v1", id)
	c, ns, sa, err := ParseWorkloadIdentity(id)
	require.NoError(t, err)
	require.Equal(t, []string{eastID, "argo", "runner.v1"}, []string{c, ns, sa})

	for _, bad := range []string{
		"", "https://oc.example/cluster/east/ns/argo/sa/runner",
		eastID, eastID + "/ns/argo", eastID + "/ns/argo/sa", eastID + "/ns/argo/sa/runner/",
		eastID + "/ns/argo/sa/runner/x", eastID + "/sa/argo/ns/runner", eastID + "/ns/Argo/sa/runner",
		eastID + "/ns/argo/sa/..", eastID + "/ns/../sa/runner", eastID + "/ns/argo/sa/run%2Fner",
		"spiffe://OC.example/cluster/east/ns/argo/sa/runner", "spiffe://oc.example/cluster/east/ns/argo/sa/runner?x",
		eastID + "/ns/argo/sa/" + strings.Repeat("a", 2100), eastID + "/ns/argo/sa/*.runner",
	} {
		_, _, _, err := ParseWorkloadIdentity(bad)
		require.ErrorIs(t, err, ErrInvalidWorkloadIdentity, bad)
	}
	_, err = WorkloadIdentity(eastID, "a/b", "runner")
	require.ErrorIs(t, err, ErrInvalidWorkloadIdentity)
	_, err = WorkloadIdentity("spiffe://oc.example/east", "argo", "runner")
	require.ErrorIs(t, err, ErrInvalidIdentity)
}

// clusterCA is a fleet root that allows intermediates and the
// intermediate of one cluster.
func clusterCA(t *testing.T) (root, cluster *CA) {
	t.Helper()
	root, err := NewCA(CAOptions{PathLen: 1, Now: fixedNow})
	require.NoError(t, err)
	cluster, err = root.NewIntermediate(CAOptions{CommonName: "east pod signer", Lifetime: 30 * 24 * time.Hour})
	require.NoError(t, err)
	return root, cluster
}

func TestAPodCertificateNamesOneWorkloadOfItsCASClusterAndChainsToTheFleet(t *testing.T) {
	t.Parallel()
	root, ca := clusterCA(t)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	id, err := WorkloadIdentity(eastID, "argo", "runner")
	require.NoError(t, err)
	nb := fixedNow().Truncate(time.Second)
	cert, chainPEM, err := ca.SignPodCertificate(eastID, PodCertificate{Identity: id, PublicKey: key.Public(), NotBefore: nb, NotAfter: nb.Add(time.Hour)})
	require.NoError(t, err)

	require.False(t, cert.IsCA)
	require.Len(t, cert.URIs, 1)
	require.Equal(t, id, cert.URIs[0].String())
	require.Empty(t, cert.DNSNames)
	require.Empty(t, cert.Subject.CommonName)
	require.Equal(t, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, cert.ExtKeyUsage)
	require.True(t, cert.NotBefore.Equal(nb))
	require.True(t, cert.NotAfter.Equal(nb.Add(time.Hour)))

	chain, err := ParseCertificatesPEM(chainPEM)
	require.NoError(t, err)
	require.Len(t, chain, 2, "the leaf, then the cluster's CA; the root is the relying party's")
	require.Equal(t, cert.Raw, chain[0].Raw)
	inter := x509.NewCertPool()
	inter.AddCert(chain[1])
	_, err = cert.Verify(x509.VerifyOptions{Roots: root.CertPool(), Intermediates: inter, CurrentTime: nb.Add(time.Minute),
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
}

func TestACASignsNoPodCertificateOutsideItsClusterOrItsValidity(t *testing.T) {
	t.Parallel()
	_, ca := clusterCA(t)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	nb := fixedNow().Truncate(time.Second)
	west, err := WorkloadIdentity(westID, "argo", "runner")
	require.NoError(t, err)
	east, err := WorkloadIdentity(eastID, "argo", "runner")
	require.NoError(t, err)
	for name, p := range map[string]PodCertificate{
		"another cluster's workload": {Identity: west, NotBefore: nb, NotAfter: nb.Add(time.Hour)},
		"a cluster, not a workload":  {Identity: eastID, NotBefore: nb, NotAfter: nb.Add(time.Hour)},
		"past the CA's expiry":       {Identity: east, NotBefore: nb, NotAfter: ca.Certificate().NotAfter.Add(time.Second).Truncate(time.Second)},
		"before the CA":              {Identity: east, NotBefore: ca.Certificate().NotBefore.Add(-time.Hour), NotAfter: nb.Add(time.Hour)},
		"not in whole seconds":       {Identity: east, NotBefore: nb.Add(time.Millisecond), NotAfter: nb.Add(time.Hour)},
		"ends before it starts":      {Identity: east, NotBefore: nb, NotAfter: nb},
	} {
		p.PublicKey = key.Public()
		_, _, err := ca.SignPodCertificate(eastID, p)
		require.Error(t, err, name)
	}
}

// FuzzParseWorkloadIdentity: whatever it accepts is exactly what
// WorkloadIdentity makes of its parts, so one workload has one spelling.
func FuzzParseWorkloadIdentity(f *testing.F) {
	f.Add(eastID + "/ns/argo/sa/runner")
	f.Add(eastID + "/ns/argo/sa/run.ner")
	f.Add(eastID + "/ns//sa/runner")
	f.Add("spiffe://a/cluster/b/ns/c/sa/d/e")
	f.Fuzz(func(t *testing.T, id string) {
		c, ns, sa, err := ParseWorkloadIdentity(id)
		if err != nil {
			return
		}
		again, err := WorkloadIdentity(c, ns, sa)
		if err != nil || again != id {
			t.Fatalf("%q parsed as %q %q %q, which make %q (%v)", id, c, ns, sa, again, err)
		}
	})
}
