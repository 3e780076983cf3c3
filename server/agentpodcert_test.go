package server

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/pki/pkitest"
)

const (
	northIdentity = "spiffe://oc.example/cluster/north"
	agentNS       = "tokenbroker-agent"
	agentSA       = "tokenbroker-agent"
	agentUID      = "0d6a2c1e-5f4b-4a3c-9e2d-1b0a9c8d7e6f"
	restartedUID  = "0d6a2c1e-5f4b-4a3c-9e2d-1b0a9c8d7e70"
)

// agentPolicyDoc is a policy whose peer west names its agent, trusts pod
// certificates (so that another pod certificate of west is a workload,
// not refused) and has a grant of its own and one for argo/runner; north
// trusts pod certificates too and names no agent.
const agentPolicyDoc = `cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: ` + testIdentity + `
    agent: {namespace: ` + agentNS + `, serviceAccount: ` + agentSA + `}
    workloadIdentity: {podCertificates: true%s}
    grants:
      - {namespaces: [argo], serviceAccounts: [admiralty-source]}
      - {namespaces: [argo], serviceAccounts: [runner], workloads: [{namespace: argo, serviceAccount: runner}]}
  - name: north
    identity: ` + northIdentity + `
    workloadIdentity: {podCertificates: true}
    grants: [{namespaces: [argo], serviceAccounts: [admiralty-source]}]
`

// agentFleet is a fleet root and the cluster CAs of west and north.
type agentFleet struct {
	root        *pki.CA
	west, north *pki.CA
}

func newAgentFleet(t *testing.T) *agentFleet {
	t.Helper()
	root := pkitest.FleetRoot(t, 24*time.Hour)
	_, west := pkitest.ClusterCA(t, root, testIdentity, 12*time.Hour)
	_, north := pkitest.ClusterCA(t, root, northIdentity, 12*time.Hour)
	return &agentFleet{root: root, west: west, north: north}
}

// pod is the TLS state of a pod certificate that ca (the CA of cluster)
// signs for namespace/serviceAccount and the Pod of uid, made at
// notBefore, its chains verified as crypto/tls verifies them.
func (f *agentFleet) pod(t *testing.T, ca *pki.CA, cluster, namespace, serviceAccount, uid string, notBefore time.Time) *tls.ConnectionState {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	id, err := pki.WorkloadIdentity(cluster, namespace, serviceAccount)
	require.NoError(t, err)
	nb := notBefore.Truncate(time.Second)
	leaf, _, err := ca.SignPodCertificate(cluster, pki.PodCertificate{Identity: id, PublicKey: crypto.PublicKey(key.Public()),
		NotBefore: nb, NotAfter: nb.Add(time.Hour), PodName: serviceAccount + "-0", PodUID: uid})
	require.NoError(t, err)
	return f.state(t, leaf, ca.Certificate())
}

