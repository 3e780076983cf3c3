package tenants

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"

	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/clock"
)

// Reasons of a revocation because a namespace stopped being covered
// (tokenbroker_unmatched_revocations_total, the audit event's reason).
const (
	UnmatchLabelChanged = "label_changed"
	UnmatchDeleted      = "namespace_deleted"
	UnmatchPolicy       = "policy_narrowed"
	// UnmatchFoundAtStart: a lease found, when the namespace cache first
	// synced, in a namespace its grant no longer covers (it stopped while
	// no broker was watching).
	UnmatchFoundAtStart = "found_at_start"
	// UnmatchFoundByGC: a lease found by a GC pass in a namespace its
	// grant no longer covers, which no in-memory revocation took (a
	// replica that stopped with the revocation queued, a grant removed
	// while no broker ran).
	UnmatchFoundByGC = "found_by_gc"
	// UnmatchDuringIssue: the namespace stopped being covered while the
	// lease's credential was being minted; the request is refused and the
	// lease deleted before anything is answered (audit reason only).
	UnmatchDuringIssue = "unmatched_during_issue"
)

// uncoveredRecheck is the least delay before a revocation found by a
// sweep or a GC pass (rather than seen by the namespace informer) is
// carried out: revokeUnmatched then looks at the namespace cache again, so
// that a replica whose cache is a moment behind another's (which has just
// seen a namespace join a grant and issued there) revokes nothing it
// should not.
const UncoveredRecheck = 5 * time.Second

// unmatchRetry is how long a revocation that failed waits before the next
// try.
const unmatchRetry = 5 * time.Second

// NamespaceInformer is what the broker needs of an informer of namespaces:
// a metadata-only one (k8s.io/client-go/metadata/metadatainformer), so
// that thousands of namespaces cost little memory. Its objects are
// *metav1.PartialObjectMetadata (any metav1.Object works).
type NamespaceInformer interface {
	AddEventHandler(handler cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error)
	GetStore() cache.Store
	HasSynced() bool
}

// unmatch is one namespace that stopped being covered by one selector
// grant: its leases under that grant are to be revoked.
type Unmatch struct {
	Peer, Grant, Namespace, Reason string
}

// tenants keeps the broker's grants by namespace selector true: an index
// of the namespaces each selector grant matches (for whoami, lease
// listings and the GC, never O(namespaces) per request), and a queue of
// namespaces whose leases are to be revoked because they left a grant.
type Tracker struct {
	informer NamespaceInformer
	Queue    workqueue.TypedDelayingInterface[Unmatch]
	log      *zap.Logger
	metrics  *metrics.Metrics
	clock    clock.PassiveClock
	// live reads a namespace from the API server, not the cache, to
	// confirm that it left a grant before its leases are revoked; nil
	// trusts the cache.
	Live corev1client.NamespacesGetter

	mu sync.Mutex
	// policyAt is when this replica took the policy in force. A lease
	// created after it may be of a grant or peer this replica's policy
	// does not know yet (another replica took a newer policy first).
	policyAt time.Time
	// grants are the selector grants of the policy the index was built
	// for, and matching the namespaces each matches now.
	grants   map[policy.SelectorGrant]*policy.GrantSpec
	matching map[policy.SelectorGrant]map[string]struct{}
	// gone are selector grants that a reload removed while they kept
	// their grants true: their pending revocations still apply.
	gone map[policy.SelectorGrant]bool
	// gen changes whenever matching does, so that what is derived from
	// it (leaseRules) is rebuilt only then.
	gen atomic.Uint64
}

func NewTracker(informer NamespaceInformer, store *policy.Store, clk clock.WithTicker, log *zap.Logger, m *metrics.Metrics, live corev1client.NamespacesGetter) (*Tracker, error) {
	t := &Tracker{
		informer: informer,
		Queue: workqueue.NewTypedDelayingQueueWithConfig(workqueue.TypedDelayingQueueConfig[Unmatch]{
			Clock: clk,
		}),
		log:      log.Named("tenants"),
		metrics:  m,
		clock:    clk,
		Live:     live,
		policyAt: clk.Now(),
		gone:     map[policy.SelectorGrant]bool{},
		matching: map[policy.SelectorGrant]map[string]struct{}{},
	}
	t.grants = store.Load().SelectorGrants()
	for k := range t.grants {
		t.matching[k] = map[string]struct{}{}
	}
	store.OnChange(func(_, p *policy.Policy) { t.setPolicy(p) })
	_, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { t.observe(obj) },
		UpdateFunc: func(_, obj any) { t.observe(obj) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if m, err := meta.Accessor(obj); err == nil {
				t.update(m.GetName(), nil, nil, false, UnmatchDeleted)
			}
		},
	})
	return t, err
}

