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

const (
	// podRetryInterval is how soon a round that could not report (a
	// broker refused, or the Pods could not be read) is tried again.
	podRetryInterval = 2 * time.Second
	// podMinGap is the least time between two rounds: a burst of Pods
	// coming and going is reported once a second, not once a Pod (a
	// broker takes one report per peer every 500 ms).
	podMinGap = time.Second
	// podCallTimeout bounds one report to one broker, so that a broker
	// that does not answer delays the others by this much at most.
	podCallTimeout = 5 * time.Second
	// deletedPodLeeway is how long after a Pod's deletionTimestamp the
	// API server still honours its tokens (jwt.DefaultLeeway in
	// k8s.io/kubernetes/pkg/serviceaccount): the agent reports it as long.
	deletedPodLeeway = time.Minute
)

// podReporter tells brokers which Pods live in this cluster (their uids),
// so that they honour a Pod's token or pod certificate only while the Pod
// exists, as this cluster's API server does for a token: within a second when a Pod comes or goes,
// and every interval otherwise, which tells them the agent is alive. It
// vouches only for what it can see: a round whose informer has lost its
// watch, or whose fresh read of the Pods fails, reports nothing, and the
// brokers refuse this cluster's tokens once their last report is older
// than their livePodsMaxAge.
type podReporter struct {
	client     kubernetes.Interface
	brokers    map[string]podsAPI
	audiences  []string // a Pod is reported if it has a projected token for one,
	signerName string   // or a podCertificate volume of this signer ("": none),
	namespaces []string // and is in one of them; empty: any namespace
	interval   time.Duration
	clock      clock.Clock
	log        *zap.Logger

	changed chan struct{}        // a Pod came, went or started terminating
	last    map[string]podReport // per broker: what it accepted, and when

	// watchLost is set when the informer's list or watch fails, with the
	// resource version it had then; it is cleared once the informer has
	// listed or watched past it.
	mu        sync.Mutex
	watchLost bool
	lostAtRV  string
}

type podReport struct {
	uids []string
	at   time.Time
}

// newPodReporter reports the Pods with a projected token for one of
// audiences or, if signerName is set (the agent's podSigner), a
// podCertificate volume of that signer.
func newPodReporter(client kubernetes.Interface, brokers map[string]podsAPI, interval apiv1.Duration, audiences []string, signerName string, namespaces []string, clk clock.Clock, log *zap.Logger) *podReporter {
	return &podReporter{
		client: client, brokers: brokers, audiences: audiences, signerName: signerName, namespaces: namespaces, interval: time.Duration(interval),
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
		r.mu.Lock()
		r.watchLost, r.lostAtRV = true, inf.LastSyncResourceVersion()
		r.mu.Unlock()
		if ctx.Err() == nil {
			r.log.Warn("watch of the Pods failed; reporting nothing until it is back (brokers refuse this cluster's tokens if it lasts past their livePodsMaxAge)", zap.Error(err))
		}
	})
	notify := func() {
		select {
		case r.changed <- struct{}{}:
		default:
		}
	}
	// Any event is a list or watch that worked: the view is current again.
	seen := func() {
		r.mu.Lock()
		r.watchLost = false
		r.mu.Unlock()
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { seen(); notify() },
		DeleteFunc: func(any) { seen(); notify() },
		UpdateFunc: func(oldObj, newObj any) {
			seen()
			o, ok1 := oldObj.(*corev1.Pod)
			n, ok2 := newObj.(*corev1.Pod)
			if ok1 && ok2 && (o.DeletionTimestamp == nil) != (n.DeletionTimestamp == nil) {
				notify() // terminating: leaves the report deletedPodLeeway later
			}
		},
	})
	factory.Start(ctx.Done())
	defer factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return
	}
	for {
		round := r.clock.Now()
		retry := r.reportOnce(ctx, inf)
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
		// At most one round a podMinGap; a change after a quiet spell goes
		// out at once (a new Pod's token is refused until it is reported).
		if gap := podMinGap - r.clock.Since(round); gap > 0 {
			select {
			case <-ctx.Done():
				return
			case <-r.clock.After(gap):
			}
		}
	}
}

