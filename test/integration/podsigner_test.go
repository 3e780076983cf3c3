package integration

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tokenbroker/tokenbroker/agent/podsigner"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestThePodSignersAnswersMeetTheAPIServersRules runs the pod signer
// against a real kube-apiserver, which validates every answer it writes
// (the chain's key is the request's, its times equal the status's, the
// refresh time within bounds, one final condition): a Pod of a labelled
// ServiceAccount gets a certificate naming that ServiceAccount under the
// cluster, chaining to the fleet's root; a Pod of an unlabelled one and a
// request that names a Pod not as it runs are denied.
func TestThePodSignersAnswersMeetTheAPIServersRules(t *testing.T) {
	c := testcluster.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// make test-compat: 1.35 serves only the beta, off by default.
	requireServedFrom(t, c, 37, "certificates.k8s.io/v1", "podcertificaterequests")

	const ns, signerName, cluster = "podcerts", "tokenbroker.io/workload", "spiffe://oc.example/cluster/east"
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	require.NoError(t, err)
	sas := map[string]*corev1.ServiceAccount{}
	pods := map[string]*corev1.Pod{}
	for _, name := range []string{"runner", "plain"} {
		sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if name == "runner" {
			sa.Labels = map[string]string{podsigner.LabelPodCertificates: "true"}
		}
		sas[name], err = c.Client.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{})
		require.NoError(t, err)
		// Bound to a node no kubelet runs: the Pod stays pending, which
		// is all a request needs of it.
		pods[name], err = c.Client.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name + "-0"},
			Spec: corev1.PodSpec{ServiceAccountName: name, NodeName: "node-a",
				Containers: []corev1.Container{{Name: "c", Image: "registry.invalid/none",
					VolumeMounts: []corev1.VolumeMount{{Name: "identity", MountPath: "/var/run/identity"}}}},
				Volumes: []corev1.Volume{{Name: "identity", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
					Sources: []corev1.VolumeProjection{{PodCertificate: &corev1.PodCertificateProjection{
						SignerName: signerName, KeyType: "ECDSAP256", CredentialBundlePath: "credentials.pem",
					}}},
				}}}}},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
	}

	root, err := pki.NewCA(pki.CAOptions{PathLen: 1})
	require.NoError(t, err)
	ca, err := root.NewIntermediate(pki.CAOptions{CommonName: "east pod signer"})
	require.NoError(t, err)
	s, err := podsigner.New(podsigner.Config{Client: c.Client, SignerName: signerName, CA: func() *pki.CA { return ca }, ClusterIdentity: cluster, Logger: zaptest.NewLogger(t)})
	require.NoError(t, err)
	go s.Run(ctx)

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	stub, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	require.NoError(t, err)
	ask := func(name, sa string, podUID string) string {
		t.Helper()
		hour := int32(3600)
		pcr, err := c.Client.CertificatesV1().PodCertificateRequests(ns).Create(ctx, &certificatesv1.PodCertificateRequest{
			ObjectMeta: metav1.ObjectMeta{GenerateName: name + "-"},
			Spec: certificatesv1.PodCertificateRequestSpec{
				SignerName: signerName, PodName: pods[sa].Name, PodUID: podUIDOr(podUID, pods[sa]), ServiceAccountName: sa,
				ServiceAccountUID: sas[sa].UID, NodeName: "node-a", NodeUID: "8d5c3a36-1d6c-4b0e-9e3f-2f6f1b7a9c01",
				MaxExpirationSeconds: &hour, StubPKCS10Request: stub,
			},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		return pcr.Name
	}
	answer := func(name string) *certificatesv1.PodCertificateRequest {
		t.Helper()
		var got *certificatesv1.PodCertificateRequest
		require.Eventually(t, func() bool {
			got, err = c.Client.CertificatesV1().PodCertificateRequests(ns).Get(ctx, name, metav1.GetOptions{})
			return err == nil && len(got.Status.Conditions) > 0
		}, 30*time.Second, 50*time.Millisecond, "request %s answered", name)
		require.Len(t, got.Status.Conditions, 1)
		return got
	}

	issued := answer(ask("runner", "runner", ""))
	require.Equal(t, certificatesv1.PodCertificateRequestConditionTypeIssued, issued.Status.Conditions[0].Type, "%+v", issued.Status.Conditions[0])
	chain, err := pki.ParseCertificatesPEM([]byte(issued.Status.CertificateChain))
	require.NoError(t, err)
	require.Equal(t, cluster+"/ns/"+ns+"/sa/runner", chain[0].URIs[0].String())
	require.True(t, chain[0].PublicKey.(*ecdsa.PublicKey).Equal(key.Public()))
	require.Equal(t, time.Hour, issued.Status.NotAfter.Sub(issued.Status.NotBefore.Time), "the hour asked for")
	inter := x509.NewCertPool()
	for _, cert := range chain[1:] {
		inter.AddCert(cert)
	}
	_, err = chain[0].Verify(x509.VerifyOptions{Roots: root.CertPool(), Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)

	denied := answer(ask("plain", "plain", ""))
	require.Equal(t, certificatesv1.PodCertificateRequestConditionTypeDenied, denied.Status.Conditions[0].Type)
	require.Equal(t, podsigner.ReasonNotAllowed, denied.Status.Conditions[0].Reason)
	require.Empty(t, denied.Status.CertificateChain)

	// Whoever else may create requests cannot name a Pod as it does not
	// run: here, a UID of a Pod that no longer exists under that name.
	lying := answer(ask("lying", "runner", "0b7f7a52-0000-4000-8000-000000000000"))
	require.Equal(t, certificatesv1.PodCertificateRequestConditionTypeDenied, lying.Status.Conditions[0].Type)
	require.Equal(t, podsigner.ReasonPodMismatch, lying.Status.Conditions[0].Reason)
}

func podUIDOr(uid string, pod *corev1.Pod) (out types.UID) {
	if uid != "" {
		return types.UID(uid)
	}
	return pod.UID
}
