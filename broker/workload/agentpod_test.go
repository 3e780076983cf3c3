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
	"github.com/tokenbroker/tokenbroker/broker/problem"
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
	require.NoError(t, VerifyAgentPodCertificate(west, agentPod(livePod), now(), nil, now, false))

	other := agentPod(livePod)
	other.Namespace = "argo"
	require.Error(t, VerifyAgentPodCertificate(west, other, now(), nil, now, false), "not the agent's namespace")
	north := agentPod(livePod)
	north.Cluster = "spiffe://oc.example/cluster/north"
	require.Error(t, VerifyAgentPodCertificate(west, north, now(), nil, now, false), "not west's cluster")
	_, err := VerifyPodCertificate(p, agentPod(livePod), now(), nil, now)
	require.Equal(t, PodCertificatesOff, reason(t, err), "as a workload it would be refused")
}

// TestTheAgentsPodIsHeldToTheLastReportButForTheReportItself: with
// livePodsFromPeer the agent's Pod must be live as a workload's, except
// in the report, which a new agent Pod must be able to make; a Pod that a
// report newer than its certificate leaves out (deleted) cannot report
// itself back.
func TestTheAgentsPodIsHeldToTheLastReportButForTheReportItself(t *testing.T) {
	ctx := context.Background()
	at := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	now := func() time.Time { return at }
	p := agentPolicy(t, "{podCertificates: true, livePodsFromPeer: true, livePodsMaxAge: 1m}")
	west := p.Peer(westID)
	store := NewPeerKeyStore(fake.NewClientset().CoreV1(), "tokenbroker", zap.NewNop())
	first, restarted := agentPod(livePod), agentPod(newPod)
	firstMade := at.Add(-time.Hour)
	verify := func(w *pki.PodWorkload, made time.Time, reporting bool) error {
		return VerifyAgentPodCertificate(west, w, made, store, now, reporting)
	}
	report := func(agent string, uids ...string) error {
		at = at.Add(MinReportInterval)
		_, err := store.ReportLivePods(ctx, p, westID, uids, agent, at, &audit.Event{})
		return err
	}

	err := verify(first, firstMade, false)
	require.Equal(t, TokenPodsUnreported, reason(t, err), "nothing reported: no request but the report")
	require.NoError(t, verify(first, firstMade, true), "the first report needs none before it")
	err = report(livePod, goneePod)
	require.Equal(t, problem.KindUnprocessable, kind(t, err), "a report that leaves out the agent that makes it")
	require.ErrorContains(t, err, livePod)
	require.NoError(t, report(livePod, livePod, goneePod))
	require.NoError(t, verify(first, firstMade, false), "listed: every request")

	// The agent restarts: a new Pod, whose certificate is newer than the
	// last report. It may report at once, and nothing else until then.
	restartedMade := at.Add(2 * time.Second)
	at = restartedMade.Add(time.Second)
	err = verify(restarted, restartedMade, false)
	require.Equal(t, PodNotReportedYet, reason(t, err))
	require.NoError(t, verify(restarted, restartedMade, true))
	require.NoError(t, report(newPod, newPod, goneePod))
	require.NoError(t, verify(restarted, restartedMade, false))

	// The first Pod is gone: a report newer than its certificate leaves
	// it out, so it may not report itself back.
	err = verify(first, firstMade, false)
	require.Equal(t, TokenPodNotLive, reason(t, err))
	err = verify(first, firstMade, true)
	require.Equal(t, TokenPodNotLive, reason(t, err), "a deleted agent Pod cannot put itself back in the report")

	// Once the reports stop for longer than livePodsMaxAge, any agent Pod
	// whose certificate is good may report (the cluster is never locked
	// out), and nothing else.
	at = at.Add(time.Minute + time.Second)
	err = verify(restarted, restartedMade, false)
	require.Equal(t, TokenPodsUnreported, reason(t, err))
	require.NoError(t, verify(restarted, restartedMade, true))
	require.NoError(t, verify(first, firstMade, true))
}

// TestTheAgentsReportNeedsNoKeySetFirst: with token trust a report waits
// for the key set, but not the agent's pod certificate's, whose upload of
// the key set waits for a report that lists its Pod.
func TestTheAgentsReportNeedsNoKeySetFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	at := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	p := agentPolicy(t, `{issuer: "`+westIss+`", audiences: [`+audience+`], jwksFromPeer: true, requirePodBinding: true, livePodsFromPeer: true}`)
	store := NewPeerKeyStore(fake.NewClientset().CoreV1(), "tokenbroker", zap.NewNop())
	_, err := store.ReportLivePods(ctx, p, westID, []string{livePod}, "", at, &audit.Event{})
	require.Equal(t, problem.KindUnprocessable, kind(t, err), "the peer's client certificate uploads keys first")
	resp, err := store.ReportLivePods(ctx, p, westID, []string{livePod}, livePod, at.Add(time.Second), &audit.Event{})
	require.NoError(t, err)
	require.Equal(t, 1, resp.Pods)
	reasonCode, _ := store.LivePod("west", westID, livePod, at.Add(time.Second), time.Minute)
	require.Empty(t, reasonCode)

	// The key set then joins the report in the same Secret.
	_, err = store.Upload(ctx, p, westID, newWestCluster(t).raw, at.Add(2*time.Second), &audit.Event{})
	require.NoError(t, err)
	reasonCode, _ = store.LivePod("west", westID, livePod, at.Add(2*time.Second), time.Minute)
	require.Empty(t, reasonCode, "the report is kept")
	require.NotNil(t, store.Keys("west", westID, at.Add(2*time.Second), time.Hour))
}
