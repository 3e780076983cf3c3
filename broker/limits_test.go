package broker

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/workload"
)

func newLimitsEnv(t *testing.T, pol string) (*env, *clocktesting.FakeClock) {
	t.Helper()
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	client := fake.NewClientset()
	iss := &fakeIssuer{}
	b, err := New(Config{
		Secrets: client.CoreV1(),
		Issuers: map[string]Issuer{apiv1.CredentialToken: iss},
		Policy:  policy.NewStore(mustPolicy(t, pol)),
		Logger:  zap.NewNop(),
		Clock:   clk,
	})
	require.NoError(t, err)
	return &env{b: b, client: client, iss: iss}, clk
}

func TestAPeerOverItsIssuanceRateGets429WithRetryAfterAndNothingIsCreated(t *testing.T) {
	t.Parallel()
	e, clk := newLimitsEnv(t, limitsPolicy)
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec
	req := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"}
	ctx := context.Background()
	for range 2 {
		_, err := e.b.IssueKubeconfig(ctx, west, req)
		require.NoError(t, err, "the burst")
	}
	_, err := e.b.IssueKubeconfig(ctx, west, req)
	require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err))
	require.Equal(t, 30*time.Second, problem.RetryAfterOf(err), "2 a minute: a token every 30s")
	require.Contains(t, err.Error(), "peer west is over its limit of 2 issuances a minute (burst 2); retry in 30s")
	require.Equal(t, 2, e.leaseCount(t), "nothing created")
	evs := rec.all()
	require.Equal(t, audit.DecisionDeny, evs[len(evs)-1].Decision, "the refusal is audited")

	south := Caller{Identity: "spiffe://oc.example/cluster/south"}
	for range 5 {
		_, err := e.b.IssueKubeconfig(ctx, south, req)
		require.NoError(t, err, "another peer has its own bucket, and its own limits")
	}

	clk.Step(29 * time.Second)
	_, err = e.b.IssueKubeconfig(ctx, west, req)
	require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err))
	require.InDelta(t, float64(time.Second), float64(problem.RetryAfterOf(err)), float64(time.Millisecond))
	clk.Step(time.Second)
	_, err = e.b.IssueKubeconfig(ctx, west, req)
	require.NoError(t, err, "after Retry-After")
}

func TestLimitsAreValidatedWithTheirPaths(t *testing.T) {
	t.Parallel()
	_, err := policy.Parse([]byte(`
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
limits: {issuancesPerMinute: 0, maxLiveLeases: 2000000}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    limits: {burst: -1, enrollmentsPerMinute: 5}
`))
	require.Error(t, err)
	for _, want := range []string{
		"limits.issuancesPerMinute: must be between 1 and 1000000",
		"limits.maxLiveLeases: must be between 1 and 1000000",
		"peers[0].limits.burst: must be between 1 and 1000000",
		"peers[0].limits.enrollmentsPerMinute: is a top-level limit",
	} {
		require.Contains(t, err.Error(), want)
	}
}

func TestEnrollmentsAreLimitedPerAddressAndPerJoinToken(t *testing.T) {
	t.Parallel()
	e, clk := newLimitsEnv(t, `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
limits: {enrollmentsPerMinute: 1}
`)
	require.NoError(t, e.b.admission().Enrollment(e.b.cfg.Policy.Load(), "192.0.2.1", "token-a", nil))
	err := e.b.admission().Enrollment(e.b.cfg.Policy.Load(), "192.0.2.1", "token-b", nil)
	require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err), "the same address")
	err = e.b.admission().Enrollment(e.b.cfg.Policy.Load(), "192.0.2.2", "token-a", nil)
	require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err), "the same token from another address")
	require.NoError(t, e.b.admission().Enrollment(e.b.cfg.Policy.Load(), "192.0.2.3", "token-c", nil))
	clk.Step(time.Minute)
	require.NoError(t, e.b.admission().Enrollment(e.b.cfg.Policy.Load(), "192.0.2.1", "token-b", nil))
}

