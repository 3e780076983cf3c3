package podsigner

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/pki"
)

const (
	signerName = "tokenbroker.io/workload"
	clusterID  = "spiffe://oc.example/cluster/east"
	testPodUID = "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54"
)

var t0 = time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)

// certVolume is a Pod's projected volume asking signer for its
// certificate, as the kubelet reads it.
func certVolume(signer string) corev1.Volume {
	return corev1.Volume{Name: "identity", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
		Sources: []corev1.VolumeProjection{{PodCertificate: &corev1.PodCertificateProjection{
			SignerName: signer, KeyType: "ECDSAP256", CredentialBundlePath: "credentials.pem",
		}}},
	}}}
}

// fixture is a cluster with the Pod argo/runner-0 of the labelled
// ServiceAccount argo/runner on node-a, and a signer for it whose CA is
// an intermediate of a fleet root.
type fixture struct {
	client *fake.Clientset
	signer *Signer
	root   *pki.CA
	key    *ecdsa.PrivateKey
}

func newFixture(t *testing.T, mutate ...func(*corev1.ServiceAccount, *corev1.Pod)) *fixture {
	t.Helper()
	now := func() time.Time { return t0 }
	root, err := pki.NewCA(pki.CAOptions{PathLen: 1, Now: now})
	require.NoError(t, err)
	ca, err := root.NewIntermediate(pki.CAOptions{CommonName: "east", Lifetime: 30 * 24 * time.Hour})
	require.NoError(t, err)
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: "runner", UID: "sa-uid",
		Labels: map[string]string{LabelPodCertificates: "true"}}}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: "runner-0", UID: testPodUID},
		Spec: corev1.PodSpec{ServiceAccountName: "runner", NodeName: "node-a", Volumes: []corev1.Volume{certVolume(signerName)}}}
	for _, m := range mutate {
		m(sa, pod)
	}
	client := fake.NewClientset(sa, pod)
	s, err := New(Config{Client: client, SignerName: signerName, CA: func() *pki.CA { return ca }, ClusterIdentity: clusterID, Clock: clocktesting.NewFakePassiveClock(t0.Add(123 * time.Millisecond))})
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	return &fixture{client: client, signer: s, root: root, key: key}
}

// request is the kubelet's request for argo/runner-0, created.
func (f *fixture) request(t *testing.T, mutate ...func(*certificatesv1.PodCertificateRequest)) *certificatesv1.PodCertificateRequest {
	t.Helper()
	stub, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, f.key)
	require.NoError(t, err)
	pcr := &certificatesv1.PodCertificateRequest{
		ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: "req-1"},
		Spec: certificatesv1.PodCertificateRequestSpec{
			SignerName: signerName, PodName: "runner-0", PodUID: testPodUID, ServiceAccountName: "runner", ServiceAccountUID: "sa-uid",
			NodeName: "node-a", NodeUID: "node-uid", StubPKCS10Request: stub,
		},
	}
	for _, m := range mutate {
		m(pcr)
	}
	_, err = f.client.CertificatesV1().PodCertificateRequests("argo").Create(context.Background(), pcr, metav1.CreateOptions{})
	require.NoError(t, err)
	return pcr
}

// answer answers pcr and returns the status written.
func (f *fixture) answer(t *testing.T, pcr *certificatesv1.PodCertificateRequest) certificatesv1.PodCertificateRequestStatus {
	t.Helper()
	require.NoError(t, f.signer.Answer(context.Background(), pcr))
	got, err := f.client.CertificatesV1().PodCertificateRequests("argo").Get(context.Background(), pcr.Name, metav1.GetOptions{})
	require.NoError(t, err)
	return got.Status
}

