package agent

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"

	"github.com/tokenbroker/tokenbroker/agent/client"
	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

const workloadSigner = "tokenbroker.io/workloads"

// certPod is a Pod with uid n in namespace argo whose projected volume
// asks signerName for a pod certificate (as a Pod that runs tokenbroker
// credential --identity-dir has).
func certPod(n int, signerName string) *corev1.Pod {
	p := pod(n, "")
	p.Spec.Volumes = []corev1.Volume{{Name: "identity", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
		Sources: []corev1.VolumeProjection{
			{PodCertificate: &corev1.PodCertificateProjection{SignerName: signerName, KeyType: "ECDSAP256", CertificateChainPath: "tls.crt", KeyPath: "tls.key"}},
			{ConfigMap: &corev1.ConfigMapProjection{LocalObjectReference: corev1.LocalObjectReference{Name: "broker-ca"}}},
		},
	}}}}
	return p
}

func TestAPodIsWantedForATokenOfTheAudiencesOrACertificateOfTheAgentsSigner(t *testing.T) {
	t.Parallel()
	elsewhere := certPod(7, workloadSigner)
	elsewhere.Namespace = "tenant-a"
	for _, tc := range []struct {
		name       string
		pod        *corev1.Pod
		signerName string
		audiences  []string
		namespaces []string
		want       bool
	}{
		{name: "a pod certificate of the agent's signer", pod: certPod(1, workloadSigner), signerName: workloadSigner, audiences: []string{"tokenbroker.east"}, want: true},
		{name: "also with no audiences (brokers that trust pod certificates alone)", pod: certPod(1, workloadSigner), signerName: workloadSigner, want: true},
		{name: "not one of another signer", pod: certPod(2, "example.com/other"), signerName: workloadSigner, audiences: []string{"tokenbroker.east"}},
		{name: "not one of a kubernetes.io signer", pod: certPod(2, "kubernetes.io/kube-apiserver-client-pod"), signerName: workloadSigner},
		{name: "not a pod certificate without podSigner", pod: certPod(3, workloadSigner), audiences: []string{"tokenbroker.east"}},
		{name: "a token of the audiences, as before", pod: pod(4, "tokenbroker.east"), signerName: workloadSigner, audiences: []string{"tokenbroker.east"}, want: true},
		{name: "no token without audiences", pod: pod(4, "tokenbroker.east"), signerName: workloadSigner},
		{name: "a Pod with neither", pod: pod(5, ""), signerName: workloadSigner, audiences: []string{"tokenbroker.east"}},
		{name: "a pod certificate outside the namespaces", pod: elsewhere, signerName: workloadSigner, namespaces: []string{"argo"}},
		{name: "a pod certificate in the namespaces", pod: certPod(8, workloadSigner), signerName: workloadSigner, namespaces: []string{"argo"}, want: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := &podReporter{audiences: tc.audiences, signerName: tc.signerName, namespaces: tc.namespaces}
			require.Equal(t, tc.want, r.wanted(tc.pod))
		})
	}
}

// TestThePodsOfTheAgentsPodCertificatesAreReported: with podSigner, a Pod
// whose podCertificate volume names its signer is reported beside those
// with a token, so that a broker that checks live Pods honours its
// certificate only while it lives.
func TestThePodsOfTheAgentsPodCertificatesAreReported(t *testing.T) {
	t.Parallel()
	r := startReporterFor(t, workloadSigner, nil, certPod(1, workloadSigner), pod(2, "tokenbroker.east"), certPod(3, "example.com/other"), pod(4, ""))
	r.lastIs(t, "the pod certificate's Pod and the token's", podUID(1), podUID(2))
	require.NoError(t, r.client.CoreV1().Pods("argo").Delete(context.Background(), "p1", metav1.DeleteOptions{}))
	r.lastIs(t, "a deleted Pod is left out within a second", podUID(2))
}

func TestLivePodsForPodCertificatesAloneAreConfigured(t *testing.T) {
	t.Parallel()
	cfg, err := config.Parse([]byte(`
identity: {dir: /id}
podSigner: {signerName: tokenbroker.io/workloads}
jwksUpload: {brokers: ["https://east:8443"], keys: false, livePods: {namespaces: [argo]}}
`), "")
	require.NoError(t, err, "no audiences with podSigner, and no key set")
	require.False(t, cfg.JWKSUpload.UploadsKeys())
	require.Empty(t, cfg.JWKSUpload.LivePods.Audiences)

	_, err = config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], keys: false}