// state verifies leaf under clusterCA and the fleet root.
func (f *agentFleet) state(t *testing.T, leaf, clusterCA *x509.Certificate) *tls.ConnectionState {
	t.Helper()
	inter := x509.NewCertPool()
	inter.AddCert(clusterCA)
	chains, err := leaf.Verify(x509.VerifyOptions{Roots: f.root.CertPool(), Intermediates: inter, CurrentTime: leaf.NotBefore.Add(time.Minute),
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	require.NoError(t, err)
	return &tls.ConnectionState{Version: tls.VersionTLS13, HandshakeComplete: true,
		PeerCertificates: []*x509.Certificate{leaf, clusterCA}, VerifiedChains: chains}
}

// forged is what the holder of north's CA key can make for west's agent
// without pki's checks: a pod certificate naming west's agent workload,
// signed by north's cluster CA.
func (f *agentFleet) forged(t *testing.T) *tls.ConnectionState {
	t.Helper()
	keyPEM, err := f.north.KeyPEM()
	require.NoError(t, err)
	caKey, err := pki.ParsePrivateKeyPEM(keyPEM)
	require.NoError(t, err)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	u, err := url.Parse(testIdentity + "/ns/" + agentNS + "/sa/" + agentSA)
	require.NoError(t, err)
	nb := time.Now().Add(-time.Minute).Truncate(time.Second)
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: big.NewInt(77), Subject: pkix.Name{CommonName: "agent-0", SerialNumber: agentUID},
		URIs: []*url.URL{u}, NotBefore: nb, NotAfter: nb.Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, f.north.Certificate(), key.Public(), caKey)
	require.NoError(t, err)
	leaf, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return f.state(t, leaf, f.north.Certificate())
}

// agentEnv is a server in front of a real broker whose policy store and
// clock the test holds.
type agentEnv struct {
	h      *harness
	store  *policy.Store
	clk    *clocktesting.FakeClock
	events *bytes.Buffer
}

func newAgentEnv(t *testing.T, doc string, deny ...enrollment.RevocationEntry) *agentEnv {
	t.Helper()
	pol, err := policy.Parse([]byte(doc))
	require.NoError(t, err)
	e := &agentEnv{store: policy.NewStore(pol), clk: clocktesting.NewFakeClock(time.Now()), events: &bytes.Buffer{}}
	secrets := fake.NewClientset().CoreV1()
	b, err := broker.New(broker.Config{
		Secrets: secrets, Policy: e.store, Logger: zap.NewNop(), Namespace: "tokenbroker", Clock: e.clk,
		Auditor:    audit.NewLog(e.events),
		PeerKeys:   workload.NewPeerKeyStore(secrets, "tokenbroker", zap.NewNop()),
		Enrollment: enrollment.Config{Revocations: enrollment.StaticRevocationList(enrollment.NewDenyList(deny))},
	})
	require.NoError(t, err)
	e.h = newHarnessWith(t, b, func(c *Config) { c.Now = e.clk.Now })
	return e
}

// audited is the audit events written so far.
func (e *agentEnv) audited(t *testing.T) []audit.Event {
	t.Helper()
	var evs []audit.Event
	for _, line := range strings.Split(strings.TrimSpace(e.events.String()), "\n") {
		var ev audit.Event
		require.NoError(t, json.Unmarshal([]byte(line), &ev))
		evs = append(evs, ev)
	}
	return evs
}

// whoami asks GET /v1/whoami with the TLS state st.
func (e *agentEnv) whoami(t *testing.T, st *tls.ConnectionState) (int, apiv1.WhoAmI) {
	t.Helper()
	rec := e.h.do(request{method: http.MethodGet, path: "/v1/whoami", tls: st})
	var who apiv1.WhoAmI
	if rec.Code == http.StatusOK {
		require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &who))
	}
	return rec.Code, who
}

// reportPods is PUT /v1/peers/self/pods of uids with the TLS state st.
func reportPods(st *tls.ConnectionState, uids ...string) request {
	body, _ := json.Marshal(apiv1.LivePodsReport{UIDs: append([]string{}, uids...)})
	return request{method: http.MethodPut, path: "/v1/peers/self/pods", body: string(body), contentType: "application/json", tls: st}
}

