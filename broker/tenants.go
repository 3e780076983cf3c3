package broker

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
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
const uncoveredRecheck = 5 * time.Second

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
type unmatch struct {
	peer, grant, namespace, reason string
}

// tenants keeps the broker's grants by namespace selector true: an index
// of the namespaces each selector grant matches (for whoami, lease
// listings and the GC, never O(namespaces) per request), and a queue of
// namespaces whose leases are to be revoked because they left a grant.
type tenants struct {
	informer NamespaceInformer
	queue    workqueue.TypedDelayingInterface[unmatch]
	log      *zap.Logger
	metrics  *metrics.Metrics
	clock    clock.PassiveClock
	// live reads a namespace from the API server, not the cache, to
	// confirm that it left a grant before its leases are revoked; nil
	// trusts the cache.
	live corev1client.NamespacesGetter

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

func newTenants(informer NamespaceInformer, store *policy.Store, cfg Config) (*tenants, error) {
	t := &tenants{
		informer: informer,
		queue: workqueue.NewTypedDelayingQueueWithConfig(workqueue.TypedDelayingQueueConfig[unmatch]{
			Clock: cfg.Clock,
		}),
		log:      cfg.Logger.Named("tenants"),
		metrics:  cfg.Metrics,
		clock:    cfg.Clock,
		live:     cfg.LiveNamespaces,
		policyAt: cfg.Clock.Now(),
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
func (t *tenants) NamespaceLabels(name string) (labels.Set, bool) {
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
func (t *tenants) NamespaceOwners(name string) []metav1.OwnerReference {
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
func (t *tenants) synced() bool { return t.informer.HasSynced() }

func (t *tenants) observe(obj any) {
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
func (t *tenants) update(name string, set labels.Set, owners []metav1.OwnerReference, live bool, reason string) {
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
func (t *tenants) setPolicy(p *policy.Policy) {
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
func (t *tenants) unmatchedLocked(key policy.SelectorGrant, g *policy.GrantSpec, namespace, reason string) {
	fields := []zap.Field{zap.String("peer", key.Peer), zap.String("grant", key.Grant), zap.String("namespace", namespace), zap.String("reason", reason)}
	if !g.KeptTrue() {
		t.log.Info("namespace no longer covered by a grant; its leases are kept (revokeOnUnmatch: false)", fields...)
		return
	}
	t.queueLocked(unmatch{peer: key.Peer, grant: key.Grant, namespace: namespace, reason: reason}, time.Duration(g.RevokeDelay))
}

// queueLocked queues the revocation of item's leases after delay; the
// queue keeps an item waiting once, at its earliest time.
func (t *tenants) queueLocked(item unmatch, delay time.Duration) {
	t.log.Info("namespace no longer covered by a grant; revoking its leases",
		zap.String("peer", item.peer), zap.String("grant", item.grant), zap.String("namespace", item.namespace),
		zap.String("reason", item.reason), zap.Duration("delay", delay))
	t.queue.AddAfter(item, delay)
}

func (t *tenants) reportLocked() {
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
func (t *tenants) matchingNamespaces(peer, grant string) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := slices.Collect(maps.Keys(t.matching[policy.SelectorGrant{Peer: peer, Grant: grant}]))
	slices.Sort(out)
	return out
}

// namespaces returns the namespaces matched by the selector grants of peer
// ("" for every peer).
func (t *tenants) namespaces(peer string) []string {
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
func (t *tenants) wasGone(key policy.SelectorGrant) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.gone[key]
}

// RunTenants keeps selector grants true until ctx is done: it revokes the
// leases of namespaces that stopped being covered, as the namespace
// informer and policy reloads report them, and, once the namespace cache
// has synced, those found in namespaces that stopped being covered while
// no broker watched. A broker without a namespace informer returns at
// once. The informer itself is run by the composition root.
func (b *Broker) RunTenants(ctx context.Context) {
	t := b.tenants
	if t == nil {
		return
	}
	go func() {
		<-ctx.Done()
		t.queue.ShutDown()
	}()
	go func() {
		if cache.WaitForCacheSync(ctx.Done(), t.informer.HasSynced) {
			b.sweepUnmatched(ctx)
		}
	}()
	for {
		item, shutdown := t.queue.Get()
		if shutdown {
			return
		}
		err := b.revokeUnmatched(ctx, item)
		t.queue.Done(item)
		if err != nil && ctx.Err() == nil {
			b.cfg.Logger.Warn("revoking the leases of a namespace that left its grant failed; retrying",
				zap.String("peer", item.peer), zap.String("grant", item.grant), zap.String("namespace", item.namespace), zap.Error(err))
			t.queue.AddAfter(item, unmatchRetry)
		}
	}
}

// revokeUnmatched revokes the leases of item's grant in item's namespace,
// unless the namespace is covered again (a relabel within the delay) or
// the grant no longer revokes.
func (b *Broker) revokeUnmatched(ctx context.Context, item unmatch) error {
	t := b.tenants
	key := policy.SelectorGrant{Peer: item.peer, Grant: item.grant}
	var g *policy.GrantSpec
	if p := b.cfg.Policy.Load(); p != nil {
		if peer := p.PeerNamed(item.peer); peer != nil {
			g = peer.GrantNamed(item.grant)
		}
	}
	switch {
	case g != nil && g.Covers(t, item.namespace):
		b.cfg.Logger.Info("namespace covered by its grant again; its leases are kept",
			zap.String("peer", item.peer), zap.String("grant", item.grant), zap.String("namespace", item.namespace))
		return nil
	case g != nil && !g.KeptTrue():
		return nil
	}
	if g != nil {
		// The cache may lag the API server (a watch seconds or minutes
		// behind): a namespace relabelled back into the grant, or never
		// out of it, keeps its leases.
		covered, err := t.coveredLive(ctx, g, item.namespace)
		if err != nil {
			return err
		}
		if covered {
			b.cfg.Logger.Info("namespace covered by its grant on the API server though not in the namespace cache; its leases are kept",
				zap.String("peer", item.peer), zap.String("grant", item.grant), zap.String("namespace", item.namespace))
			return nil
		}
	}
	// A grant that is gone revokes the leases that recorded that it
	// revoked on unmatch, and, for leases issued before they recorded it,
	// those of a grant this replica saw removed while it did.
	gone := g == nil && t.wasGone(key)
	t.mu.Lock()
	policyAt := t.policyAt
	t.mu.Unlock()
	secrets, err := b.listLeaseSecrets(ctx, []string{item.namespace}, labels.Set{objects.LabelPeer: item.peer})
	if err != nil {
		return err
	}
	for i := range secrets {
		s := &secrets[i]
		if s.Annotations[objects.AnnotationGrant] != item.grant {
			continue
		}
		if _, marked := s.Annotations[objects.AnnotationRevokeOnUnmatch]; g == nil && !gone && !marked {
			continue
		}
		if g == nil && issuedAfter(s, policyAt) {
			// Issued under a policy newer than this replica's (the
			// ConfigMap reaches replicas minutes apart): the grant may
			// be new, not removed. A replica whose policy is newer than
			// the lease judges it.
			b.cfg.Logger.Debug("lease of a grant this replica's policy does not know is newer than that policy; kept",
				zap.String("peer", item.peer), zap.String("grant", item.grant), zap.String("namespace", item.namespace),
				zap.String("lease_id", s.Labels[objects.LabelLeaseID]), zap.Time("created", s.CreationTimestamp.Time), zap.Time("policy_taken", policyAt))
			continue
		}
		if err := b.revokeUnmatchedLease(ctx, s, item); err != nil {
			return err
		}
	}
	return nil
}

// issuedAfter reports whether lease s was created after t. The API server
// records creation to the second, rounded down: a lease of the same second
// as t counts as before it, so that a replica that restarts within a
// second of an issuance still judges that lease.
func issuedAfter(s *corev1.Secret, t time.Time) bool {
	return s.CreationTimestamp.Time.After(t)
}

// coveredLive reports whether grant g covers namespace as the API server
// has it now (a consistent list of that one namespace, which the broker's
// list permission on namespaces allows), not as the cache has it. Without
// a live client it reports false: the cache decided. An error is
// retryable.
func (t *tenants) coveredLive(ctx context.Context, g *policy.GrantSpec, namespace string) (bool, error) {
	if t.live == nil || g.Selector == nil {
		return false, nil
	}
	list, err := t.live.Namespaces().List(ctx, metav1.ListOptions{
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

// revokeUnmatchedLease deletes one lease whose namespace left its grant,
// and logs, audits and counts it if this replica's delete removed it.
// Another replica may have deleted it first: that is no error.
func (b *Broker) revokeUnmatchedLease(ctx context.Context, s *corev1.Secret, item unmatch) error {
	uid := s.UID
	t0 := b.cfg.Clock.Now()
	err := b.cfg.Secrets.Secrets(s.Namespace).Delete(ctx, s.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
	b.timeAPI(ctx, "delete_lease", t0, err)
	if problem.IsNotFound(err) || apierrors.IsConflict(err) {
		return nil // gone already (another replica), or a new Secret of that name
	}
	if err != nil {
		return problem.Classify(err, "revoke lease of a namespace that left its grant", "lease not found")
	}
	id := s.Labels[objects.LabelLeaseID]
	reason := "namespace " + item.namespace + " is no longer covered by grant " + item.grant + " (" + item.reason + ")"
	b.cfg.Metrics.ObserveUnmatched(item.reason)
	b.cfg.Logger.Info("lease revoked",
		zap.String("identity", s.Annotations[objects.AnnotationIdentity]),
		zap.String("peer", item.peer),
		zap.String("grant", item.grant),
		zap.String("lease_id", id),
		zap.String("namespace", s.Namespace),
		zap.String("service_account", s.Annotations[objects.AnnotationSA]),
		zap.String("reason", item.reason))
	b.audit(ctx, audit.Event{
		Action:         audit.ActionRevoke,
		Decision:       audit.DecisionAllow,
		Reason:         reason,
		Identity:       s.Annotations[objects.AnnotationIdentity],
		Peer:           item.peer,
		Namespace:      s.Namespace,
		ServiceAccount: s.Annotations[objects.AnnotationSA],
		Credential:     s.Annotations[objects.AnnotationCred],
		LeaseID:        id,
		Grant:          item.grant,
	})
	return nil
}

// sweepUnmatched looks, once, at every lease Secret of the cluster for
// leases of a selector grant in a namespace it no longer covers: a
// namespace that left, or a grant removed, while no broker was watching.
// It needs list on Secrets in every namespace (the kustomize base's
// ClusterRoleBinding); without it the sweep is skipped with a warning, and
// the GC's passes look in the namespaces they may.
func (b *Broker) sweepUnmatched(ctx context.Context) {
	b.queueUncovered(ctx, UnmatchFoundAtStart, false)
}

// queueUncovered queues, after its grant's delay (uncoveredRecheck at
// least), the revocation of every lease that its grant no longer covers
// (uncovered), under reason. It reads the lease counter when
// fromCounter is set and the counter has synced (memory only), else it
// lists every lease Secret of the cluster a page at a time. Nothing is
// judged before the namespace cache has synced: an empty cache covers
// nothing.
func (b *Broker) queueUncovered(ctx context.Context, reason string, fromCounter bool) {
	t := b.tenants
	p := b.cfg.Policy.Load()
	if t == nil || p == nil || !t.synced() {
		return
	}
	seen := map[unmatch]bool{}
	consider := func(l lease.Ref) {
		if l.Grant == "" {
			return
		}
		delay, revoke := uncovered(p, t, l)
		item := unmatch{peer: l.Peer, grant: l.Grant, namespace: l.Namespace, reason: reason}
		if !revoke || seen[item] {
			return
		}
		seen[item] = true
		t.mu.Lock()
		t.queueLocked(item, max(delay, uncoveredRecheck))
		t.mu.Unlock()
	}
	if lc := b.cfg.Leases; fromCounter && lc != nil && lc.Synced() {
		for _, l := range lc.LeaseRefs() {
			consider(l)
		}
		return
	}
	// Page by page: the whole cluster's leases need not fit in memory.
	err := EachLeaseSecretPage(ctx, b.cfg.Secrets, "", nil, func(secrets []corev1.Secret) error {
		for i := range secrets {
			consider(lease.RefOf(&secrets[i]))
		}
		return nil
	})
	if lc := b.cfg.Leases; err != nil && ctx.Err() == nil && lc != nil && lc.Synced() {
		// Per-namespace RBAC: the counter still watches the namespaces
		// where it saw marked leases, also those that left their grant.
		for _, l := range lc.LeaseRefs() {
			consider(l)
		}
	}
	switch {
	case err == nil || ctx.Err() != nil:
	case len(p.SelectorGrants()) == 0:
		b.cfg.Logger.Debug("cannot list lease Secrets in every namespace; leases of removed selector grants are revoked where the GC looks", zap.Error(err))
	default:
		b.cfg.Logger.Warn("cannot list lease Secrets in every namespace: leases in namespaces that left their grant while no broker of this process watched them (before it started) are not found; revoke them by hand if any (docs/operations.md)",
			zap.Error(err))
	}
}

// leaseRef is what a coverage check reads of a lease.
// uncovered reports whether lease l is to be revoked because the grant it
// was issued under no longer covers its namespace, and after what delay.
// A grant of the policy decides by its selector and revokeOnUnmatch, as
// revokeUnmatched does; a grant (or peer) the policy no longer has revokes
// the leases that recorded it revoked on unmatch, after the delay they
// recorded (bounded by ttl.max).
func uncovered(p *policy.Policy, nss policy.NamespaceLabels, l lease.Ref) (time.Duration, bool) {
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
func markRevokeOnUnmatch(lease *corev1.Secret, g *policy.GrantSpec) {
	if g != nil && g.KeptTrue() {
		lease.Annotations[objects.AnnotationRevokeOnUnmatch] = time.Duration(g.RevokeDelay).String()
	}
}

// decidedGrant returns the grant d was decided under in p, or nil.
func decidedGrant(p *policy.Policy, d policy.Decision) *policy.GrantSpec {
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

// recheckCoverage closes the race between an issuance and a namespace
// leaving its grant: the revocation may list the namespace's leases after
// the decision and before the lease Secret exists (or while a pooled
// Secret's claim is in flight, when it is no lease yet), and so miss it.
// Called once the credential is minted and before it is answered, it
// looks again, at the namespace cache and the policy as they are now: the
// cache is updated before the revocation is queued, so a revocation that
// missed the lease is one this check sees. If the grant (one that revokes
// on unmatch) no longer covers the namespace, the lease is deleted, which
// revokes the credential nobody has seen, and the request is refused as
// any request there is now.
func (b *Broker) recheckCoverage(ctx context.Context, g *policy.GrantSpec, d policy.Decision, created *corev1.Secret, a *pendingAudit, log *zap.Logger) error {
	if g == nil || !g.KeptTrue() || b.tenants == nil {
		return nil
	}
	p := b.cfg.Policy.Load()
	if p != nil {
		if _, revoke := uncovered(p, b.tenants, lease.RefOf(created)); !revoke {
			return nil
		}
	}
	b.deleteLease(ctx, created, log)
	a.reason = "namespace " + created.Namespace + " is no longer covered by grant " + d.Grant + " (" + UnmatchDuringIssue + ")"
	log.Info("decision", zap.Bool("allowed", false), zap.String("reason", a.reason))
	return problem.Errorf(problem.KindForbidden, "no grant allows this request")
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