// NamespaceLabels implements NamespaceLabels from the informer's cache.
func (t *Tracker) NamespaceLabels(name string) (labels.Set, bool) {
	obj, ok, err := t.informer.GetStore().GetByKey(name)
	if err != nil || !ok {
		return nil, false
	}
	m, err := meta.Accessor(obj)
	if err != nil || m.GetDeletionTimestamp() != nil {
		return nil, false
	}
	return labels.Set(m.GetLabels()), true
}

// NamespaceOwners implements NamespaceOwners from the informer's cache.
func (t *Tracker) NamespaceOwners(name string) []metav1.OwnerReference {
	obj, ok, err := t.informer.GetStore().GetByKey(name)
	if err != nil || !ok {
		return nil
	}
	m, err := meta.Accessor(obj)
	if err != nil || m.GetDeletionTimestamp() != nil {
		return nil
	}
	return m.GetOwnerReferences()
}

// synced reports whether the namespace cache holds the first list.
func (t *Tracker) Synced() bool { return t.informer.HasSynced() }

func (t *Tracker) observe(obj any) {
	m, err := meta.Accessor(obj)
	if err != nil {
		return
	}
	if m.GetDeletionTimestamp() != nil {
		// A namespace being deleted grants nothing any more.
		t.update(m.GetName(), nil, nil, false, UnmatchDeleted)
		return
	}
	t.update(m.GetName(), labels.Set(m.GetLabels()), m.GetOwnerReferences(), true, UnmatchLabelChanged)
}

// update brings the index in line with one namespace (live false: gone or
// going) and queues the revocations of grants it left: its labels, or its
// owners for a grant with a namespaceOwner, changed.
func (t *Tracker) update(name string, set labels.Set, owners []metav1.OwnerReference, live bool, reason string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	changed := false
	for key, g := range t.grants {
		m := t.matching[key]
		_, was := m[name]
		now := live && g.Selects(set, owners)
		switch {
		case now && !was:
			m[name] = struct{}{}
			changed = true
		case was && !now:
			delete(m, name)
			changed = true
			if !slices.Contains(g.Namespaces, name) {
				t.unmatchedLocked(key, g, name, reason)
			}
		}
	}
	if changed {
		t.gen.Add(1)
		t.reportLocked()
	}
}

