package server

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/pki/pkitest"
)

const testPodUID = pkitest.PodUID

// podPKI is a fleet root that signs cluster CAs, the cluster CA of west
// (testIdentity), and a pod certificate of west's argo/runner under it.
type podPKI struct {
	root      *pki.CA
	clusterCA *pki.KeyPair
	leaf      *x509.Certificate
}

func newPodPKI(t *testing.T) *podPKI {
	t.Helper()
	root := pkitest.FleetRoot(t, 24*time.Hour)
	kp, ca := pkitest.ClusterCA(t, root, testIdentity, time.Hour)
	_, leaf, _ := pkitest.PodCertificate(t, ca, testIdentity, "argo", "runner")
	return &podPKI{root: root, clusterCA: kp, leaf: leaf}
}

// state is the TLS state the handshake leaves for the pod certificate,
// its chains verified as crypto/tls verifies them.
func (p *podPKI) state(t *testing.T) *tls.ConnectionState {
	t.Helper()
	inter := x509.NewCertPool()
	inter.AddCert(p.clusterCA.Cert)
	chains, err := p.leaf.Verify(x509.VerifyOptions{Roots: p.root.CertPool(), Intermediates: inter,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	return &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true,
		PeerCertificates: []*x509.Certificate{p.leaf, p.clusterCA.Cert}, VerifiedChains: chains}
}

// podBroker is a workloadBroker whose pod-certificate check is auth.
func podBroker(fb *fakeBroker, auth func(c broker.Caller, w *pki.PodWorkload) (broker.Caller, error)) workloadBroker {
	return workloadBroker{fakeBroker: fb, pod: auth,
		auth: func(c broker.Caller, _ string) (broker.Caller, error) { return c, errors.New("no token expected") }}
}

func TestAPodCertificateAsksAsAWorkloadOfTheClusterWhoseCASignedIt(t *testing.T) {
	t.Parallel()
	pp := newPodPKI(t)
	fb := &fakeBroker{}
	var seen *pki.PodWorkload
	h := newHarnessWith(t, podBroker(fb, func(c broker.Caller, w *pki.PodWorkload) (broker.Caller, error) {
		seen = w
		c.Workload = &workload.Identity{Namespace: w.Namespace, ServiceAccount: w.ServiceAccount, Pod: w.PodName, PodUID: w.PodUID}
		return c, nil
	}))
	rq := postKubeconfig(validBody)
	rq.tls = pp.state(t)
	rec := h.do(rq)
	require.Equal(t, http.StatusCreated, rec.Code, rec.Body.String())
	require.Equal(t, testIdentity, seen.Cluster)
	require.Equal(t, "runner-0", seen.PodName)
	require.Equal(t, testPodUID, seen.PodUID)
	require.True(t, pp.clusterCA.Cert.Equal(seen.ClusterCA))
	c := fb.lastCaller()
	require.Equal(t, testIdentity, c.Identity, "the caller is of the cluster whose CA signed it")
	require.Equal(t, "argo/runner", c.Workload.String())
	require.Equal(t, pki.Fingerprint(pp.leaf), c.CertSHA256)
}

func TestAPodCertificateTheBrokerRefusesIs401WithTheReasonAndReachesNothing(t *testing.T) {
	t.Parallel()
	pp := newPodPKI(t)
	fb := &fakeBroker{}
	h := newHarnessWith(t, podBroker(fb, func(c broker.Caller, _ *pki.PodWorkload) (broker.Caller, error) {
		return c, workload.BadPodCertificate(workload.TokenPodNotLive, errors.New("pod gone"))
	}))
	rq := postKubeconfig(validBody)
	rq.tls = pp.state(t)
	rec := h.do(rq)
	p := requireProblem(t, rec, http.StatusUnauthorized, "invalid-pod-certificate")
	require.Equal(t, workload.TokenPodNotLive, p.Reason)
	require.Contains(t, p.Detail, "Pod was deleted")
	require.Zero(t, fb.calls.Load())

	// A broker that verifies no workloads refuses every pod certificate.
	plain := newHarness(t, nil)
	rq.tls = pp.state(t)
	p = requireProblem(t, plain.do(rq), http.StatusUnauthorized, "invalid-pod-certificate")
	require.Equal(t, workload.PodCertificatesOff, p.Reason)
	require.Zero(t, plain.broker.calls.Load())
}

func TestAPodCertificateSpeaksForItsWorkloadOnly(t *testing.T) {
	t.Parallel()
	pp := newPodPKI(t)
	fb := &fakeBroker{}
	h := newHarnessWith(t, podBroker(fb, func(c broker.Caller, w *pki.PodWorkload) (broker.Caller, error) {
		c.Workload = &workload.Identity{Namespace: w.Namespace, ServiceAccount: w.ServiceAccount, PodUID: w.PodUID}
		return c, nil
	}))
	// Never its cluster: no renewal of the cluster's certificate, no key
	// set or Pods reported for it.
	for _, rq := range []request{
		{method: http.MethodPost, path: "/v1/certificates", body: `{"csr":"x"}`, contentType: "application/json"},
		{method: http.MethodPut, path: "/v1/peers/self/jwks", body: `{"keys":[]}`, contentType: "application/json"},
		{method: http.MethodPut, path: "/v1/peers/self/pods", body: `{"uids":[]}`, contentType: "application/json"},
	} {
		rq.tls = pp.state(t)
		requireProblem(t, h.do(rq), http.StatusForbidden, "forbidden")
	}
	// Nor another workload, by a token beside it.
	rq := postKubeconfig(validBody)
	rq.tls = pp.state(t)
	rq.header = bearer(workloadToken1)
	p := requireProblem(t, h.do(rq), http.StatusBadRequest, "invalid-request")
	require.Equal(t, "Authorization", p.Errors[0].Field)
	require.Zero(t, fb.calls.Load())
}

func TestARevokedWorkloadPodOrClusterCAEndsAPodCertificatesAccess(t *testing.T) {
	t.Parallel()
	pp := newPodPKI(t)
	caSerial := pp.clusterCA.Cert.SerialNumber.Text(16)
	for name, fb := range map[string]*fakeBroker{
		"the workload identity": {revoked: func(id string, _ ...string) bool { return id == testIdentity+"/ns/argo/sa/runner" }},
		"the Pod":               {revokedPod: func(uid string) bool { return uid == testPodUID }},
		"the cluster CA": {revoked: func(_ string, serials ...string) bool {
			for _, s := range serials {
				if s == caSerial {
					return true
				}
			}
			return false
		}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			authCalled := false
			h := newHarnessWith(t, podBroker(fb, func(c broker.Caller, _ *pki.PodWorkload) (broker.Caller, error) {
				authCalled = true
				return c, nil
			}))
			rq := postKubeconfig(validBody)
			rq.tls = pp.state(t)
			requireProblem(t, h.do(rq), http.StatusUnauthorized, "unauthenticated")
			require.False(t, authCalled)
			require.Zero(t, fb.calls.Load())
			refused := fb.refused()
			require.Len(t, refused, 1)
			require.Equal(t, audit.RefusedRevoked, refused[0].code)
		})
	}
}

