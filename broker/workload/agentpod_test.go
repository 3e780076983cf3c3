package workload

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/pki"
)

// agentPod is what the pod certificate of west's agent says, for the Pod
// of uid.
func agentPod(uid string) *pki.PodWorkload {
	return &pki.PodWorkload{Cluster: westID, Identity: westID + "/ns/tokenbroker-agent/sa/tokenbroker-agent",
		Namespace: "tokenbroker-agent", ServiceAccount: "tokenbroker-agent", PodName: "tokenbroker-agent-0", PodUID: uid}
}

// agentPolicy is a policy whose peer west names its agent, with
// workloadIdentity wi ("" for none).
func agentPolicy(t *testing.T, wi string) *policy.Policy {
	t.Helper()
	doc := `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: ` + westID + `
    agent: {namespace: tokenbroker-agent, serviceAccount: tokenbroker-agent}
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`
	if wi != "" {
		doc += "    workloadIdentity: " + wi + "\n"
	}
	p, err := policy.Parse([]byte(doc))
	require.NoError(t, err)
	return p
}

func TestTheAgentsPodCertificateNeedsNoWorkloadIdentity(t *testing.T) {
	t.Parallel()
	now := func() time.Time { return time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC) }
	p := agentPolicy(t, "")
	west := p.Peer(westID)
	require.NoError(t, VerifyAgentPodCertificate(west, agentPod(livePod), now(), nil, now))

	other := agentPod(livePod)
	other.Namespace = "argo"
	require.Error(t, VerifyAgentPodCertificate(west, other, now(), nil, now), "not the agent's namespace")
	north := agentPod(livePod)
	north.Cluster = "spiffe://oc.example/cluster/north"
	require.Error(t, VerifyAgentPodCertificate(west, north, now(), nil, now), "not west's cluster")
	_, err := VerifyPodCertificate(p, agentPod(livePod), now(), nil, now)
	require.Equal(t, PodCertificatesOff, reason(t, err), "as a workload it would be refused")
}

// TestTheAgentsPodIsHeldToTheLastReport: with livePodsFromPeer the
// agent's Pod must be live as a workload's, in reports its cluster's
// client certificate makes (the report's route takes no pod
// certificate): a restarted agent's new Pod waits for the next report
// (503), a deleted one is refused once a report newer than its
// certificate leaves it out.
func TestTheAgentsPodIsHeldToTheLastReport(t *testing.T) {
	ctx := context.Background()
	at := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	now := func() time.Time { return at }
	p := agentPolicy(t, "{podCertificates: true, livePodsFromPeer: true, livePodsMaxAge: 1m}")
	west := p.Peer(westID)
	store := NewPeerKeyStore(fake.NewClientset().CoreV1(), "tokenbroker", zap.NewNop())
	first, restarted := agentPod(livePod), agentPod(newPod)
	firstMade := at.Add(-time.Hour)
	verify := func(w *pki.PodWorkload, made time.Time) error {
		return VerifyAgentPodCertificate(west, w, made, store, now)
	}
	report := func(uids ...string) {
		at = at.Add(MinReportInterval)
		_, err := store.ReportLivePods(ctx, p, westID, uids, at, &audit.Event{})
		require.NoError(t, err)
	}

	require.Equal(t, TokenPodsUnreported, reason(t, verify(first, firstMade)), "nothing reported")
	report(livePod, goneePod)
	require.NoError(t, verify(first, firstMade), "listed")

	// The agent restarts: a new Pod, whose certificate is newer than the
	// last report, waits for the next one.
	restartedMade := at.Add(2 * time.Second)
	at = restartedMade.Add(time.Second)
	require.Equal(t, PodNotReportedYet, reason(t, verify(restarted, restartedMade)))
	report(newPod, goneePod)
	require.NoError(t, verify(restarted, restartedMade))

	// The first Pod is gone: a report newer than its certificate leaves it out.
	require.Equal(t, TokenPodNotLive, reason(t, verify(first, firstMade)))

	// Reports stop for longer than livePodsMaxAge: every agent Pod is refused.
	at = at.Add(time.Minute + time.Second)
	require.Equal(t, TokenPodsUnreported, reason(t, verify(restarted, restartedMade)))
}