func TestAnAllowedPodGetsACertificateNamingItsServiceAccountOnly(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	st := f.answer(t, f.request(t))

	require.Len(t, st.Conditions, 1)
	require.Equal(t, certificatesv1.PodCertificateRequestConditionTypeIssued, st.Conditions[0].Type)
	require.Equal(t, metav1.ConditionTrue, st.Conditions[0].Status)
	chain, err := pki.ParseCertificatesPEM([]byte(st.CertificateChain))
	require.NoError(t, err)
	require.Len(t, chain, 2)
	leaf := chain[0]
	require.Len(t, leaf.URIs, 1)
	require.Equal(t, clusterID+"/ns/argo/sa/runner", leaf.URIs[0].String())
	require.Empty(t, leaf.DNSNames)
	require.Equal(t, "runner-0", leaf.Subject.CommonName, "the Pod, for a per-Pod deny list")
	require.Equal(t, testPodUID, leaf.Subject.SerialNumber)
	require.False(t, leaf.IsCA)
	require.True(t, leaf.PublicKey.(*ecdsa.PublicKey).Equal(f.key.Public()), "for the kubelet's key")

	// Whole seconds, as the status records them; the default 24 hours
	// from two minutes back; a refresh at half-life.
	nb := t0.Add(-2 * time.Minute)
	require.True(t, st.NotBefore.Time.Equal(nb) && leaf.NotBefore.Equal(nb), "%s", st.NotBefore)
	require.True(t, st.NotAfter.Time.Equal(nb.Add(24*time.Hour)) && leaf.NotAfter.Equal(st.NotAfter.Time))
	require.True(t, st.BeginRefreshAt.Time.Equal(nb.Add(12*time.Hour)))

	inter := x509.NewCertPool()
	inter.AddCert(chain[1])
	_, err = leaf.Verify(x509.VerifyOptions{Roots: f.root.CertPool(), Intermediates: inter, CurrentTime: t0,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
}

func TestARequestForAShorterLifetimeGetsIt(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	hour := int32(3600)
	st := f.answer(t, f.request(t, func(p *certificatesv1.PodCertificateRequest) { p.Spec.MaxExpirationSeconds = &hour }))
	require.Equal(t, time.Hour, st.NotAfter.Sub(st.NotBefore.Time))
	require.Equal(t, 30*time.Minute, st.BeginRefreshAt.Sub(st.NotBefore.Time), "ten minutes or more from either end")
}

func TestRequestsThatAreNotTheLivePodsAreDenied(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		cluster func(*corev1.ServiceAccount, *corev1.Pod)
		request func(*certificatesv1.PodCertificateRequest)
		reason  string
	}{
		"the ServiceAccount not labelled": {cluster: func(sa *corev1.ServiceAccount, _ *corev1.Pod) { sa.Labels = nil }, reason: ReasonNotAllowed},
		"labelled other than true":        {cluster: func(sa *corev1.ServiceAccount, _ *corev1.Pod) { sa.Labels[LabelPodCertificates] = "yes" }, reason: ReasonNotAllowed},
		"no such Pod":                     {request: func(p *certificatesv1.PodCertificateRequest) { p.Spec.PodName = "runner-9" }, reason: ReasonPodNotFound},
		"another Pod of the name":         {request: func(p *certificatesv1.PodCertificateRequest) { p.Spec.PodUID = "old-uid" }, reason: ReasonPodMismatch},
		"another ServiceAccount": {
			cluster: func(_ *corev1.ServiceAccount, p *corev1.Pod) { p.Spec.ServiceAccountName = "default" }, reason: ReasonPodMismatch,
		},
		"another node":                       {request: func(p *certificatesv1.PodCertificateRequest) { p.Spec.NodeName = "node-b" }, reason: ReasonPodMismatch},
		"a Pod that asks for no certificate": {cluster: func(_ *corev1.ServiceAccount, p *corev1.Pod) { p.Spec.Volumes = nil }, reason: ReasonNotRequested},
		"a Pod that asks another signer": {
			cluster: func(_ *corev1.ServiceAccount, p *corev1.Pod) {
				p.Spec.Volumes = []corev1.Volume{certVolume("example.com/other")}
			}, reason: ReasonNotRequested,
		},
		"user annotations it does not read": {
			request: func(p *certificatesv1.PodCertificateRequest) {
				p.Spec.UnverifiedUserAnnotations = map[string]string{"example.com/role": "admin"}
			}, reason: certificatesv1.PodCertificateRequestConditionInvalidUserConfig,
		},
		"another ServiceAccount of the name":   {request: func(p *certificatesv1.PodCertificateRequest) { p.Spec.ServiceAccountUID = "old-sa" }, reason: ReasonPodMismatch},
		"a ServiceAccount that does not exist": {cluster: func(sa *corev1.ServiceAccount, _ *corev1.Pod) { sa.Name = "gone" }, reason: ReasonPodMismatch},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var mc []func(*corev1.ServiceAccount, *corev1.Pod)
			if c.cluster != nil {
				mc = append(mc, c.cluster)
			}
			f := newFixture(t, mc...)
			var mr []func(*certificatesv1.PodCertificateRequest)
			if c.request != nil {
				mr = append(mr, c.request)
			}
			st := f.answer(t, f.request(t, mr...))
			require.Len(t, st.Conditions, 1)
			require.Equal(t, certificatesv1.PodCertificateRequestConditionTypeDenied, st.Conditions[0].Type)
			require.Equal(t, c.reason, st.Conditions[0].Reason)
			require.Empty(t, st.CertificateChain)
		})
	}
}

