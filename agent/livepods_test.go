package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// fakePodsBroker records the reports it accepts; it refuses while fail.
type fakePodsBroker struct {
	mu      sync.Mutex
	reports [][]string
	fail    bool
}

func (f *fakePodsBroker) PutPods(_ context.Context, uids []string) (*apiv1.PeerLivePods, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail {
		return nil, errors.New("upload your cluster's key set first")
	}
	f.reports = append(f.reports, slices.Clone(uids))
	return &apiv1.PeerLivePods{Pods: len(uids)}, nil
}

func (f *fakePodsBroker) snapshot() [][]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.reports)
}

func (f *fakePodsBroker) setFail(v bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail = v
}

// pod is a Pod with uid n in namespace argo and, if audience is set, a
// projected token for it (as a Pod that runs tokenbroker credential has).
func pod(n int, audience string) *corev1.Pod {
	// A container, as the API server requires of every Pod.
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("p%d", n), Namespace: "argo", UID: types.UID(podUID(n))},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "registry.invalid/none"}}}}
	if audience != "" {
		p.Spec.Volumes = []corev1.Volume{{Name: "token", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
			Sources: []corev1.VolumeProjection{{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Audience: audience, Path: "token"}}},
		}}}}
	}
	return p
}

func podUID(n int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012d", n) }

// reporterRun is a podReporter running against a fake clientset (the
// informer's plumbing; what the API server decides is in the e2e tests)
// with a fake clock.
type reporterRun struct {
	client *fake.Clientset
	clk    *fakeClock
	broker *fakePodsBroker
	// listFails makes every list of Pods fail (the API server out of
	// reach, or the agent's RBAC gone).
	listFails atomic.Bool
}

func startReporter(t *testing.T, namespaces []string, pods ...*corev1.Pod) *reporterRun {
	t.Helper()
	return startReporterFor(t, "", namespaces, pods...)
}

// startReporterFor is startReporter for an agent whose podSigner signs for
// signerName ("": none).
func startReporterFor(t *testing.T, signerName string, namespaces []string, pods ...*corev1.Pod) *reporterRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &reporterRun{clk: newFakeClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)), broker: &fakePodsBroker{}}
	objs := make([]runtime.Object, len(pods))
	for i, p := range pods {
		objs[i] = p
	}
	r.client = fake.NewClientset(objs...)
	r.client.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		if r.listFails.Load() {
			return true, nil, errors.New("the API server is out of reach")
		}
		return false, nil, nil
	})
	rep := newPodReporter(r.client, map[string]podsAPI{"https://east": r.broker}, apiv1.Duration(30*time.Second),
		[]string{"tokenbroker.east"}, signerName, namespaces, r.clk, zap.NewNop())
	done := make(chan struct{})
	go func() { rep.run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return r
}

// lastIs steps the clock a second at a time (the reporter's least gap
// between rounds) until the last report is want.
func (r *reporterRun) lastIs(t *testing.T, msg string, want ...string) {
	t.Helper()
	require.Eventually(t, func() bool {
		got := r.broker.snapshot()
		if len(got) > 0 && slices.Equal(got[len(got)-1], want) {
			return true
		}
		if r.clk.HasWaiters() {
			r.clk.Step(podMinGap)
		}
		return false
	}, 10*time.Second, 5*time.Millisecond, "%s: got %v", msg, r.broker.snapshot())
}

