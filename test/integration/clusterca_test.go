package integration

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestAClusterGetsItsCAAtEnrollmentAndSignsPodCertificatesUnderIt runs
// the chain fleet CA → cluster CA → pod certificate through a broker
// against a real API server: a cluster enrolls with a join token and a
// second CSR for its CA, signs a pod certificate with that CA, and a
// relying party verifies it with the broker's trust bundle alone; renewal
// gives a new cluster CA. A broker not told to sign cluster CAs refuses
// the whole request, without using up the join token.
func TestAClusterGetsItsCAAtEnrollmentAndSignsPodCertificatesUnderIt(t *testing.T) {
	t.Parallel()
	c := testcluster.Start(t)
	// The fleet CA must allow a CA below it (pki init --cluster-cas).
	fleet, err := pki.NewCA(pki.CAOptions{CommonName: "integration fleet CA", PathLen: 1})
	require.NoError(t, err)
	signs := startStack(t, c, grants, withCA(fleet), withSignClusterCAs())
	refuses := startStack(t, c, grants, withCA(fleet))
	roots := fleet.CertPool()
	west := identity(t, "west")

	// Enrollment: a join token, the client certificate's CSR and the
	// cluster CA's.
	csr, key, err := pki.NewCSR(west, nil)
	require.NoError(t, err)
	caCSR, caKey, err := pki.NewCSR(west, nil)
	require.NoError(t, err)
	anon := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: pki.ClientTLSConfig(roots, nil)}}
	t.Cleanup(anon.CloseIdleConnections)
	req := apiv1.CertificateRequest{CSR: string(csr), ClusterCACSR: string(caCSR)}

	t.Run("A broker without --sign-cluster-cas refuses the whole request and leaves the token unused.", func(t *testing.T) {
		tok := joinToken(t, fleet, west)
		status, body, err := tryDo(anon, http.MethodPost, refuses.enrollURL+"/v1/certificates", tok, req, nil)
		require.NoError(t, err)
		require.Equal(t, http.StatusUnprocessableEntity, status, string(body))
		var p apiv1.Problem
		require.NoError(t, json.Unmarshal(body, &p))
		require.Equal(t, "this broker does not sign cluster CAs", p.Detail)
		require.Len(t, p.Errors, 1)
		require.Equal(t, "clusterCACSR", p.Errors[0].Field)
		require.Contains(t, p.Errors[0].Detail, "--sign-cluster-cas")

		var resp apiv1.CertificateResponse
		status, body, err = tryDo(anon, http.MethodPost, refuses.enrollURL+"/v1/certificates", tok, apiv1.CertificateRequest{CSR: string(csr)}, &resp)
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, status, "the same token enrolls without a clusterCACSR: %s", body)
		require.Empty(t, resp.ClusterCA)
	})

	var enrolled apiv1.CertificateResponse
	status, body, err := tryDo(anon, http.MethodPost, signs.enrollURL+"/v1/certificates", joinToken(t, fleet, west), req, &enrolled)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, status, string(body))
	require.Equal(t, west, enrolled.Identity)
	require.NotNil(t, enrolled.ClusterCANotAfter)
	require.WithinDuration(t, enrolled.NotAfter, *enrolled.ClusterCANotAfter, time.Second, "the client certificate's lifetime")

	// The relying party knows the broker's trust bundle, nothing else.
	var tb apiv1.TrustBundle
	status, body, err = tryDo(anon, http.MethodGet, signs.enrollURL+"/v1/trust-bundle", "", nil, &tb)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status, string(body))
	bundle, err := pki.ParseCertificatesPEM([]byte(tb.CABundle))
	require.NoError(t, err)
	trust := x509.NewCertPool()
	for _, b := range bundle {
		trust.AddCert(b)
	}

	// The cluster signs a pod certificate with its CA.
	podCert := func(t *testing.T, clusterCAPEM string, caKey []byte, namespace, sa string) (*x509.Certificate, *x509.CertPool) {
		t.Helper()
		clusterCA, err := pki.ParseCA([]byte(clusterCAPEM), caKey, pki.CAOptions{})
		require.NoError(t, err)
		got, err := pki.ClusterCAIdentity(clusterCA.Certificate())
		require.NoError(t, err)
		require.Equal(t, west, got)
		podKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		workload, err := pki.WorkloadIdentity(west, namespace, sa)
		require.NoError(t, err)
		nb := time.Now().Add(-2 * time.Minute).Truncate(time.Second)
		leaf, chainPEM, err := clusterCA.SignPodCertificate(west, pki.PodCertificate{Identity: workload, PublicKey: podKey.Public(), NotBefore: nb, NotAfter: nb.Add(time.Hour)})
		require.NoError(t, err)
		chain, err := pki.ParseCertificatesPEM(chainPEM)
		require.NoError(t, err)
		inter := x509.NewCertPool()
		for _, c := range chain[1:] {
			inter.AddCert(c)
		}
		return leaf, inter
	}
	leaf, inter := podCert(t, enrolled.ClusterCA, caKey, "argo", "runner")
	chains, err := leaf.Verify(x509.VerifyOptions{Roots: trust, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	require.Len(t, chains[0], 3, "pod certificate, cluster CA, fleet CA")
	require.Equal(t, fleet.Certificate().Raw, chains[0][2].Raw)

	// Renewal with the enrolled certificate gives a new cluster CA, of the
	// signing CA in force.
	client := signs.clientWith(t, []byte(enrolled.Certificate), key, roots)
	csr2, _, err := pki.NewCSR(west, nil)
	require.NoError(t, err)
	caCSR2, caKey2, err := pki.NewCSR(west, nil)
	require.NoError(t, err)
	var renewed apiv1.CertificateResponse
	status, body = do(t, client, http.MethodPost, signs.url+"/v1/certificates", apiv1.CertificateRequest{CSR: string(csr2), ClusterCACSR: string(caCSR2)}, &renewed)
	require.Equal(t, http.StatusCreated, status, string(body))
	require.NotEqual(t, enrolled.ClusterCA, renewed.ClusterCA)
	leaf, inter = podCert(t, renewed.ClusterCA, caKey2, "argo", "runner")
	_, err = leaf.Verify(x509.VerifyOptions{Roots: trust, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)

	// A cluster CA's CSR for another cluster is refused, whole.
	north, _, err := pki.NewCSR(identity(t, "north"), nil)
	require.NoError(t, err)
	status, _ = do(t, client, http.MethodPost, signs.url+"/v1/certificates", apiv1.CertificateRequest{CSR: string(csr2), ClusterCACSR: string(north)}, nil)
	require.Equal(t, http.StatusForbidden, status)

	// Both signings are on the audit record with the cluster CA's serial.
	audit, err := os.ReadFile(signs.auditLog)
	require.NoError(t, err)
	require.Equal(t, 2, strings.Count(string(audit), `"cluster_ca_serial"`), string(audit))

	t.Run("A broker told to sign cluster CAs with a CA that cannot does not start.", func(t *testing.T) {
		leafOnly, err := pki.NewCA(pki.CAOptions{CommonName: "leaf-only CA"})
		require.NoError(t, err)
		dir := t.TempDir()
		caCert, caKey := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
		require.NoError(t, leafOnly.WriteFiles(caCert, caKey))
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		err = server.Run(ctx, server.Options{
			ListenAddress: "127.0.0.1:0", OpsAddress: "127.0.0.1:0",
			TLSCertFile: signs.serverCert, TLSKeyFile: signs.serverKey, ClientCAFile: signs.clientCAFile,
			CACertFile: caCert, CAKeyFile: caKey, SignClusterCAs: true,
			ClientCertTTL: pki.DefaultClientLifetime, PolicyFile: signs.policyFile, Namespace: brokerNamespace,
			Kube: c.Config, KubeQPS: 100, KubeBurst: 100, GCInterval: time.Minute, MaxBodyBytes: server.DefaultMaxBodyBytes,
			Credentials: []string{apiv1.CredentialToken}, AuditLog: filepath.Join(dir, "audit.jsonl"),
		})
		require.ErrorIs(t, err, pki.ErrCannotSignCAs)
		require.ErrorContains(t, err, "--sign-cluster-cas")
		require.ErrorContains(t, err, "pki init --cluster-cas")
	})
}
