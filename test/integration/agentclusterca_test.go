package integration

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tokenbroker/tokenbroker/agent"
	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestTheAgentsIdentityCarriesItsClusterCAThroughEnrollmentAndRenewal
// runs the agent's side of the cluster CA against a real broker and API
// server: "tokenbroker enroll" with the cluster CA stores it beside the
// certificate, a pod certificate it signs verifies with the broker's
// trust bundle alone, "tokenbroker renew" replaces it with a new CA of a
// new key, and the running agent, whose identity Secret holds one, renews
// it there with the rest of the identity.
func TestTheAgentsIdentityCarriesItsClusterCAThroughEnrollmentAndRenewal(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testcluster.Start(t)
	fleet, err := pki.NewCA(pki.CAOptions{CommonName: "integration fleet CA", PathLen: 1})
	require.NoError(t, err)
	west := identity(t, "west")
	// The shortest certificate lifetime the policy allows, so that the
	// agent renews within seconds (renewAt below).
	s := startStack(t, c, `
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: `+west+`
    certificateTTL: 10m
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
`, withCA(fleet), withSignClusterCAs())

	// The relying party knows the broker's trust bundle, nothing else.
	anon := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: pki.ClientTLSConfig(fleet.CertPool(), nil)}}
	t.Cleanup(anon.CloseIdleConnections)
	var tb apiv1.TrustBundle
	status, body, err := tryDo(anon, http.MethodGet, s.enrollURL+"/v1/trust-bundle", "", nil, &tb)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status, string(body))
	trust, err := pki.ParseCertificatesPEM([]byte(tb.CABundle))
	require.NoError(t, err)
	roots := x509.NewCertPool()
	for _, r := range trust {
		roots.AddCert(r)
	}
	clusterCA := func(t *testing.T, certPEM, keyPEM []byte) *pki.CA {
		t.Helper()
		ca, err := pki.ParseCA(certPEM, keyPEM, pki.CAOptions{})
		require.NoError(t, err)
		got, err := pki.ClusterCAIdentity(ca.Certificate())
		require.NoError(t, err)
		require.Equal(t, west, got)
		return ca
	}
	verifiesToTheBundle := func(t *testing.T, ca *pki.CA) {
		t.Helper()
		podKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		workload, err := pki.WorkloadIdentity(west, "argo", "runner")
		require.NoError(t, err)
		nb := time.Now().Add(-2 * time.Minute).Truncate(time.Second)
		leaf, chainPEM, err := ca.SignPodCertificate(west, pki.PodCertificate{
			Identity: workload, PublicKey: podKey.Public(), NotBefore: nb, NotAfter: nb.Add(5 * time.Minute),
			PodName: "runner-0", PodUID: "6a1c0f4e-8f0b-4a59-9d55-0b0a3f3e2c11",
		})
		require.NoError(t, err)
		chain, err := pki.ParseCertificatesPEM(chainPEM)
		require.NoError(t, err)
		inter := x509.NewCertPool()
		for _, c := range chain[1:] {
			inter.AddCert(c)
		}
		chains, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
		require.NoError(t, err)
		require.Len(t, chains[0], 3, "pod certificate, cluster CA, fleet CA")
		got, err := pki.WorkloadFromChain(chains)
		require.NoError(t, err)
		require.Equal(t, workload, got.Identity)
		require.Equal(t, "6a1c0f4e-8f0b-4a59-9d55-0b0a3f3e2c11", got.PodUID)
	}
	read := func(t *testing.T, path string) []byte {
		t.Helper()
		data, err := os.ReadFile(path)
		require.NoError(t, err)
		return data
	}

	// tokenbroker enroll, with the cluster CA.
	dir := agent.IdentityDir(filepath.Join(t.TempDir(), "identity"))
	enrolled, err := agent.Enroll(ctx, agent.EnrollOptions{
		BrokerURL: s.enrollURL, Fingerprint: pki.Fingerprint(fleet.Certificate()),
		Token: joinToken(t, fleet, west), Dir: dir, ClusterCA: true,
	})
	require.NoError(t, err)
	require.Equal(t, enrolled.ClusterCA, string(read(t, dir.ClusterCACert())))
	st, err := os.Stat(dir.ClusterCAKey())
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	first := clusterCA(t, read(t, dir.ClusterCACert()), read(t, dir.ClusterCAKey()))
	verifiesToTheBundle(t, first)

	// tokenbroker renew: an identity with a cluster CA gets a new one.
	cl, err := agent.NewIdentityClient(ctx, s.url, dir)
	require.NoError(t, err)
	renewed, err := agent.Renew(ctx, cl, dir)
	cl.CloseIdleConnections()
	require.NoError(t, err)
	require.NotEmpty(t, renewed.ClusterCA)
	second := clusterCA(t, read(t, dir.ClusterCACert()), read(t, dir.ClusterCAKey()))
	require.NotEqual(t, first.Certificate().SerialNumber, second.Certificate().SerialNumber)
	require.NotEqual(t, first.Certificate().RawSubjectPublicKeyInfo, second.Certificate().RawSubjectPublicKeyInfo, "a new key")
	verifiesToTheBundle(t, second)

	// The agent, with this identity in its Secret, renews the cluster CA
	// there with the certificate: it signs pod certificates (podSigner),
	// without which it would drop the CA.
	const ns, name = "tokenbroker-agent", "agent-identity"
	ensureNamespace(t, c, ns)
	data := map[string][]byte{}
	for _, k := range []string{agent.CertFile, agent.KeyFile, agent.BundleFile, agent.ClusterCACertFile, agent.ClusterCAKeyFile} {
		data[k] = read(t, filepath.Join(string(dir), k))
	}
	_, err = c.Client.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Type: corev1.SecretTypeOpaque, Data: data,
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	out := t.TempDir()
	cfg := config.Config{
		Identity: config.IdentityConfig{Secret: &config.ObjectRef{Namespace: ns, Name: name}, RenewBroker: s.url, RenewAt: 0.01},
		Targets: []config.TargetConfig{{Name: "east", Broker: s.url,
			Request: config.RequestConfig{Namespace: "argo", ServiceAccount: "runner", TTL: "1h"},
			Outputs: []config.OutputConfig{{File: &config.FileOutput{Path: filepath.Join(out, "east")}}}}},
		Refresh:   config.RefreshConfig{MinBackoff: apiv1.Duration(200 * time.Millisecond), MaxBackoff: apiv1.Duration(time.Second)},
		PodSigner: &config.PodSignerConfig{SignerName: "tokenbroker.io/workloads"},
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	a, err := agent.New(cfg, agent.Deps{Kubernetes: c.Client, Registry: prometheus.NewRegistry(), OpsListener: ln, Logger: zap.NewNop()})
	require.NoError(t, err)
	actx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(actx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	var sec *corev1.Secret
	require.Eventually(t, func() bool {
		sec, err = c.Client.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
		require.NoError(t, err)
		return string(sec.Data[agent.ClusterCACertFile]) != string(data[agent.ClusterCACertFile])
	}, time.Minute, 200*time.Millisecond, "the agent renews its identity, cluster CA included, in its Secret")
	third := clusterCA(t, sec.Data[agent.ClusterCACertFile], sec.Data[agent.ClusterCAKeyFile])
	require.NotEqual(t, second.Certificate().RawSubjectPublicKeyInfo, third.Certificate().RawSubjectPublicKeyInfo, "a new key")
	require.NotEqual(t, string(data[agent.CertFile]), string(sec.Data[agent.CertFile]), "with the certificate")
	verifiesToTheBundle(t, third)
}