func TestASignerWhoseCAEndsWithinTheHourFails(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.signer.cfg.Clock = clocktesting.NewFakePassiveClock(f.signer.cfg.CA().Certificate().NotAfter.Add(-30 * time.Minute))
	st := f.answer(t, f.request(t))
	require.Equal(t, certificatesv1.PodCertificateRequestConditionTypeFailed, st.Conditions[0].Type)
	require.Equal(t, ReasonLifetime, st.Conditions[0].Reason)
}

func TestAnAnsweredRequestOrAnotherSignersIsLeftAlone(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	done := f.request(t, func(p *certificatesv1.PodCertificateRequest) {
		p.Status.Conditions = []metav1.Condition{{Type: certificatesv1.PodCertificateRequestConditionTypeDenied, Status: metav1.ConditionTrue, Reason: "Other"}}
	})
	other := f.request(t, func(p *certificatesv1.PodCertificateRequest) {
		p.Name, p.Spec.SignerName = "req-2", "example.com/other"
	})
	f.client.ClearActions()
	require.NoError(t, f.signer.Answer(context.Background(), done))
	require.NoError(t, f.signer.Answer(context.Background(), other))
	require.Empty(t, f.client.Actions(), "nothing read, nothing written")
}

func TestAnAnswerThatCannotBeDecidedIsNotWritten(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	pcr := f.request(t)
	f.client.PrependReactor("get", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("the API server is unavailable")
	})
	require.ErrorContains(t, f.signer.Answer(context.Background(), pcr), "unavailable")
	got, err := f.client.CertificatesV1().PodCertificateRequests("argo").Get(context.Background(), pcr.Name, metav1.GetOptions{})
	require.NoError(t, err)
	require.Empty(t, got.Status.Conditions, "no denial for a Pod it could not read: Run tries again")
}

func TestNewRefusesWhatCannotSign(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	good := f.signer.cfg
	for name, mutate := range map[string]func(*Config){
		"no CA":                  func(c *Config) { c.CA = nil },
		"no signer name":         func(c *Config) { c.SignerName = "" },
		"a workload, no cluster": func(c *Config) { c.ClusterIdentity = clusterID + "/ns/a/sa/b" },
		"under the API's hour":   func(c *Config) { c.MaxLifetime = 59 * time.Minute },
	} {
		c := good
		mutate(&c)
		_, err := New(c)
		require.Error(t, err, name)
	}
}

func TestARequestWaitsWhileTheClusterHasNoCA(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ca := f.signer.cfg.CA()
	var current *pki.CA // not enrolled yet
	f.signer.cfg.CA = func() *pki.CA { return current }
	pcr := f.request(t)
	require.ErrorIs(t, f.signer.Answer(context.Background(), pcr), errNoCA, "retried, never denied")
	got, err := f.client.CertificatesV1().PodCertificateRequests("argo").Get(context.Background(), pcr.Name, metav1.GetOptions{})
	require.NoError(t, err)
	require.Empty(t, got.Status.Conditions, "nothing written")

	current = ca // enrolled: the next try signs
	st := f.answer(t, pcr)
	require.Equal(t, certificatesv1.PodCertificateRequestConditionTypeIssued, st.Conditions[0].Type)
}
