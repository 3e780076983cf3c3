package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/agent/config"

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

// TestTheAgentsIdentityIsItsPodCertificateAsTheKubeletRotatesIt: with
// identity.podCertificate the agent presents its own Pod's certificate,
// read from the kubelet's volume, to its brokers: no enrollment, no
// renewal, no identity Secret. When the kubelet writes the next
// certificate, the next request presents it.
func TestTheAgentsIdentityIsItsPodCertificateAsTheKubeletRotatesIt(t *testing.T) {
	t.Parallel()
	clock := newFakeClock(time.Now().Truncate(time.Second))
	start := clock.Now()
	root := pkitest.FleetRoot(t, 72*time.Hour)
	p := &testPKI{ca: root, clock: clock, lifetime: 24 * time.Hour}
	b := newHTTPBroker(t, p)
	_, clusterCA := pkitest.ClusterCA(t, root, westID, 24*time.Hour)

	dir := t.TempDir()
	podDir := filepath.Join(dir, "pod")
	require.NoError(t, os.Mkdir(podDir, 0o700))
	writeVolume := func(chain, key []byte) {
		for name, data := range map[string][]byte{CertFile: chain, KeyFile: key, BundleFile: root.BundlePEM()} {
			require.NoError(t, os.WriteFile(filepath.Join(podDir, name), data, 0o600))
		}
	}
	chain, first, key := pkitest.PodCertificate(t, clusterCA, westID, "tokenbroker-agent", "tokenbroker-agent")
	writeVolume(chain, key)
	kubeconfigFile := filepath.Join(dir, "east.kubeconfig")
	cfg, err := config.Parse(fmt.Appendf(nil, `
identity:
  podCertificate: {dir: %[2]q}
targets:
  - name: east
    broker: %[1]q
    request: {namespace: argo, serviceAccount: admiralty-source, ttl: 1h}
    outputs:
      - file: {path: %[3]q}
`, b.srv.URL, podDir, kubeconfigFile), "")
	require.NoError(t, err)
	cs := fake.NewClientset()
	a, err := New(cfg, Deps{Kubernetes: cs, Logger: zaptest.NewLogger(t), Clock: clock, Rand: fixedRand(0)})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	// Idle: the refresher and the reloader wait on their timers.
	idle := func() bool { return clock.Waiters() == 2 }
	require.Eventually(t, func() bool { return a.Ready() == nil && idle() }, 10*time.Second, 5*time.Millisecond)
	_, _, serials := b.snapshot()
	require.Equal(t, []string{first.SerialNumber.Text(16)}, serials, "the first lease is asked with the pod certificate")

	// The kubelet writes the next certificate; the reloader takes it within a minute.
	chain, second, key := pkitest.PodCertificate(t, clusterCA, westID, "tokenbroker-agent", "tokenbroker-agent")
	writeVolume(chain, key)
	clock.SetTime(start.Add(podCertificateReload))
	require.Eventually(t, func() bool { return a.holder.leaf().Equal(second) && idle() }, 10*time.Second, 5*time.Millisecond)
	clock.SetTime(start.Add(40 * time.Minute))
	require.Eventually(t, func() bool { n, _, _ := b.snapshot(); return n == 2 && idle() }, 10*time.Second, 5*time.Millisecond)
	_, _, serials = b.snapshot()
	require.Equal(t, second.SerialNumber.Text(16), serials[1], "the next request presents the kubelet's new certificate")

	// A half-written volume keeps the certificate in service.
	require.NoError(t, os.WriteFile(filepath.Join(podDir, KeyFile), []byte("not a key"), 0o600))
	clock.SetTime(start.Add(41 * time.Minute))
	require.Eventually(t, idle, 10*time.Second, 5*time.Millisecond)
	require.True(t, a.holder.leaf().Equal(second))

	cancel()
	require.NoError(t, <-done)
	require.Zero(t, b.enrolled, "nothing enrolls")
	require.Zero(t, p.renews, "nothing renews")
	secrets, err := cs.CoreV1().Secrets("").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	require.Empty(t, secrets.Items, "no Secret holds the agent's identity")
}

// TestAPodCertificateIdentityRulesOutWhatTheKubeletDoes: the config
// refuses with identity.podCertificate what the kubelet does in its place
// (enrollment, renewal) and a pod signer, which cannot wait for its own
// certificate; the store refuses a cluster's client certificate in the
// volume.
func TestAPodCertificateIdentityRulesOutWhatTheKubeletDoes(t *testing.T) {
	t.Parallel()
	_, err := config.Parse([]byte(`
identity:
  podCertificate: {dir: /pod}
  enroll: {broker: "https://east.example.com:8444", caFingerprint: "sha256:3f1c5e1d2a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a1b0c9d8e7f6a5b4c3d", tokenFile: /join/token}
  renewBroker: https://east.example.com:8443
podSigner: {signerName: tokenbroker.io/workloads}
jwksUpload: {brokers: ["https://east.example.com:8443"], livePods: {audiences: [east]}}
targets: []
`), "")
	require.Error(t, err)
	for _, field := range []string{"identity.enroll", "identity.renewBroker", "podSigner", "jwksUpload"} {
		require.Contains(t, err.Error(), field)
	}
	_, err = config.Parse([]byte("identity: {podCertificate: {dir: /pod}, dir: /id}\ntargets: []\n"), "")
	require.ErrorContains(t, err, "give one of dir, secret and podCertificate")

	clock := newFakeClock(time.Now())
	p := newTestPKI(t, clock)
	id := p.identity(t)
	dir := t.TempDir()
	require.NoError(t, dirStore{dir: IdentityDir(dir)}.save(context.Background(), id))
	_, err = podCertificateStore{dir: IdentityDir(dir)}.load(context.Background())
	require.ErrorContains(t, err, "is not a pod certificate")
}