// setPolicy rebuilds the index for a new policy and queues the
// revocations of every namespace a selector grant no longer covers.
func (t *Tracker) setPolicy(p *policy.Policy) {
	grants := p.SelectorGrants()
	matching := make(map[policy.SelectorGrant]map[string]struct{}, len(grants))
	for k := range grants {
		matching[k] = map[string]struct{}{}
	}
	if len(grants) > 0 {
		for _, obj := range t.informer.GetStore().List() {
			m, err := meta.Accessor(obj)
			if err != nil || m.GetDeletionTimestamp() != nil {
				continue
			}
			set, owners := labels.Set(m.GetLabels()), m.GetOwnerReferences()
			for k, g := range grants {
				if g.Selects(set, owners) {
					matching[k][m.GetName()] = struct{}{}
				}
			}
		}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.policyAt = t.clock.Now()
	for key, old := range t.grants {
		covered := slices.Collect(maps.Keys(t.matching[key]))
		covered = append(covered, old.Namespaces...)
		g := grants[key]
		for _, ns := range covered {
			if g != nil && (slices.Contains(g.Namespaces, ns) || hasKey(matching[key], ns)) {
				continue
			}
			if g == nil {
				g = old
				if old.KeptTrue() {
					t.gone[key] = true
				}
			}
			t.unmatchedLocked(key, g, ns, UnmatchPolicy)
		}
	}
	for key := range grants {
		delete(t.gone, key)
	}
	t.grants, t.matching = grants, matching
	t.gen.Add(1)
	t.reportLocked()
}

func hasKey(m map[string]struct{}, k string) bool { _, ok := m[k]; return ok }

// unmatchedLocked queues the revocation of the leases of grant g in
// namespace, after the grant's delay, or logs why they are kept.
func (t *Tracker) unmatchedLocked(key policy.SelectorGrant, g *policy.GrantSpec, namespace, reason string) {
	fields := []zap.Field{zap.String("peer", key.Peer), zap.String("grant", key.Grant), zap.String("namespace", namespace), zap.String("reason", reason)}
	if !g.KeptTrue() {
		t.log.Info("namespace no longer covered by a grant; its leases are kept (revokeOnUnmatch: false)", fields...)
		return
	}
	t.queueLocked(Unmatch{Peer: key.Peer, Grant: key.Grant, Namespace: namespace, Reason: reason}, time.Duration(g.RevokeDelay))
}

// queueLocked queues the revocation of item's leases after delay; the
// queue keeps an item waiting once, at its earliest time.
func (t *Tracker) queueLocked(item Unmatch, delay time.Duration) {
	t.log.Info("namespace no longer covered by a grant; revoking its leases",
		zap.String("peer", item.Peer), zap.String("grant", item.Grant), zap.String("namespace", item.Namespace),
		zap.String("reason", item.Reason), zap.Duration("delay", delay))
	t.Queue.AddAfter(item, delay)
}

func (t *Tracker) reportLocked() {
	if t.metrics == nil {
		return
	}
	counts := make(map[metrics.PeerGrant]int, len(t.matching))
	for k, m := range t.matching {
		counts[metrics.PeerGrant{Peer: k.Peer, Grant: k.Grant}] = len(m)
	}
	t.metrics.SetSelectorNamespaces(counts)
}

// matchingNamespaces returns the namespaces the peer's selector grant
// matches now, sorted.
func (t *Tracker) MatchingNamespaces(peer, grant string) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := slices.Collect(maps.Keys(t.matching[policy.SelectorGrant{Peer: peer, Grant: grant}]))
	slices.Sort(out)
	return out
}

// namespaces returns the namespaces matched by the selector grants of peer
// ("" for every peer).
func (t *Tracker) Namespaces(peer string) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for k, m := range t.matching {
		if peer == "" || k.Peer == peer {
			for ns := range m {
				out = append(out, ns)
			}
		}
	}
	return out
}

// wasGone reports whether a reload removed the grant while it kept its
// grants true.
func (t *Tracker) WasGone(key policy.SelectorGrant) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.gone[key]
}

// issuedAfter reports whether lease s was created after t. The API server
// records creation to the second, rounded down: a lease of the same second
// as t counts as before it, so that a replica that restarts within a
// second of an issuance still judges that lease.
func IssuedAfter(s *corev1.Secret, t time.Time) bool {
	return s.CreationTimestamp.Time.After(t)
}

// coveredLive reports whether grant g covers namespace as the API server
// has it now (a consistent list of that one namespace, which the broker's
// list permission on namespaces allows), not as the cache has it. Without
// a live client it reports false: the cache decided. An error is
// retryable.
func (t *Tracker) CoveredLive(ctx context.Context, g *policy.GrantSpec, namespace string) (bool, error) {
	if t.Live == nil || g.Selector == nil {
		return false, nil
	}
	list, err := t.Live.Namespaces().List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", namespace).String(),
	})
	if err != nil {
		return false, fmt.Errorf("read namespace %s from the API server: %w", namespace, err)
	}
	for i := range list.Items {
		ns := &list.Items[i]
		if ns.Name == namespace && ns.DeletionTimestamp == nil {
			return g.Selects(labels.Set(ns.Labels), ns.OwnerReferences), nil
		}
	}
	return false, nil
}