func TestAWorkloadCertificateNotSignedByItsClustersCAIsRefused(t *testing.T) {
	t.Parallel()
	pp := newPodPKI(t)
	// The fleet root signs a workload certificate itself: it names a
	// workload but no cluster CA vouches for it.
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	nb := time.Now().Add(-time.Minute).Truncate(time.Second)
	leaf, _, err := pp.root.SignPodCertificate(testIdentity, pki.PodCertificate{Identity: testIdentity + "/ns/argo/sa/runner",
		PublicKey: key.Public(), NotBefore: nb, NotAfter: nb.Add(time.Hour), PodName: "runner-0", PodUID: testPodUID})
	require.NoError(t, err, "the root signs it: what stops it is the broker")
	chains, err := leaf.Verify(x509.VerifyOptions{Roots: pp.root.CertPool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	fb := &fakeBroker{}
	h := newHarnessWith(t, podBroker(fb, func(c broker.Caller, _ *pki.PodWorkload) (broker.Caller, error) { return c, nil }))
	rq := postKubeconfig(validBody)
	rq.tls = &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true, PeerCertificates: []*x509.Certificate{leaf}, VerifiedChains: chains}
	requireProblem(t, h.do(rq), http.StatusUnauthorized, "unauthenticated")
	require.Zero(t, fb.calls.Load())
	require.Equal(t, audit.RefusedIdentity, fb.refused()[0].code)
}

// TestAPodCertificatesConnectionsCountUnderItsWorkload: the per-identity
// connection cap counts a pod certificate's connections under its
// workload identity, apart from its cluster's (the agent's), and a
// workload certificate no cluster CA of its own vouches for under none.
func TestAPodCertificatesConnectionsCountUnderItsWorkload(t *testing.T) {
	t.Parallel()
	pp := newPodPKI(t)
	require.Equal(t, testIdentity+"/ns/argo/sa/runner", peerIdentity(*pp.state(t)))
	forged := *pp.state(t)
	forged.VerifiedChains = [][]*x509.Certificate{{pp.leaf, pp.root.Certificate()}}
	require.Empty(t, peerIdentity(forged))
}
