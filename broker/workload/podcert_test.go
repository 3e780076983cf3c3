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

// westPod is what a pod certificate of west's argo/runner says, for the
// Pod of uid.
func westPod(uid string) *pki.PodWorkload {
	return &pki.PodWorkload{Cluster: westID, Identity: westID + "/ns/argo/sa/runner", Namespace: "argo", ServiceAccount: "runner",
		PodName: "runner-0", PodUID: uid}
}

func TestAPodCertificateIsAWorkloadOnlyWherePolicySaysSo(t *testing.T) {
	t.Parallel()
	now := func() time.Time { return time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC) }
	w := westPod(livePod)

	_, err := VerifyPodCertificate(nil, w, now(), nil, now)
	require.ErrorIs(t, err, policy.ErrNoPolicy)

	tokensOnly := livePodsPolicy(t, "")
	_, err = VerifyPodCertificate(tokensOnly, w, now(), nil, now)
	require.Equal(t, PodCertificatesOff, reason(t, err), "the peer trusts tokens, not pod certificates")
	require.Equal(t, problem.KindBadPodCertificate, kind(t, err))

	podsOnly := podCertificatePolicy(t, "{podCertificates: true}")
	got, err := VerifyPodCertificate(podsOnly, w, now(), nil, now)
	require.NoError(t, err)
	require.Equal(t, &Identity{Namespace: "argo", ServiceAccount: "runner", Pod: "runner-0", PodCertificate: true, PodUID: livePod}, got)
	require.True(t, got.Ref().Standalone, "it asks without the peer's certificate")

	other := westPod(livePod)
	other.Cluster = "spiffe://oc.example/cluster/north"
	_, err = VerifyPodCertificate(podsOnly, other, now(), nil, now)
	require.Equal(t, PodCertificatesOff, reason(t, err), "not a peer")

	// A peer that trusts pod certificates alone trusts no token.
	_, err = Verify(podsOnly, westID, newWestCluster(t).token(t, livePod, now()), nil, now)
	require.Equal(t, TokenNoTrust, reason(t, err))
}

// TestAPodCertificateIsHonouredOnlyWhileItsPodIsInAFreshReport: with
// livePodsFromPeer, as for a pod-bound token.
func TestAPodCertificateIsHonouredOnlyWhileItsPodIsInAFreshReport(t *testing.T) {
	ctx := context.Background()
	at := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	now := func() time.Time { return at }
	p := livePodsPolicy(t, ", livePodsFromPeer: true, podCertificates: true")
	store := NewPeerKeyStore(fake.NewClientset().CoreV1(), "tokenbroker", zap.NewNop())
	live, gone := westPod(livePod), westPod(goneePod)
	made := at.Add(-time.Hour)

	_, err := VerifyPodCertificate(p, live, made, nil, now)
	require.Equal(t, TokenPodsUnreported, reason(t, err), "no store, no report")
	_, err = VerifyPodCertificate(p, live, made, store, now)
	require.Equal(t, TokenPodsUnreported, reason(t, err))

	_, err = store.Upload(ctx, p, westID, newWestCluster(t).raw, at, &audit.Event{})
	require.NoError(t, err)
	_, err = store.ReportLivePods(ctx, p, westID, []string{livePod}, at, &audit.Event{})
	require.NoError(t, err)
	_, err = VerifyPodCertificate(p, live, made, store, now)
	require.NoError(t, err)
	_, err = VerifyPodCertificate(p, gone, made, store, now)
	require.Equal(t, TokenPodNotLive, reason(t, err), "made before the report, which leaves its Pod out")
	require.Contains(t, podCertificateDetails[TokenPodNotLive], "deleted")

	_, err = VerifyPodCertificate(p, gone, at.Add(time.Second), store, now)
	require.Equal(t, problem.KindUnavailable, kind(t, err), "made after the report: a Pod newer than it")
	require.Equal(t, PodNotReportedYet, reason(t, err))
}

func podCertificatePolicy(t *testing.T, wi string) *policy.Policy {
	t.Helper()
	p, err := policy.Parse([]byte(`
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: ` + westID + `
    workloadIdentity: ` + wi + `
    grants: [{namespaces: [argo], serviceAccounts: [runner], workloads: [{namespace: argo, serviceAccount: runner}]}]
`))
	require.NoError(t, err)
	return p
}
