package integration

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptrace"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki/pkitest"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// agentGrants names west's agent and gives west a grant that names no
// workload, which a pod certificate of a workload never gets.
const agentGrants = `
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    agent: {namespace: tokenbroker-agent, serviceAccount: tokenbroker-agent}
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
`

// TestTheAgentsPodCertificateSpeaksForItsClusterUntilItsPodIsRevoked runs
// the agent's own pod certificate (fleet CA → west's cluster CA → the pod
// certificate of tokenbroker-agent/tokenbroker-agent) against a real
// broker and API server: it is west itself, gets a lease under a grant
// that names no workload, whose token the API server takes for the
// granted ServiceAccount; a policy reload that drops the agent and the
// deny list's entry for its Pod's uid each refuse its next request on the
// same kept-alive connection.
func TestTheAgentsPodCertificateSpeaksForItsClusterUntilItsPodIsRevoked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testcluster.Start(t)
	// Long enough for the stack's server certificate.
	fleet := pkitest.FleetRoot(t, 365*24*time.Hour)
	west := identity(t, "west")
	s := startStack(t, c, agentGrants, withCA(fleet))
	ensureNamespace(t, c, "argo")
	_, err := c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	require.NoError(t, err)

	_, clusterCA := pkitest.ClusterCA(t, fleet, west, 12*time.Hour)
	chainPEM, _, keyPEM := pkitest.PodCertificate(t, clusterCA, west, "tokenbroker-agent", "tokenbroker-agent")
	agent := s.clientWith(t, chainPEM, keyPEM, fleet.CertPool())
	t.Cleanup(agent.CloseIdleConnections)
	var reused atomic.Bool
	call := func(method, path string, in any) (int, apiv1.Problem) {
		trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused.Store(i.Reused) }}
		req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), method, s.url+path, jsonBody(t, in))
		require.NoError(t, err)
		req.Header.Set("Content-Type", "application/json")
		resp, err := agent.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		var p apiv1.Problem
		if resp.StatusCode >= 300 {
			require.NoError(t, json.Unmarshal(body, &p), string(body))
		}
		return resp.StatusCode, p
	}

	var who apiv1.WhoAmI
	status, _ := do(t, agent, http.MethodGet, s.url+"/v1/whoami", nil, &who)
	require.Equal(t, http.StatusOK, status)
	require.Equal(t, west, who.Identity, "west itself")
	require.Nil(t, who.Workload)

	resp := issue(t, s, agent, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "10m"})
	rs := review(t, c.Client, resp.Token)
	require.True(t, rs.Authenticated, rs.Error)
	require.Equal(t, "system:serviceaccount:argo:runner", rs.User.Username)
	var issued map[string]any
	for _, ev := range readAudit(t, s.auditLog) {
		if ev["action"] == "issue" && ev["lease_id"] == resp.LeaseID {
			issued = ev
		}
	}
	require.NotNil(t, issued, "the issuance is audited")
	require.Equal(t, "tokenbroker-agent/runner-0", issued["agent_pod"])
	require.Equal(t, pkitest.PodUID, issued["agent_pod_uid"])
	require.Nil(t, issued["workload"], "not a workload")

	// Renewal is a client certificate's only.
	status, _ = call(http.MethodPost, "/v1/certificates", apiv1.CertificateRequest{CSR: "x"})
	require.Equal(t, http.StatusForbidden, status)

	// The policy drops the agent: the same certificate is a workload of
	// west, which trusts none.
	s.writePolicy(t, `
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: `+west+`
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`)
	var last apiv1.Problem
	require.Eventually(t, func() bool {
		status, p := call(http.MethodGet, "/v1/whoami", nil)
		last = p
		return status == http.StatusUnauthorized && p.Reason == workload.PodCertificatesOff
	}, 10*time.Second, 20*time.Millisecond, "refused once the reload drops the agent: %+v", &last)
	require.True(t, reused.Load(), "on the kept-alive connection")
	s.writePolicy(t, agentGrants)
	require.Eventually(t, func() bool {
		status, _ := call(http.MethodGet, "/v1/whoami", nil)
		return status == http.StatusOK
	}, 10*time.Second, 20*time.Millisecond, "west's agent again")

	// Written by the code behind "tokenbroker pki revoke --pod-uid".
	start := time.Now()
	added, err := enrollment.AddRevocation(ctx, c.Client.CoreV1().ConfigMaps(brokerNamespace), enrollment.RevokePod, pkitest.PodUID, "integration test", time.Now())
	require.NoError(t, err)
	require.True(t, added)
	require.Eventually(t, func() bool {
		status, _ := call(http.MethodPost, "/v1/kubeconfigs", apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "10m"})
		return status == http.StatusUnauthorized
	}, 10*time.Second, 20*time.Millisecond)
	t.Logf("revoked agent Pod refused %s after the ConfigMap write", time.Since(start).Round(time.Millisecond))
	require.True(t, reused.Load(), "on the kept-alive connection")
	status, p := call(http.MethodGet, "/v1/whoami", nil)
	require.Equal(t, http.StatusUnauthorized, status)
	require.Equal(t, "urn:tokenbroker:problem:unauthenticated", p.Type)
}