// BenchmarkAdmitLease is the limits' cost on an issuance: the quota
// reservation, the token bucket and the place's commit, with 1,000 leases
// counted. Compare it with an issuance's milliseconds (make bench).
func BenchmarkAdmitLease(b *testing.B) {
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	p, err := policy.Parse([]byte(limitsPolicy + "\n"))
	require.NoError(b, err)
	lim := 1000000
	p.Limits = &policy.LimitsSpec{IssuancesPerMinute: &lim, Burst: &lim, MaxLiveLeases: &lim}
	lc := lease.NewCounter(nil, clk, zap.NewNop())
	for i := range 1000 {
		lc.Observe(leaseMeta("argo", fmt.Sprintf("tokenbroker-lease-%d", i), "west", clk.Now().Add(time.Hour)))
	}
	bk, err := New(Config{Secrets: fake.NewClientset().CoreV1(), Policy: policy.NewStore(p), Logger: zap.NewNop(), Clock: clk, Leases: lc, MaxLiveLeases: lim})
	require.NoError(b, err)
	b.ReportAllocs()
	for b.Loop() {
		clk.Step(time.Millisecond) // the bucket refills as on a busy broker
		pl, err := bk.admission().Lease(p, west.Identity, west.Identity, "west", nil)
		if err != nil {
			b.Fatal(err)
		}
		pl.Release()
	}
}

// leaseMeta is a lease Secret's metadata as the counter's watch sees it.
func leaseMeta(ns, name, peer string, expires time.Time) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{
		Namespace: ns, Name: name, Labels: map[string]string{objects.LabelPeer: peer, objects.LabelKind: objects.LeaseKind},
		Annotations: map[string]string{objects.AnnotationExpiresAt: expires.UTC().Format(time.RFC3339)},
	}}
}

// TestAPodCertificatesWorkloadHasBucketsOfItsOwn: a workload that proved
// itself with its own pod certificate takes from buckets of its own, with
// its peer's figures, so that draining them never refuses the peer's
// agent; a workload that asks over the peer's connection (a token) takes
// from the peer's.
func TestAPodCertificatesWorkloadHasBucketsOfItsOwn(t *testing.T) {
	t.Parallel()
	e, _ := newLimitsEnv(t, `cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
limits: {issuancesPerMinute: 2, burst: 2}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    workloadIdentity: {podCertificates: true}
    grants:
      - {namespaces: [argo], serviceAccounts: [runner]}
      - {namespaces: [argo], serviceAccounts: [runner], workloads: [{namespace: argo, serviceAccount: app}]}
`)
	ctx := context.Background()
	req := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"}
	app := Caller{Identity: west.Identity, Workload: &workload.Identity{Namespace: "argo", ServiceAccount: "app", PodCertificate: true,
		PodUID: "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54"}}
	for range 2 {
		_, err := e.b.IssueKubeconfig(ctx, app, req)
		require.NoError(t, err, "the workload's burst")
	}
	_, err := e.b.IssueKubeconfig(ctx, app, req)
	require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err), "the workload is over its own bucket")
	for range 2 {
		_, err := e.b.IssueKubeconfig(ctx, west, req)
		require.NoError(t, err, "the peer's agent is not refused: its bucket is its own")
	}
	_, err = e.b.IssueKubeconfig(ctx, west, req)
	require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err))
	require.Equal(t, "spiffe://oc.example/cluster/west/ns/argo/sa/app", limitKey(app))
	tokenApp := Caller{Identity: west.Identity, Workload: &workload.Identity{Namespace: "argo", ServiceAccount: "app"}}
	require.Equal(t, west.Identity, limitKey(tokenApp), "a token's workload asks over the peer's connection")
}

// TestAPodCertificatesIssuanceIsAuditedWithItsPodsUID: the audit event of
// a pod certificate's issuance names its Pod's uid, the one
// "tokenbroker pki revoke --pod-uid" takes.
func TestAPodCertificatesIssuanceIsAuditedWithItsPodsUID(t *testing.T) {
	t.Parallel()
	e, _ := newLimitsEnv(t, `cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    workloadIdentity: {podCertificates: true}
    grants: [{namespaces: [argo], serviceAccounts: [runner], workloads: [{namespace: argo, serviceAccount: app}]}]
`)
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec
	app := Caller{Identity: west.Identity, Workload: &workload.Identity{Namespace: "argo", ServiceAccount: "app", Pod: "app-0",
		PodCertificate: true, PodUID: "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54"}}
	_, err := e.b.IssueKubeconfig(context.Background(), app, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	require.NoError(t, err)
	evs := rec.all()
	ev := evs[len(evs)-1]
	require.Equal(t, audit.DecisionAllow, ev.Decision)
	require.Equal(t, "argo/app", ev.Workload)
	require.Equal(t, "app-0", ev.WorkloadPod)
	require.Equal(t, "6f1c2a9e-3b1d-4c55-9a1e-2f0d8c7b6a54", ev.WorkloadPodUID)
}