`), "")
	require.ErrorContains(t, err, "jwksUpload.keys", "nothing to send")
	_, err = config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], livePods: {}}
`), "")
	require.ErrorContains(t, err, "jwksUpload.livePods.audiences", "without podSigner the audiences are required")

	cfg, err = config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], keys: true, livePods: {audiences: [tokenbroker.east]}}
`), "")
	require.NoError(t, err)
	require.True(t, cfg.JWKSUpload.UploadsKeys())
	require.True(t, (&config.JWKSUploadConfig{}).UploadsKeys(), "the default")
}

// TestTheAgentReportsThePodsOfItsSignerAndUploadsKeysOnlyIfAsked: the
// composition root gives the reporter podSigner's signer name, and with
// keys: false runs no uploader.
func TestTheAgentReportsThePodsOfItsSignerAndUploadsKeysOnlyIfAsked(t *testing.T) {
	t.Parallel()
	for _, keys := range []*bool{nil, ptr.To(true), ptr.To(false)} {
		cfg := config.Config{
			Identity:  config.IdentityConfig{Dir: t.TempDir()},
			PodSigner: &config.PodSignerConfig{SignerName: workloadSigner},
			JWKSUpload: &config.JWKSUploadConfig{Brokers: []string{"https://east.example.com:8443"}, Keys: keys,
				LivePods: &config.LivePodsConfig{}},
		}
		a, err := New(cfg, Deps{Kubernetes: fake.NewClientset(), Clock: newFakeClock(t0)})
		require.NoError(t, err)
		require.NotNil(t, a.pods)
		require.Equal(t, workloadSigner, a.pods.signerName)
		require.Empty(t, a.pods.audiences)
		require.Equal(t, keys == nil || *keys, a.jwks != nil, "keys %v", keys)
		require.Contains(t, a.pods.brokers, "https://east.example.com:8443")
	}
}

// forbiddingJWKSBroker answers every key set 403, as a broker whose policy
// has no jwksFromPeer does.
type forbiddingJWKSBroker struct{}

func (forbiddingJWKSBroker) PutJWKS(context.Context, []byte) (*apiv1.PeerJWKS, error) {
	return nil, &client.ProblemError{Status: http.StatusForbidden, Problem: apiv1.Problem{Title: "Forbidden", Status: http.StatusForbidden}}
}

// TestAKeySetTheBrokerRefusesSaysHowToStopSendingIt: a broker that trusts
// pod certificates alone answers a key set 403; the uploader says so and
// how to stop (keys: false), and retries at the next read as for any
// failure. The live Pods are reported apart and never wait for it.
func TestAKeySetTheBrokerRefusesSaysHowToStopSendingIt(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zap.WarnLevel)
	u := &jwksUploader{source: &fakeJWKSSource{doc: newJWKSDoc(t)}, brokers: map[string]jwksAPI{"https://east": forbiddingJWKSBroker{}},
		interval: time.Minute, resync: time.Hour, clock: newFakeClock(t0), log: zap.New(core), uploaded: map[string]uploadState{}}
	u.syncOnce(context.Background())
	require.Empty(t, u.uploaded)
	require.Equal(t, 1, logs.FilterMessageSnippet("jwksUpload.keys: false").Len())
}

// TestTrimmingAPodTwiceKeepsItsMark: client-go passes objects of the
// informer's cache to the transform again (a relist against a real API
// server does), so trim must be idempotent, else a reported Pod loses its
// mark and the report leaves it out.
func TestTrimmingAPodTwiceKeepsItsMark(t *testing.T) {
	t.Parallel()
	r := &podReporter{audiences: []string{"tokenbroker.east"}, signerName: workloadSigner}
	for _, p := range []*corev1.Pod{pod(1, "tokenbroker.east"), certPod(2, workloadSigner), pod(3, "")} {
		once, err := r.trim(p)
		require.NoError(t, err)
		twice, err := r.trim(once)
		require.NoError(t, err)
		require.Equal(t, once, twice, p.Name)
		require.Equal(t, r.wanted(p), twice.(*corev1.Pod).Labels[reportedLabel] == "true", p.Name)
	}
}
