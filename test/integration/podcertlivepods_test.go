package integration

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/tokenbroker/tokenbroker/agent"
	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestAPodCertificateIsHonouredOnlyWhileTheAgentReportsItsPod runs the
// live Pods for a peer that trusts pod certificates alone against a real
// broker and API server: the agent, with podSigner and jwksUpload
// {keys: false, livePods}, uploads no key set and reports the Pods whose
// podCertificate volume names its signer; a workload's pod certificate
// (signed by the agent's cluster CA) gets a lease while its Pod is
// reported, and is refused (pod-not-live) once the Pod is deleted.
func TestAPodCertificateIsHonouredOnlyWhileTheAgentReportsItsPod(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testcluster.Start(t)
	// The podCertificate projected volume is served from 1.37 on.
	requireServedFrom(t, c, 37, "certificates.k8s.io/v1", "podcertificaterequests")
	const signerName = "tokenbroker.io/workloads"
	fleet, err := pki.NewCA(pki.CAOptions{CommonName: "integration fleet CA", PathLen: 1})
	require.NoError(t, err)
	west := identity(t, "west")
	s := startStack(t, c, `
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: `+west+`
    workloadIdentity: {podCertificates: true, livePodsFromPeer: true, livePodsMaxAge: 1m}
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
        workloads: [{namespace: argo, serviceAccount: runner}]
`, withCA(fleet), withSignClusterCAs())
	ensureNamespace(t, c, "argo")
	_, err = c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	require.NoError(t, err)

	// The workload's Pod, bound to a node no kubelet runs: it stays
	// Pending, which is all the report needs of it. Beside it a Pod of
	// another signer, which is not reported.
	newPod := func(name, signer string) *corev1.Pod {
		p, err := c.Client.CoreV1().Pods("argo").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PodSpec{ServiceAccountName: "runner", NodeName: "node-a",
				Containers: []corev1.Container{{Name: "c", Image: "registry.invalid/none",
					VolumeMounts: []corev1.VolumeMount{{Name: "identity", MountPath: "/var/run/identity"}}}},
				Volumes: []corev1.Volume{{Name: "identity", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
					Sources: []corev1.VolumeProjection{{PodCertificate: &corev1.PodCertificateProjection{
						SignerName: signer, KeyType: "ECDSAP256", CertificateChainPath: "tls.crt", KeyPath: "tls.key"}}},
				}}}},
			},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		return p
	}
	runner := newPod("runner-0", signerName)
	newPod("other-0", "example.com/other")

	// The agent's identity, with its cluster CA (tokenbroker enroll
	// --cluster-ca); the workload's pod certificate as the agent's signer
	// would make it for runner-0, issued minutes ago (as early as the CA
	// allows: before any report).
	dir := agent.IdentityDir(filepath.Join(t.TempDir(), "identity"))
	_, err = agent.Enroll(ctx, agent.EnrollOptions{
		BrokerURL: s.enrollURL, Fingerprint: pki.Fingerprint(fleet.Certificate()),
		Token: joinToken(t, fleet, west), Dir: dir, ClusterCA: true,
	})
	require.NoError(t, err)
	caCert, err := os.ReadFile(dir.ClusterCACert())
	require.NoError(t, err)
	caKey, err := os.ReadFile(dir.ClusterCAKey())
	require.NoError(t, err)
	clusterCA, err := pki.ParseCA(caCert, caKey, pki.CAOptions{})
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	workloadID, err := pki.WorkloadIdentity(west, "argo", "runner")
	require.NoError(t, err)
	nb := clusterCA.Certificate().NotBefore
	_, chainPEM, err := clusterCA.SignPodCertificate(west, pki.PodCertificate{Identity: workloadID, PublicKey: crypto.PublicKey(key.Public()),
		NotBefore: nb, NotAfter: nb.Add(time.Hour), PodName: runner.Name, PodUID: string(runner.UID)})
	require.NoError(t, err)
	der, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	pod := s.clientWith(t, chainPEM, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), fleet.CertPool())
	t.Cleanup(pod.CloseIdleConnections)

	lease := func() (int, apiv1.Problem) {
		status, body, err := tryDo(pod, http.MethodPost, s.url+"/v1/kubeconfigs", "",
			apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "10m"}, nil)
		require.NoError(t, err)
		var p apiv1.Problem
		if status >= 300 {
			require.NoError(t, json.Unmarshal(body, &p), string(body))
		}
		return status, p
	}
	status, p := lease()
	require.Equal(t, http.StatusUnauthorized, status, "no report yet")
	require.Equal(t, workload.TokenPodsUnreported, p.Reason)

	// The agent: podSigner and the live Pods, no key set, no target.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	a, err := agent.New(config.Config{
		Identity:  config.IdentityConfig{Dir: string(dir), RenewBroker: s.url},
		PodSigner: &config.PodSignerConfig{SignerName: signerName},
		JWKSUpload: &config.JWKSUploadConfig{Brokers: []string{s.url}, Keys: ptr.To(false),
			LivePods: &config.LivePodsConfig{Namespaces: []string{"argo"}, Interval: apiv1.Duration(5 * time.Second)}},
	}, agent.Deps{Kubernetes: c.Client, Registry: prometheus.NewRegistry(), OpsListener: ln, Logger: zaptest.NewLogger(t)})
	require.NoError(t, err)
	actx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(actx) }()
	t.Cleanup(func() { cancel(); require.NoError(t, <-done) })

	var last apiv1.Problem
	require.Eventually(t, func() bool {
		status, p := lease()
		last = p
		return status == http.StatusCreated
	}, 30*time.Second, 200*time.Millisecond, "a lease once the agent reports runner-0: %+v", &last)

	// The peer's Secret holds the report and no key set.
	list, err := c.Client.CoreV1().Secrets(brokerNamespace).List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	var found bool
	for _, sec := range list.Items {
		if sec.Name != workload.PeerKeysSecretName("west") {
			continue
		}
		found = true
		require.NotContains(t, sec.Data, workload.PeerKeysCurrentKey, "no key set was uploaded")
		var uids []string
		require.NoError(t, json.Unmarshal(sec.Data[workload.PeerLivePodsKey], &uids))
		require.Equal(t, []string{string(runner.UID)}, uids, "runner-0 only: other-0 asks another signer")
	}
	require.True(t, found, "the peer's Secret")

	// The Pod is deleted: its certificate is refused within the agent's
	// next report (within a second of the change).
	require.NoError(t, c.Client.CoreV1().Pods("argo").Delete(ctx, runner.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}))
	deleted := time.Now()
	require.Eventually(t, func() bool {
		status, p := lease()
		return status == http.StatusUnauthorized && p.Reason == workload.TokenPodNotLive
	}, 30*time.Second, 100*time.Millisecond, "refused once the report leaves runner-0 out")
	t.Logf("pod certificate refused %s after its Pod was deleted", time.Since(deleted).Round(time.Millisecond))
}