// leaseRef is what a coverage check reads of a lease.
// uncovered reports whether lease l is to be revoked because the grant it
// was issued under no longer covers its namespace, and after what delay.
// A grant of the policy decides by its selector and revokeOnUnmatch, as
// revokeUnmatched does; a grant (or peer) the policy no longer has revokes
// the leases that recorded it revoked on unmatch, after the delay they
// recorded (bounded by ttl.max).
func Uncovered(p *policy.Policy, nss policy.NamespaceLabels, l lease.Ref) (time.Duration, bool) {
	var g *policy.GrantSpec
	if peer := p.PeerNamed(l.Peer); peer != nil {
		g = peer.GrantNamed(l.Grant)
	}
	if g != nil {
		return time.Duration(g.RevokeDelay), g.KeptTrue() && !g.Covers(nss, l.Namespace)
	}
	if !l.Marked {
		return 0, false
	}
	d, err := time.ParseDuration(l.Mark)
	if err != nil || d < 0 {
		d = 0
	}
	return min(d, time.Duration(p.TTL.Max)), true
}

// markRevokeOnUnmatch records on a new lease that its grant g revokes on
// unmatch, and after what delay (AnnotationRevokeOnUnmatch).
func MarkRevokeOnUnmatch(lease *corev1.Secret, g *policy.GrantSpec) {
	if g != nil && g.KeptTrue() {
		lease.Annotations[objects.AnnotationRevokeOnUnmatch] = time.Duration(g.RevokeDelay).String()
	}
}

// decidedGrant returns the grant d was decided under in p, or nil.
func DecidedGrant(p *policy.Policy, d policy.Decision) *policy.GrantSpec {
	peer := p.PeerNamed(d.Peer)
	if peer == nil {
		return nil
	}
	for i := range peer.Grants {
		if peer.GrantRef(&peer.Grants[i]) == d.Grant {
			return &peer.Grants[i]
		}
	}
	return nil
}

// TrimNamespace is a cache.TransformFunc for the namespace informer: it
// keeps only what selector grants read (name, labels, owner references,
// deletion timestamp), so that the cache stays small with thousands of namespaces
// (managed fields and annotations such as kubectl's last-applied
// configuration are often most of an object).
func TrimNamespace(obj any) (any, error) {
	m, err := meta.Accessor(obj)
	if err != nil {
		return obj, nil // a tombstone: leave it as it is
	}
	return &metav1.PartialObjectMetadata{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Namespace"},
		ObjectMeta: metav1.ObjectMeta{
			Name:              m.GetName(),
			UID:               m.GetUID(),
			ResourceVersion:   m.GetResourceVersion(),
			Labels:            m.GetLabels(),
			OwnerReferences:   m.GetOwnerReferences(),
			DeletionTimestamp: m.GetDeletionTimestamp(),
		},
	}, nil
}

// run works the queue of unmatched namespaces until ctx is done: sweep
// once the informer has synced, then revoke each item, retrying a failed
// one after unmatchRetry.
func (t *Tracker) Run(ctx context.Context, sweep func(context.Context), revoke func(context.Context, Unmatch) error) {
	go func() {
		<-ctx.Done()
		t.Queue.ShutDown()
	}()
	go func() {
		if cache.WaitForCacheSync(ctx.Done(), t.informer.HasSynced) {
			sweep(ctx)
		}
	}()
	for {
		item, shutdown := t.Queue.Get()
		if shutdown {
			return
		}
		err := revoke(ctx, item)
		t.Queue.Done(item)
		if err != nil && ctx.Err() == nil {
			t.Queue.AddAfter(item, unmatchRetry)
		}
	}
}

// policySince is when the policy in force was stored.
func (t *Tracker) PolicySince() time.Time {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.policyAt
}

// queueAfter queues item to be revoked after delay.
func (t *Tracker) QueueAfter(item Unmatch, delay time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.queueLocked(item, delay)
}

// generation counts the changes of the namespaces selector grants match.
func (t *Tracker) Generation() uint64 { return t.gen.Load() }

// Describe adds to out what whoami shows of a grant's name and selector:
// the namespaces it matches now, from the index (none on a nil Tracker).
func (t *Tracker) Describe(peer string, g *policy.GrantSpec, out *apiv1.Grant) {
	out.Name = g.Name
	if g.NamespaceSelector == nil {
		return
	}
	out.NamespaceSelector = policy.APISelector(g.NamespaceSelector)
	out.NamespaceOwner = g.NamespaceOwner.API()
	keep := g.KeptTrue()
	out.RevokeOnUnmatch = &keep
	out.RevokeDelay = time.Duration(g.RevokeDelay).String()
	if t != nil {
		out.MatchingNamespaces = t.MatchingNamespaces(peer, g.Name)
	}
}
