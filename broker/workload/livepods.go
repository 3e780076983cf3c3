package workload

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// A peer whose policy says workloadIdentity.livePodsFromPeer reports the
// Pods that live in its cluster (its agent watches them), and the broker
// honours a pod-bound token only while its Pod's uid is in the last
// report, and only while that report is fresh: the check the peer
// cluster's own API server makes of a bound token (the Pod must exist),
// which the broker cannot ask it for.
const (
	// PeerLivePodsKey holds the last report, a JSON array of uids.
	PeerLivePodsKey = "live-pods.json"
	// AnnotationPodsReportedAt is when it was made (RFC 3339, ns).
	AnnotationPodsReportedAt = "tokenbroker.io/pods-reported-at"
	// MaxLivePods bounds one report: a peer scopes its agent (by the
	// audience of its Pods' projected tokens, and their namespaces) to the
	// Pods that use the broker.
	MaxLivePods = apiv1.MaxLivePods

	// TokenPodsUnreported: the peer has not reported its Pods within
	// livePodsMaxAge (or never).
	TokenPodsUnreported = "pods-unreported"
	// TokenPodNotLive: the token's Pod is not in the peer's last report,
	// which is newer than the token: the Pod was deleted.
	TokenPodNotLive = "pod-not-live"
	// PodNotReportedYet is the reason of a refusal that may pass by
	// itself: the token's Pod is not in the last report, but the token was
	// issued no earlier than that report (to the second, iat's precision),
	// so the Pod existed after it and is likely too new to be in it. It is
	// answered 503 with Retry-After, never honoured.
	PodNotReportedYet = "pod-not-reported-yet"

	// MinReportInterval is how soon after a peer's report this replica
	// takes its next one: every report is a Secret write, which a peer
	// must not be able to repeat at will. The agent reports at most once a
	// second.
	MinReportInterval = 500 * time.Millisecond
	// reportClockSkew is how far in the future a report's time may be
	// (another replica's clock) before it counts as no report.
	reportClockSkew = 5 * time.Second
)

// podUID is a Kubernetes uid as the API server makes them (RFC 4122,
// lower case).
var podUID = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// CheckLivePods validates the uids of a report: at most MaxLivePods, each
// a uid, none twice. The error names the first bad one.
func CheckLivePods(uids []string) error {
	_, err := livePodSet(uids)
	return err
}

// livePodSet checks uids as CheckLivePods does and returns them as a set.
func livePodSet(uids []string) (map[string]struct{}, error) {
	if len(uids) > MaxLivePods {
		return nil, fmt.Errorf("%d uids: at most %d Pods per report (scope the agent's livePods audiences and namespaces to the Pods that use this broker)", len(uids), MaxLivePods)
	}
	set := make(map[string]struct{}, len(uids))
	for i, u := range uids {
		if !podUID.MatchString(u) {
			return nil, fmt.Errorf("uids[%d] is not a Pod uid (lower-case RFC 4122)", i)
		}
		if _, dup := set[u]; dup {
			return nil, fmt.Errorf("uids[%d] is listed twice", i)
		}
		set[u] = struct{}{}
	}
	return set, nil
}

// parseLivePods reads a stored report.
func parseLivePods(doc []byte) (map[string]struct{}, error) {
	var uids []string
	if err := json.Unmarshal(doc, &uids); err != nil {
		return nil, err
	}
	return livePodSet(uids)
}

// keepLivePods carries the last report of from into to (a rewrite of the
// same peer's Secret for a new key set), if it has one whole.
func keepLivePods(from, to *corev1.Secret) {
	doc, ok := from.Data[PeerLivePodsKey]
	at, hasAt := from.Annotations[AnnotationPodsReportedAt]
	if ok && hasAt {
		to.Data[PeerLivePodsKey] = doc
		to.Annotations[AnnotationPodsReportedAt] = at
	}
}

// LivePod says whether the Pod with uid, bound to a token of peer (whose
// reports identity made), may be honoured at now: "" if so, else the
// refusal's reason (TokenPodsUnreported, TokenPodNotLive), with the time
// of the last report.
func (s *PeerKeyStore) LivePod(peer, identity, uid string, now time.Time, maxAge time.Duration) (string, time.Time) {
	ks := (*s.sets.Load())[peer]
	if ks == nil || ks.identity != identity || ks.podsAt.IsZero() || now.Sub(ks.podsAt) > maxAge ||
		ks.podsAt.After(now.Add(reportClockSkew)) {
		return TokenPodsUnreported, time.Time{}
	}
	if _, ok := ks.pods[uid]; !ok {
		return TokenPodNotLive, ks.podsAt
	}
	return "", ks.podsAt
}