func TestTheAgentsPodCertificateIsItsPeerAndNoOtherPodCertificateIs(t *testing.T) {
	t.Parallel()
	f := newAgentFleet(t)
	e := newAgentEnv(t, strings.Replace(agentPolicyDoc, "%s", "", 1))
	now := time.Now().Add(-time.Minute)
	agent := f.pod(t, f.west, testIdentity, agentNS, agentSA, agentUID, now)

	status, who := e.whoami(t, agent)
	require.Equal(t, http.StatusOK, status)
	require.Equal(t, testIdentity, who.Identity, "the peer itself")
	require.Equal(t, "west", who.Peer)
	require.Nil(t, who.Workload)
	require.Len(t, who.Grants, 2, "every grant of the peer")
	// The peer's own routes are open to it (the policy lets west upload
	// no key set: the broker's 403, after the route let it through).
	rec := e.h.do(request{method: http.MethodPut, path: "/v1/peers/self/jwks", body: `{"keys":[]}`, contentType: "application/json", tls: agent})
	requireProblem(t, rec, http.StatusForbidden, "forbidden")
	require.Contains(t, e.events.String(), `"action":"upload_jwks"`, "the broker decided it")
	require.Contains(t, e.events.String(), `"agent_pod":"tokenbroker-agent/tokenbroker-agent-0","agent_pod_uid":"`+agentUID+`"`)

	// Renewal and the report of the live Pods are a client certificate's only.
	requireProblem(t, e.h.do(reportPods(agent, agentUID)), http.StatusForbidden, "forbidden")
	rec = e.h.do(request{method: http.MethodPost, path: "/v1/certificates", body: `{"csr":"x"}`, contentType: "application/json", tls: agent})
	requireProblem(t, rec, http.StatusForbidden, "forbidden")
	logged := false
	for _, le := range e.h.logs.FilterMessage("request failed").All() {
		logged = logged || strings.Contains(fmt.Sprint(le.ContextMap()["error"]), "never a pod certificate")
	}
	require.True(t, logged, "the log says why")

	// A token beside it is verified as beside the peer's client
	// certificate (west trusts no token: 401 no-trust, not 400).
	rq := request{method: http.MethodGet, path: "/v1/whoami", tls: agent, header: bearer(workloadToken1)}
	p := requireProblem(t, e.h.do(rq), http.StatusUnauthorized, "invalid-workload-token")
	require.Equal(t, workload.TokenNoTrust, p.Reason)

	tests := []struct {
		name         string
		st           *tls.ConnectionState
		wantStatus   int
		wantIdentity string
		wantWorkload string
	}{
		{name: "the agent's ServiceAccount in another namespace is a workload", st: f.pod(t, f.west, testIdentity, "argo", agentSA, agentUID, now),
			wantStatus: http.StatusOK, wantIdentity: testIdentity, wantWorkload: "argo/" + agentSA},
		{name: "another ServiceAccount of the agent's namespace is a workload", st: f.pod(t, f.west, testIdentity, agentNS, "other", agentUID, now),
			wantStatus: http.StatusOK, wantIdentity: testIdentity, wantWorkload: agentNS + "/other"},
		{name: "the agent's workload of another cluster is that cluster's workload", st: f.pod(t, f.north, northIdentity, agentNS, agentSA, agentUID, now),
			wantStatus: http.StatusOK, wantIdentity: northIdentity, wantWorkload: agentNS + "/" + agentSA},
		{name: "west's agent signed by north's CA is refused", st: f.forged(t), wantStatus: http.StatusUnauthorized},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			status, who := e.whoami(t, tc.st)
			require.Equal(t, tc.wantStatus, status)
			if status != http.StatusOK {
				return
			}
			require.Equal(t, tc.wantIdentity, who.Identity)
			require.NotNil(t, who.Workload)
			require.Equal(t, tc.wantWorkload, who.Workload.Namespace+"/"+who.Workload.ServiceAccount)
			require.Empty(t, who.Grants, "no grant names it")
			for _, rq := range []request{
				reportPods(tc.st, agentUID),
				{method: http.MethodPut, path: "/v1/peers/self/jwks", body: `{"keys":[]}`, contentType: "application/json", tls: tc.st},
				{method: http.MethodPost, path: "/v1/certificates", body: `{"csr":"x"}`, contentType: "application/json", tls: tc.st},
			} {
				requireProblem(t, e.h.do(rq), http.StatusForbidden, "forbidden")
			}
			rq := request{method: http.MethodGet, path: "/v1/whoami", tls: tc.st, header: bearer(workloadToken1)}
			requireProblem(t, e.h.do(rq), http.StatusBadRequest, "invalid-request")
		})
	}

	// A reload that drops the agent applies to the next request of the
	// same connection: the agent's certificate is a workload's again.
	without, err := policy.Parse([]byte(strings.Replace(strings.Replace(agentPolicyDoc, "%s", "", 1),
		"    agent: {namespace: "+agentNS+", serviceAccount: "+agentSA+"}\n", "", 1)))
	require.NoError(t, err)
	e.store.Store(without)
	status, who = e.whoami(t, agent)
	require.Equal(t, http.StatusOK, status)
	require.NotNil(t, who.Workload, "a workload now")
	require.Empty(t, who.Grants)
	requireProblem(t, e.h.do(reportPods(agent, agentUID)), http.StatusForbidden, "forbidden")
}