// trim keeps of a Pod only what the reporter reads: the informer's cache
// holds every Pod of the cluster. (Tombstones are not transformed.) It is
// idempotent, as client-go requires: the informer may pass an object it
// already transformed (client-go 0.37 does at its first list against a
// real API server), which must keep its mark. A trimmed Pod has no
// container, which no Pod of the API server lacks.
func (r *podReporter) trim(obj any) (any, error) {
	pod, ok := obj.(*corev1.Pod)
	if !ok || len(pod.Spec.Containers) == 0 {
		return obj, nil
	}
	out := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID, ResourceVersion: pod.ResourceVersion,
		DeletionTimestamp: pod.DeletionTimestamp,
	}}
	if r.wanted(pod) {
		out.Labels = map[string]string{reportedLabel: "true"}
	}
	return out, nil
}

// reportedLabel marks, in the informer's cache only, a Pod that trim
// found to be reported.
const reportedLabel = "tokenbroker.io/reported"

// wanted says whether pod can hold a credential for the brokers: it is in
// one of the namespaces, and one of its projected volumes is a
// serviceAccountToken for one of the audiences or a podCertificate of the
// agent's signer (whose certificates the brokers check against the report
// as they do tokens).
func (r *podReporter) wanted(pod *corev1.Pod) bool {
	if len(r.namespaces) > 0 && !slices.Contains(r.namespaces, pod.Namespace) {
		return false
	}
	for _, v := range pod.Spec.Volumes {
		if v.Projected == nil {
			continue
		}
		for _, s := range v.Projected.Sources {
			if s.ServiceAccountToken != nil && slices.Contains(r.audiences, s.ServiceAccountToken.Audience) {
				return true
			}
			if s.PodCertificate != nil && r.signerName != "" && s.PodCertificate.SignerName == r.signerName {
				return true
			}
		}
	}
	return false
}

// canVouch says whether the informer's view of the Pods is current: its
// watch has not failed since it last listed or watched, and a fresh read
// of the Pods works now (the API server is reachable and still lets the
// agent list them).
func (r *podReporter) canVouch(ctx context.Context, inf cache.SharedIndexInformer) bool {
	r.mu.Lock()
	if r.watchLost && inf.LastSyncResourceVersion() != r.lostAtRV {
		r.watchLost = false
	}
	lost := r.watchLost
	r.mu.Unlock()
	if lost {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, podCallTimeout)
	defer cancel()
	if _, err := r.client.CoreV1().Pods("").List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
		r.log.Warn("cannot read the Pods; reporting nothing until it can", zap.Error(err))
		return false
	}
	return true
}

// reportOnce sends the live Pods in inf's cache to every broker that has
// not accepted this report within the interval. It returns true if the
// round must be tried again soon.
func (r *podReporter) reportOnce(ctx context.Context, inf cache.SharedIndexInformer) (retry bool) {
	if !r.canVouch(ctx, inf) {
		return true
	}
	now := r.clock.Now()
	var uids []string
	for _, obj := range inf.GetStore().List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok || pod.Labels[reportedLabel] != "true" {
			continue
		}
		if pod.DeletionTimestamp != nil && now.After(pod.DeletionTimestamp.Add(deletedPodLeeway)) {
			continue // its tokens are invalid at its API server too
		}
		uids = append(uids, string(pod.UID))
	}
	slices.Sort(uids)
	if uids == nil {
		uids = []string{}
	}
	if len(uids) > apiv1.MaxLivePods {
		r.log.Error("more Pods to report than a broker accepts; narrow jwksUpload.livePods (audiences, namespaces): brokers refuse this cluster's tokens and pod certificates until then",
			zap.Int("pods", len(uids)), zap.Int("max", apiv1.MaxLivePods))
		return false
	}
	for url, api := range r.brokers {
		last := r.last[url]
		if slices.Equal(last.uids, uids) && now.Sub(last.at) < r.interval {
			continue
		}
		callCtx, cancel := context.WithTimeout(ctx, podCallTimeout)
		resp, err := api.PutPods(callCtx, uids)
		cancel()
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