// ReportLivePods stores the uids of the Pods that live in the cluster of a
// peer of policy p, authenticated as identity, and names the peer in ev.
// The peer's policy must say livePodsFromPeer: true (else KindForbidden);
// a report that is not a list of uids is KindInvalid; one made before the
// peer uploaded its key set is KindUnprocessable, unless the peer trusts
// pod certificates alone (no token trust, so no keys to upload): its
// report is then the Secret's only content.
func (s *PeerKeyStore) ReportLivePods(ctx context.Context, p *policy.Policy, identity string, uids []string, now time.Time, ev *audit.Event) (*apiv1.PeerLivePods, error) {
	peer := p.Peer(identity)
	if peer == nil || peer.WorkloadIdentity == nil || !peer.WorkloadIdentity.LivePodsFromPeer {
		return nil, problem.Errorf(problem.KindForbidden, "the policy does not let this peer report its Pods")
	}
	ev.Peer = peer.Name
	if s == nil {
		return nil, problem.Errorf(problem.KindUnprocessable, "this broker keeps no uploaded key sets")
	}
	if err := CheckLivePods(uids); err != nil {
		return nil, problem.Invalid(apiv1.FieldError{Field: "uids", Detail: err.Error()})
	}
	if wait := s.reportSlot(peer.Name, now); wait > 0 {
		return nil, &problem.Error{Kind: problem.KindTooManyRequests, RetryAfter: wait,
			Detail: fmt.Sprintf("one report per %s per broker replica", MinReportInterval)}
	}
	sorted := slices.Clone(uids)
	slices.Sort(sorted)
	doc, err := json.Marshal(sorted)
	if err != nil {
		return nil, problem.Wrap(problem.KindInternal, "", err)
	}
	keysFirst := peer.WorkloadIdentity.TrustsTokens()
	if err := s.putLivePods(ctx, peer.Name, identity, doc, now, keysFirst); err != nil {
		return nil, err
	}
	s.log.Debug("peer reported its live Pods", zap.String("peer", peer.Name), zap.Int("pods", len(uids)))
	return &apiv1.PeerLivePods{
		Peer: peer.Name, Pods: len(uids), ReportedAt: now.UTC(),
		ValidUntil: now.Add(peer.WorkloadIdentity.EffectiveLivePodsMaxAge()).UTC(),
	}, nil
}

// errKeysFirst refuses a report of a peer whose key set Secret does not
// exist, or belongs to another identity.
var errKeysFirst = problem.Errorf(problem.KindUnprocessable, "upload your cluster's key set (PUT /v1/peers/self/jwks) before reporting its Pods")

// putLivePods writes doc as peer's last report, made at now, into the
// peer's key set Secret. With keysFirst the Secret must hold the peer's
// keys already (errKeysFirst); without, a missing Secret is created with
// the report alone, and one written for another identity (a peer name
// reused in the policy) is replaced by it, its keys dropped. Conflicts
// with another replica are retried.
func (s *PeerKeyStore) putLivePods(ctx context.Context, peer, identity string, doc []byte, now time.Time, keysFirst bool) error {
	secrets := s.secrets.Secrets(s.namespace)
	var written *corev1.Secret
	err := retry.OnError(retry.DefaultRetry, func(err error) bool {
		// Without keysFirst a Secret deleted since the read is made anew.
		return apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err) || (!keysFirst && apierrors.IsNotFound(err))
	}, func() error {
		sec, err := s.read(ctx, peer)
		if apierrors.IsNotFound(err) && !keysFirst {
			written, err = secrets.Create(ctx, newLivePodsSecret(peer, identity, doc, now), metav1.CreateOptions{})
			return err
		}
		if apierrors.IsNotFound(err) {
			return errKeysFirst
		}
		if err != nil {
			return err
		}
		if sec.Annotations[objects.AnnotationIdentity] != identity {
			if keysFirst {
				return errKeysFirst
			}
			next := newLivePodsSecret(peer, identity, doc, now)
			next.ResourceVersion = sec.ResourceVersion
			written, err = secrets.Update(ctx, next, metav1.UpdateOptions{})
			return err
		}
		next := sec.DeepCopy()
		if next.Data == nil {
			next.Data = map[string][]byte{}
		}
		if next.Annotations == nil {
			next.Annotations = map[string]string{}
		}
		next.Data[PeerLivePodsKey] = doc
		next.Annotations[AnnotationPodsReportedAt] = now.UTC().Format(time.RFC3339Nano)
		written, err = secrets.Update(ctx, next, metav1.UpdateOptions{})
		if apierrors.IsNotFound(err) && keysFirst {
			return errKeysFirst // deleted since the read
		}
		return err
	})
	if errors.Is(err, errKeysFirst) {
		return err
	}
	if apierrors.IsNotFound(err) {
		// The broker's own namespace is missing: its misconfiguration,
		// not the peer's fault.
		return problem.Wrap(problem.KindInternal, "", fmt.Errorf("store the Pods of peer %s: namespace %q: %w", peer, s.namespace, err))
	}
	if err != nil {
		return problem.Classify(fmt.Errorf("store the Pods of peer %s in Secret %s/%s: %w", peer, s.namespace, PeerKeysSecretName(peer), err), "store live pods", "namespace not found")
	}
	s.observe(written)
	return nil
}

// newLivePodsSecret is the Secret of a peer that reports its Pods without
// keys: the key set Secret (same name, labels and identity) with
// live-pods.json alone.
func newLivePodsSecret(peer, identity string, doc []byte, now time.Time) *corev1.Secret {
	sec := newPeerKeysSecret(peer, identity, nil)
	sec.Data = map[string][]byte{PeerLivePodsKey: doc}
	sec.Annotations[AnnotationPodsReportedAt] = now.UTC().Format(time.RFC3339Nano)
	return sec
}

// reportSlot takes peer's next report slot on this replica at now: zero if
// the report may go ahead, else how long until it may.
func (s *PeerKeyStore) reportSlot(peer string, now time.Time) time.Duration {
	s.reportsMu.Lock()
	defer s.reportsMu.Unlock()
	if s.lastReport == nil {
		s.lastReport = map[string]time.Time{}
	}
	if last, ok := s.lastReport[peer]; ok && now.Sub(last) < MinReportInterval && !now.Before(last) {
		return MinReportInterval - now.Sub(last)
	}
	s.lastReport[peer] = now
	return 0
}
