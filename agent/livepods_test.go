package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

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

// pod is a Pod with uid n and, if audience is set, a projected token for
// it (as a Pod that runs tokenbroker credential has).
func pod(n int, audience string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("p%d", n), Namespace: "argo", UID: types.UID(podUID(n))}}
	if audience != "" {
		p.Spec.Volumes = []corev1.Volume{{Name: "token", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
			Sources: []corev1.VolumeProjection{{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Audience: audience, Path: "token"}}},
		}}}}
	}
	return p
}

func podUID(n int) string { return fmt.Sprintf("00000000-0000-4000-8000-%012d", n) }

// TestThePodsThatCanHoldATokenForTheBrokerAreReportedOnChangeAndOnInterval
// runs the reporter against a fake clientset (the informer's plumbing; what
// the API server decides is in the e2e tests) with a fake clock.
func TestThePodsThatCanHoldATokenForTheBrokerAreReportedOnChangeAndOnInterval(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := fake.NewClientset(pod(1, "tokenbroker.east"), pod(2, "tokenbroker.east"), pod(3, ""), pod(4, "vault"))
	clk := newFakeClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	b := &fakePodsBroker{}
	r := newPodReporter(client, map[string]podsAPI{"https://east": b}, apiv1.Duration(30*time.Second), []string{"tokenbroker.east"}, clk, zap.NewNop())
	done := make(chan struct{})
	go func() { r.run(ctx); close(done) }()
	reportsAre := func(msg string, want ...[]string) {
		t.Helper()
		require.Eventually(t, func() bool { return slices.EqualFunc(b.snapshot(), want, slices.Equal) }, 10*time.Second, 5*time.Millisecond,
			"%s: got %v", msg, b.snapshot())
	}

	reportsAre("at start, after the first list: the Pods with a projected token for the broker",
		[]string{podUID(1), podUID(2)})

	require.NoError(t, client.CoreV1().Pods("argo").Delete(ctx, "p2", metav1.DeleteOptions{}))
	reportsAre("a deleted Pod is left out at once, without waiting for the interval",
		[]string{podUID(1), podUID(2)}, []string{podUID(1)})

	_, err := client.CoreV1().Pods("argo").Create(ctx, pod(5, "tokenbroker.east"), metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = client.CoreV1().Pods("argo").Create(ctx, pod(6, ""), metav1.CreateOptions{})
	require.NoError(t, err)
	reportsAre("a new Pod is added at once; one without the broker's token is not",
		[]string{podUID(1), podUID(2)}, []string{podUID(1)}, []string{podUID(1), podUID(5)})

	require.Eventually(t, clk.HasWaiters, 10*time.Second, time.Millisecond)
	b.setFail(true)
	clk.Step(30 * time.Second)
	require.Eventually(t, clk.HasWaiters, 10*time.Second, time.Millisecond)
	b.setFail(false)
	clk.Step(podRetryInterval)
	reportsAre("an unchanged report is sent again every interval, and retried soon when refused",
		[]string{podUID(1), podUID(2)}, []string{podUID(1)}, []string{podUID(1), podUID(5)}, []string{podUID(1), podUID(5)})

	cancel()
	<-done
}

func TestWithoutAudiencesEveryPodIsReportedAndTooManyAreNot(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	client := fake.NewClientset(pod(1, ""), pod(2, "vault"))
	clk := newFakeClock(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	b := &fakePodsBroker{}
	r := newPodReporter(client, map[string]podsAPI{"https://east": b}, apiv1.Duration(30*time.Second), nil, clk, zap.NewNop())
	go r.run(ctx)
	require.Eventually(t, func() bool {
		return slices.EqualFunc(b.snapshot(), [][]string{{podUID(1), podUID(2)}}, slices.Equal)
	}, 10*time.Second, 5*time.Millisecond)

	// Over the bound nothing is sent: the broker then refuses the
	// cluster's tokens once the last report is stale, as it must, rather
	// than honour Pods that were cut off the list.
	for i := 3; i <= apiv1.MaxLivePods+1; i++ {
		_, err := client.CoreV1().Pods("argo").Create(ctx, pod(i, ""), metav1.CreateOptions{})
		require.NoError(t, err)
	}
	require.Eventually(t, clk.HasWaiters, 10*time.Second, time.Millisecond)
	clk.Step(30 * time.Second)
	require.Eventually(t, clk.HasWaiters, 10*time.Second, time.Millisecond)
	for _, rep := range b.snapshot() {
		require.LessOrEqual(t, len(rep), apiv1.MaxLivePods)
	}
}

func TestLivePodsIsValidatedAndDefaulted(t *testing.T) {
	t.Parallel()
	_, err := config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], livePods: {interval: 1h, audiences: [" "]}}
`), "")
	require.ErrorContains(t, err, "jwksUpload.livePods.interval")
	require.ErrorContains(t, err, "jwksUpload.livePods.audiences[0]")
	_, err = config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], livePods: {pods: []}}
`), "")
	require.ErrorContains(t, err, "pods", "an unknown field")
	cfg, err := config.Parse([]byte(`
identity: {dir: /id}
jwksUpload: {brokers: ["https://east:8443"], livePods: {}}
`), "")
	require.NoError(t, err, "every Pod, at the default interval")
	require.Equal(t, config.DefaultLivePodsInterval, time.Duration(cfg.JWKSUpload.LivePods.Interval))
	require.Empty(t, cfg.JWKSUpload.LivePods.Audiences)
}
