package broker

import (
	"context"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/tenants"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

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
	t.Run(ctx, func(ctx context.Context) { b.sweepUnmatched(ctx) }, func(ctx context.Context, item tenants.Unmatch) error {
		err := b.revokeUnmatched(ctx, item)
		if err != nil && ctx.Err() == nil {
			b.cfg.Logger.Warn("revoking the leases of a namespace that left its grant failed; retrying",
				zap.String("peer", item.Peer), zap.String("grant", item.Grant), zap.String("namespace", item.Namespace), zap.Error(err))
		}
		return err
	})
}

// revokeUnmatched revokes the leases of item's grant in item's namespace,
// unless the namespace is covered again (a relabel within the delay) or
// the grant no longer revokes.
func (b *Broker) revokeUnmatched(ctx context.Context, item tenants.Unmatch) error {
	t := b.tenants
	key := policy.SelectorGrant{Peer: item.Peer, Grant: item.Grant}
	var g *policy.GrantSpec
	if p := b.cfg.Policy.Load(); p != nil {
		if peer := p.PeerNamed(item.Peer); peer != nil {
			g = peer.GrantNamed(item.Grant)
		}
	}
	switch {
	case g != nil && g.Covers(t, item.Namespace):
		b.cfg.Logger.Info("namespace covered by its grant again; its leases are kept",
			zap.String("peer", item.Peer), zap.String("grant", item.Grant), zap.String("namespace", item.Namespace))
		return nil
	case g != nil && !g.KeptTrue():
		return nil
	}
	if g != nil {
		// The cache may lag the API server (a watch seconds or minutes
		// behind): a namespace relabelled back into the grant, or never
		// out of it, keeps its leases.
		covered, err := t.CoveredLive(ctx, g, item.Namespace)
		if err != nil {
			return err
		}
		if covered {
			b.cfg.Logger.Info("namespace covered by its grant on the API server though not in the namespace cache; its leases are kept",
				zap.String("peer", item.Peer), zap.String("grant", item.Grant), zap.String("namespace", item.Namespace))
			return nil
		}
	}
	// A grant that is gone revokes the leases that recorded that it
	// revoked on unmatch, and, for leases issued before they recorded it,
	// those of a grant this replica saw removed while it did.
	gone := g == nil && t.WasGone(key)
	policyAt := t.PolicySince()
	secrets, err := b.store().List(ctx, []string{item.Namespace}, labels.Set{objects.LabelPeer: item.Peer})
	if err != nil {
		return err
	}
	for i := range secrets {
		s := &secrets[i]
		if s.Annotations[objects.AnnotationGrant] != item.Grant {
			continue
		}
		if _, marked := s.Annotations[objects.AnnotationRevokeOnUnmatch]; g == nil && !gone && !marked {
			continue
		}
		if g == nil && tenants.IssuedAfter(s, policyAt) {
			// Issued under a policy newer than this replica's (the
			// ConfigMap reaches replicas minutes apart): the grant may
			// be new, not removed. A replica whose policy is newer than
			// the lease judges it.
			b.cfg.Logger.Debug("lease of a grant this replica's policy does not know is newer than that policy; kept",
				zap.String("peer", item.Peer), zap.String("grant", item.Grant), zap.String("namespace", item.Namespace),
				zap.String("lease_id", s.Labels[objects.LabelLeaseID]), zap.Time("created", s.CreationTimestamp.Time), zap.Time("policy_taken", policyAt))
			continue
		}
		if err := b.revokeUnmatchedLease(ctx, s, item); err != nil {
			return err
		}
	}
	return nil
}

// revokeUnmatchedLease deletes one lease whose namespace left its grant,
// and logs, audits and counts it if this replica's delete removed it.
// Another replica may have deleted it first: that is no error.
func (b *Broker) revokeUnmatchedLease(ctx context.Context, s *corev1.Secret, item tenants.Unmatch) error {
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
	reason := "namespace " + item.Namespace + " is no longer covered by grant " + item.Grant + " (" + item.Reason + ")"
	b.cfg.Metrics.ObserveUnmatched(item.Reason)
	b.cfg.Logger.Info("lease revoked",
		zap.String("identity", s.Annotations[objects.AnnotationIdentity]),
		zap.String("peer", item.Peer),
		zap.String("grant", item.Grant),
		zap.String("lease_id", id),
		zap.String("namespace", s.Namespace),
		zap.String("service_account", s.Annotations[objects.AnnotationSA]),
		zap.String("reason", item.Reason))
	b.recorder().Write(ctx, audit.Event{
		Action:         audit.ActionRevoke,
		Decision:       audit.DecisionAllow,
		Reason:         reason,
		Identity:       s.Annotations[objects.AnnotationIdentity],
		Peer:           item.Peer,
		Namespace:      s.Namespace,
		ServiceAccount: s.Annotations[objects.AnnotationSA],
		Credential:     s.Annotations[objects.AnnotationCred],
		LeaseID:        id,
		Grant:          item.Grant,
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
	b.queueUncovered(ctx, tenants.UnmatchFoundAtStart, false)
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
	if t == nil || p == nil || !t.Synced() {
		return
	}
	seen := map[tenants.Unmatch]bool{}
	consider := func(l lease.Ref) {
		if l.Grant == "" {
			return
		}
		delay, revoke := tenants.Uncovered(p, t, l)
		item := tenants.Unmatch{Peer: l.Peer, Grant: l.Grant, Namespace: l.Namespace, Reason: reason}
		if !revoke || seen[item] {
			return
		}
		seen[item] = true
		t.QueueAfter(item, max(delay, tenants.UncoveredRecheck))
	}
	if lc := b.cfg.Leases; fromCounter && lc != nil && lc.Synced() {
		for _, l := range lc.LeaseRefs() {
			consider(l)
		}
		return
	}
	// Page by page: the whole cluster's leases need not fit in memory.
	err := lease.EachSecretPage(ctx, b.cfg.Secrets, "", nil, func(secrets []corev1.Secret) error {
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
func (b *Broker) recheckCoverage(ctx context.Context, g *policy.GrantSpec, d policy.Decision, created *corev1.Secret, a *audit.Pending, log *zap.Logger) error {
	if g == nil || !g.KeptTrue() || b.tenants == nil {
		return nil
	}
	p := b.cfg.Policy.Load()
	if p != nil {
		if _, revoke := tenants.Uncovered(p, b.tenants, lease.RefOf(created)); !revoke {
			return nil
		}
	}
	b.deleteLease(ctx, created, log)
	a.Reason = "namespace " + created.Namespace + " is no longer covered by grant " + d.Grant + " (" + tenants.UnmatchDuringIssue + ")"
	log.Info("decision", zap.Bool("allowed", false), zap.String("reason", a.Reason))
	return problem.Errorf(problem.KindForbidden, "no grant allows this request")
}