// TestTheAgentsPodIsHeldToTheReportItCannotWrite: with livePodsFromPeer,
// the agent's pod certificate is honoured while its Pod is in the last
// report, which only the cluster's client certificate writes: a pod
// certificate, the agent's too, is 403 there, so that a deleted agent
// Pod's certificate cannot report itself live again. A new agent Pod waits
// for the next report (503), a deleted one is refused once a report newer
// than its certificate leaves it out.
func TestTheAgentsPodIsHeldToTheReportItCannotWrite(t *testing.T) {
	t.Parallel()
	f := newAgentFleet(t)
	e := newAgentEnv(t, strings.Replace(agentPolicyDoc, "%s", ", livePodsFromPeer: true, livePodsMaxAge: 1m", 1))
	t0 := e.clk.Now()
	// A pod certificate is taken as made 2m after its NotBefore (the
	// signer's backdating).
	first := f.pod(t, f.west, testIdentity, agentNS, agentSA, agentUID, t0.Add(-5*time.Minute))

	status, _ := e.whoami(t, first)
	require.Equal(t, http.StatusUnauthorized, status, "no report yet")
	rec := e.h.do(reportPods(nil, agentUID))
	require.Equal(t, http.StatusOK, rec.Code, "the client certificate reports: %s", rec.Body.String())
	status, who := e.whoami(t, first)
	require.Equal(t, http.StatusOK, status)
	require.Nil(t, who.Workload)
	requireProblem(t, e.h.do(reportPods(first, agentUID)), http.StatusForbidden, "forbidden")

	// The agent restarts: its new Pod is newer than the report, and waits
	// for the next one.
	e.clk.Step(10 * time.Second)
	restarted := f.pod(t, f.west, testIdentity, agentNS, agentSA, restartedUID, e.clk.Now().Add(-2*time.Minute))
	e.clk.Step(time.Second)
	rec = e.h.do(request{method: http.MethodGet, path: "/v1/whoami", tls: restarted})
	require.Equal(t, http.StatusServiceUnavailable, rec.Code, "not reported yet: %s", rec.Body.String())
	rec = e.h.do(reportPods(nil, restartedUID))
	require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
	status, _ = e.whoami(t, restarted)
	require.Equal(t, http.StatusOK, status)

	// The first Pod, deleted, is left out of a report newer than its
	// certificate: refused.
	p := requireProblem(t, e.h.do(request{method: http.MethodGet, path: "/v1/whoami", tls: first}), http.StatusUnauthorized, "invalid-pod-certificate")
	require.Equal(t, workload.TokenPodNotLive, p.Reason)
	evs := e.audited(t)
	last := evs[len(evs)-1]
	require.Equal(t, audit.ActionAuthenticate, last.Action)
	require.Equal(t, "pod certificate refused: pod-not-live", last.Reason)
	require.Equal(t, "tokenbroker-agent/tokenbroker-agent-0", last.AgentPod)
	require.Equal(t, agentUID, last.AgentPodUID)
	require.Empty(t, last.Workload)

	// Reports stop: once the last is older than livePodsMaxAge, no agent
	// Pod is honoured, and none can report.
	e.clk.Step(time.Minute + time.Second)
	status, _ = e.whoami(t, restarted)
	require.Equal(t, http.StatusUnauthorized, status)
	requireProblem(t, e.h.do(reportPods(restarted, restartedUID)), http.StatusUnauthorized, "invalid-pod-certificate")
}

func TestARevokedAgentWorkloadPodClusterCAOrClusterRefusesTheAgentsPodCertificate(t *testing.T) {
	t.Parallel()
	f := newAgentFleet(t)
	doc := strings.Replace(agentPolicyDoc, "%s", "", 1)
	tests := map[string]enrollment.RevocationEntry{
		"the agent's workload identity": {Kind: enrollment.RevokeIdentity, Value: testIdentity + "/ns/" + agentNS + "/sa/" + agentSA},
		"its Pod":                       {Kind: enrollment.RevokePod, Value: agentUID},
		"the cluster CA":                {Kind: enrollment.RevokeSerial, Value: f.west.Certificate().SerialNumber.Text(16)},
		"the cluster":                   {Kind: enrollment.RevokeIdentity, Value: testIdentity},
	}
	for name, entry := range tests {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			agent := f.pod(t, f.west, testIdentity, agentNS, agentSA, agentUID, time.Now().Add(-time.Minute))
			ok := newAgentEnv(t, doc)
			status, _ := ok.whoami(t, agent)
			require.Equal(t, http.StatusOK, status, "not revoked")
			e := newAgentEnv(t, doc, entry)
			for _, rq := range []request{{method: http.MethodGet, path: "/v1/whoami", tls: agent}, reportPods(agent, agentUID)} {
				requireProblem(t, e.h.do(rq), http.StatusUnauthorized, "unauthenticated")
			}
			require.Contains(t, e.events.String(), `"action":"authenticate","decision":"deny"`)
			require.Contains(t, e.events.String(), `"agent_pod":"tokenbroker-agent/tokenbroker-agent-0","agent_pod_uid":"`+agentUID+`"`, "the event names the Pod")
		})
	}
}