func TestThePodsThatCanHoldATokenForTheBrokerAreReportedOnChangeAndOnInterval(t *testing.T) {
	t.Parallel()
	r := startReporter(t, nil, pod(1, "tokenbroker.east"), pod(2, "tokenbroker.east"), pod(3, ""), pod(4, "vault"))
	ctx := context.Background()
	r.lastIs(t, "at start, after the first list: the Pods with a projected token for the broker", podUID(1), podUID(2))

	require.NoError(t, r.client.CoreV1().Pods("argo").Delete(ctx, "p2", metav1.DeleteOptions{}))
	r.lastIs(t, "a deleted Pod is left out within a second", podUID(1))

	_, err := r.client.CoreV1().Pods("argo").Create(ctx, pod(5, "tokenbroker.east"), metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = r.client.CoreV1().Pods("argo").Create(ctx, pod(6, ""), metav1.CreateOptions{})
	require.NoError(t, err)
	r.lastIs(t, "a new Pod is added; one without the broker's token is not", podUID(1), podUID(5))

	sent := len(r.broker.snapshot())
	require.Eventually(t, func() bool {
		if r.clk.HasWaiters() {
			r.clk.Step(podMinGap)
		}
		return len(r.broker.snapshot()) > sent
	}, 10*time.Second, 5*time.Millisecond, "an unchanged report is sent again within the interval")
	require.Equal(t, []string{podUID(1), podUID(5)}, r.broker.snapshot()[sent])
}

// TestATerminatingPodIsReportedAsLongAsItsAPIServerHonoursItsToken: the
// API server honours a Pod's token until a minute after its
// deletionTimestamp (a Pod held by a finalizer, or on a lost node, stays
// Terminating); the report leaves it out from then on.
func TestATerminatingPodIsReportedAsLongAsItsAPIServerHonoursItsToken(t *testing.T) {
	t.Parallel()
	r := startReporter(t, nil, pod(1, "tokenbroker.east"), pod(2, "tokenbroker.east"))
	r.lastIs(t, "both", podUID(1), podUID(2))
	terminating := pod(2, "tokenbroker.east")
	terminating.DeletionTimestamp = &metav1.Time{Time: r.clk.Now()}
	_, err := r.client.CoreV1().Pods("argo").Update(context.Background(), terminating, metav1.UpdateOptions{})
	require.NoError(t, err)
	r.lastIs(t, "a minute after its deletionTimestamp", podUID(1))
	require.GreaterOrEqual(t, r.clk.Since(terminating.DeletionTimestamp.Time), deletedPodLeeway)
}

// TestTheAgentVouchesOnlyForPodsItCanSee: when the Pods cannot be read
// (the API server out of reach, the agent's RBAC removed), the agent
// reports nothing, even unchanged, so that the brokers stop honouring the
// cluster's tokens once their last report is stale, rather than hear that
// a Pod it can no longer see still lives.
func TestTheAgentVouchesOnlyForPodsItCanSee(t *testing.T) {
	t.Parallel()
	r := startReporter(t, nil, pod(1, "tokenbroker.east"), pod(2, "tokenbroker.east"))
	r.lastIs(t, "both", podUID(1), podUID(2))
	r.listFails.Store(true)
	sent := len(r.broker.snapshot())
	for range 5 * 30 { // five intervals
		require.Eventually(t, r.clk.HasWaiters, 10*time.Second, time.Millisecond)
		r.clk.Step(podMinGap)
	}
	require.Len(t, r.broker.snapshot(), sent, "no report while the Pods cannot be read")
	r.listFails.Store(false)
	r.lastIs(t, "reported again once they can", podUID(1), podUID(2))
}

func TestOnlyTheNamespacesGivenAreReportedAndTooManyPodsAreNot(t *testing.T) {
	t.Parallel()
	other := pod(9, "tokenbroker.east")
	other.Namespace = "tenant-a"
	r := startReporter(t, []string{"argo"}, pod(1, "tokenbroker.east"), other)
	r.lastIs(t, "only argo's", podUID(1))

	// Over the bound nothing is sent: the broker then refuses the
	// cluster's tokens once the last report is stale, as it must, rather
	// than honour Pods that were cut off the list.
	for i := 2; i <= apiv1.MaxLivePods+1; i++ {
		_, err := r.client.CoreV1().Pods("argo").Create(context.Background(), pod(i, "tokenbroker.east"), metav1.CreateOptions{})
		require.NoError(t, err)
	}
	for range 40 {
		require.Eventually(t, r.clk.HasWaiters, 10*time.Second, time.Millisecond)
		r.clk.Step(podMinGap)
	}
	for _, rep := range r.broker.snapshot() {
		require.LessOrEqual(t, len(rep), apiv1.MaxLivePods)
	}
}

func TestLivePodsIsValidatedAndDefaulted(t *testing.T) {
	t.Parallel()
	_, err := config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], livePods: {interval: 1h, audiences: [" "], namespaces: [Argo]}}
`), "")
	require.ErrorContains(t, err, "jwksUpload.livePods.interval")
	require.ErrorContains(t, err, "jwksUpload.livePods.audiences[0]")
	require.ErrorContains(t, err, "jwksUpload.livePods.namespaces[0]")
	_, err = config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], livePods: {}}
`), "")
	require.ErrorContains(t, err, "jwksUpload.livePods.audiences", "audiences are required")
	_, err = config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], livePods: {pods: []}}
`), "")
	require.ErrorContains(t, err, "pods", "an unknown field")
	cfg, err := config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], livePods: {audiences: [tokenbroker.east]}}
`), "")
	require.NoError(t, err, "every namespace, at the default interval")
	require.Equal(t, config.DefaultLivePodsInterval, time.Duration(cfg.JWKSUpload.LivePods.Interval))
	require.Empty(t, cfg.JWKSUpload.LivePods.Namespaces)
}
