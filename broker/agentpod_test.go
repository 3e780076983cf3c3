package broker

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/pki/pkitest"
)

const agentPolicy = `cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
limits: {issuancesPerMinute: 2, burst: 2}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    agent: {namespace: tokenbroker-agent, serviceAccount: tokenbroker-agent}
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`

// TestTheAgentsPodCertificateAsksAsItsPeer: the pod certificate of the
// workload the policy names the peer's agent authenticates as the peer
// (no Workload, the grants without workloads), takes from the peer's
// buckets, and its audit events name its Pod apart from any workload.
func TestTheAgentsPodCertificateAsksAsItsPeer(t *testing.T) {
	t.Parallel()
	e, _ := newLimitsEnv(t, agentPolicy)
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec
	ctx := context.Background()
	root := pkitest.FleetRoot(t, 24*time.Hour)
	_, ca := pkitest.ClusterCA(t, root, west.Identity, time.Hour)
	_, leaf, _ := pkitest.PodCertificate(t, ca, west.Identity, "tokenbroker-agent", "tokenbroker-agent")
	pw := &pki.PodWorkload{Cluster: west.Identity, Identity: leaf.URIs[0].String(), Namespace: "tokenbroker-agent",
		ServiceAccount: "tokenbroker-agent", PodName: "runner-0", PodUID: pkitest.PodUID}

	c, err := e.b.AuthenticatePodCertificate(ctx, Caller{Identity: west.Identity, CertSHA256: pki.Fingerprint(leaf), Certificate: leaf}, pw)
	require.NoError(t, err)
	require.Nil(t, c.Workload, "the peer itself")
	require.Equal(t, pw, c.Agent)
	require.Equal(t, west.Identity, limitKey(c), "the peer's buckets")

	req := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"}
	for range 2 {
		_, err = e.b.IssueKubeconfig(ctx, c, req)
		require.NoError(t, err, "a grant that names no workload")
	}
	_, err = e.b.IssueKubeconfig(ctx, west, req)
	require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err), "the agent's Pod and the peer's client certificate share one bucket")
	evs := rec.all()
	require.Len(t, evs, 3)
	ev := evs[0]
	require.Equal(t, audit.DecisionAllow, ev.Decision)
	require.Equal(t, west.Identity, ev.Identity)
	require.Equal(t, "tokenbroker-agent/runner-0", ev.AgentPod)
	require.Equal(t, pkitest.PodUID, ev.AgentPodUID)
	require.Empty(t, ev.Workload+ev.WorkloadPod+ev.WorkloadPodUID, "not a workload")
	require.Empty(t, evs[2].AgentPod+evs[2].AgentPodUID, "the client certificate's event names no Pod")

	// The same Pod as a workload of another namespace is not the agent.
	other := *pw
	other.Namespace = "argo"
	_, err = e.b.AuthenticatePodCertificate(ctx, Caller{Identity: west.Identity, Certificate: leaf}, &other)
	var pe *problem.Error
	require.ErrorAs(t, err, &pe)
	require.Equal(t, workload.PodCertificatesOff, pe.Reason)
	evs = rec.all()
	require.Equal(t, "argo/tokenbroker-agent", evs[len(evs)-1].Workload)
	require.Empty(t, evs[len(evs)-1].AgentPod)
}
