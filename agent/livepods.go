package agent

import (
	"context"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// podsAPI is what the Pod reporter needs of a broker.
type podsAPI interface {
	PutPods(ctx context.Context, uids []string) (*apiv1.PeerLivePods, error)
}

// podRetryInterval is how soon a report a broker refused (not reachable,
// or the key set not uploaded yet) is sent again.
const podRetryInterval = 2 * time.Second

// podReporter tells brokers which Pods live in this cluster (their uids),
// so that they honour a Pod's token only while the Pod exists, as this
// cluster's API server does: at once when a Pod comes or goes, and every
// interval otherwise, which tells them the agent is alive.
type podReporter struct {
	client    kubernetes.Interface
	brokers   map[string]podsAPI
	audiences []string // a Pod is reported if it has a projected token for one; empty: every Pod
	interval  time.Duration
	clock     clock.Clock
	log       *zap.Logger

	changed chan struct{} // a Pod came or went since the last report
	mu      sync.Mutex
	last    map[string]podReport // per broker: what it accepted, and when
}

type podReport struct {
	uids []string
	at   time.Time
}

func newPodReporter(client kubernetes.Interface, brokers map[string]podsAPI, cfg apiv1.Duration, audiences []string, clk clock.Clock, log *zap.Logger) *podReporter {
	return &podReporter{
		client: client, brokers: brokers, audiences: audiences, interval: time.Duration(cfg),
		clock: clk, log: log, changed: make(chan struct{}, 1), last: map[string]podReport{},
	}
}

// run watches the Pods of every namespace and reports them until ctx is
// done. Nothing is reported before the first list: an empty report would
// refuse every token.
func (r *podReporter) run(ctx context.Context) {
	factory := informers.NewSharedInformerFactoryWithOptions(r.client, 0, informers.WithTransform(r.trim))
	inf := factory.Core().V1().Pods().Informer()
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if ctx.Err() == nil {
			r.log.Warn("watch of the Pods failed; retrying (brokers refuse this cluster's tokens if it lasts past their livePodsMaxAge)", zap.Error(err))
		}
	})
	notify := func(any) {
		select {
		case r.changed <- struct{}{}:
		default:
		}
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    notify,
		DeleteFunc: notify,
		// An update changes neither a uid nor the volumes.
	})
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return
	}
	store := inf.GetStore()
	for {
		retry := r.reportOnce(ctx, store)
		wait := r.interval
		if retry {
			wait = min(wait, podRetryInterval)
		}
		select {
		case <-ctx.Done():
			return
		case <-r.changed:
		case <-r.clock.After(wait):
		}
	}
}

// trim keeps of a Pod only what the reporter reads, and nothing of a Pod
// it does not report: the informer's cache holds every Pod of the cluster.
func (r *podReporter) trim(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a tombstone
	}
	out := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID, ResourceVersion: pod.ResourceVersion,
	}}
	if r.wanted(pod) {
		out.Labels = map[string]string{reportedLabel: "true"}
	}
	return out, nil
}

// reportedLabel marks, in the informer's cache only, a Pod that trim
// found to be reported.
const reportedLabel = "tokenbroker.io/reported"

// wanted says whether pod can hold a token for the brokers: one of its
// projected serviceAccountToken volumes is for one of the audiences.
func (r *podReporter) wanted(pod *corev1.Pod) bool {
	if len(r.audiences) == 0 {
		return true
	}
	for _, v := range pod.Spec.Volumes {
		if v.Projected == nil {
			continue
		}
		for _, s := range v.Projected.Sources {
			if s.ServiceAccountToken != nil && slices.Contains(r.audiences, s.ServiceAccountToken.Audience) {
				return true
			}
		}
	}
	return false
}

// reportOnce sends the Pods in store to every broker that has not
// accepted this report within the interval. It returns true if a broker
// must be retried soon.
func (r *podReporter) reportOnce(ctx context.Context, store cache.Store) (retry bool) {
	var uids []string
	for _, obj := range store.List() {
		if pod, ok := obj.(*corev1.Pod); ok && pod.Labels[reportedLabel] == "true" {
			uids = append(uids, string(pod.UID))
		}
	}
	slices.Sort(uids)
	if uids == nil {
		uids = []string{}
	}
	if len(uids) > apiv1.MaxLivePods {
		r.log.Error("more Pods to report than a broker accepts; narrow jwksUpload.livePods.audiences (brokers refuse this cluster's tokens until then)",
			zap.Int("pods", len(uids)), zap.Int("max", apiv1.MaxLivePods))
		return false
	}
	now := r.clock.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	for url, api := range r.brokers {
		last := r.last[url]
		if slices.Equal(last.uids, uids) && now.Sub(last.at) < r.interval {
			continue
		}
		resp, err := api.PutPods(ctx, uids)
		if err != nil {
			r.log.Warn("Pod report failed; retrying", zap.String("broker", url), zap.Error(err))
			retry = true
			continue
		}
		if !slices.Equal(last.uids, uids) {
			r.log.Debug("Pods reported", zap.String("broker", url), zap.Int("pods", resp.Pods), zap.Time("valid_until", resp.ValidUntil))
		}
		r.last[url] = podReport{uids: uids, at: now}
	}
	return retry
}
