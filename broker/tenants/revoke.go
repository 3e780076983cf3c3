package tenants

import (
	"context"
	"errors"

	apierrors "k8s.io/apimachinery/pkg/api/errors"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// Revoker revokes the leases of namespaces that left their selector grant
// (the Tracker's queue) and finds those that left while nobody watched:
// each through Deleter, as every revocation, with one audit event.
type Revoker struct {
	Tracker *Tracker
	Policy  *policy.Store
	// Leases lists lease Secrets; its Counter, if set and synced, is read
	// instead of a list where it can be.
	Leases  *lease.Store
	Deleter *lease.Deleter
	Audit   *audit.Recorder
	Metrics *metrics.Metrics
	Logger  *zap.Logger
}

// Run keeps selector grants true until ctx is done: it revokes the
// leases of namespaces that stopped being covered, as the namespace
// informer and policy reloads report them, and, once the namespace cache
// has synced, those found in namespaces that stopped being covered while
// no broker watched. The informer itself is run by the composition root.
func (r *Revoker) Run(ctx context.Context) {
	t := r.Tracker
	t.Run(ctx, func(ctx context.Context) { r.Sweep(ctx) }, func(ctx context.Context, item Unmatch) error {
		err := r.Revoke(ctx, item)
		if err != nil && ctx.Err() == nil {
			r.Logger.Warn("revoking the leases of a namespace that left its grant failed; retrying",
				zap.String("peer", item.Peer), zap.String("grant", item.Grant), zap.String("namespace", item.Namespace), zap.Error(err))
		}
		return err
	})
}

// Revoke revokes the leases of item's grant in item's namespace,
// unless the namespace is covered again (a relabel within the delay) or
// the grant no longer revokes.
func (r *Revoker) Revoke(ctx context.Context, item Unmatch) error {
	t := r.Tracker
	key := policy.SelectorGrant{Peer: item.Peer, Grant: item.Grant}
	var g *policy.GrantSpec
	if p := r.Policy.Load(); p != nil {
		if peer := p.PeerNamed(item.Peer); peer != nil {
			g = peer.GrantNamed(item.Grant)
		}
	}
	switch {
	case g != nil && g.Covers(t, item.Namespace):
		r.Logger.Info("namespace covered by its grant again; its leases are kept",
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
			r.Logger.Info("namespace covered by its grant on the API server though not in the namespace cache; its leases are kept",
				zap.String("peer", item.Peer), zap.String("grant", item.Grant), zap.String("namespace", item.Namespace))
			return nil
		}
	}
	// A grant that is gone revokes the leases that recorded that it
	// revoked on unmatch, and, for leases issued before they recorded it,
	// those of a grant this replica saw removed while it did.
	gone := g == nil && t.WasGone(key)
	policyAt := t.PolicySince()
	secrets, err := r.Leases.List(ctx, []string{item.Namespace}, labels.Set{objects.LabelPeer: item.Peer})
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
		if g == nil && IssuedAfter(s, policyAt) {
			// Issued under a policy newer than this replica's (the
			// ConfigMap reaches replicas minutes apart): the grant may
			// be new, not removed. A replica whose policy is newer than
			// the lease judges it.
			r.Logger.Debug("lease of a grant this replica's policy does not know is newer than that policy; kept",
				zap.String("peer", item.Peer), zap.String("grant", item.Grant), zap.String("namespace", item.Namespace),
				zap.String("lease_id", s.Labels[objects.LabelLeaseID]), zap.Time("created", s.CreationTimestamp.Time), zap.Time("policy_taken", policyAt))
			continue
		}
		if err := r.revokeUnmatchedLease(ctx, s, item); err != nil {
			return err
		}
	}
	return nil
}

// revokeUnmatchedLease deletes one lease whose namespace left its grant,
// and logs, audits and counts it if this replica's delete removed it.
// Another replica may have deleted it first: that is no error.
func (r *Revoker) revokeUnmatchedLease(ctx context.Context, s *corev1.Secret, item Unmatch) error {
	bindingErr, err := r.Deleter.Revoke(ctx, s)
	lease.LogBindingError(r.Logger.With(zap.String("lease_id", s.Labels[objects.LabelLeaseID])), bindingErr)
	if errors.Is(err, lease.ErrGone) || apierrors.IsConflict(err) {
		return nil // gone already (another replica), or a new Secret of that name
	}
	if err != nil {
		return problem.Classify(err, "revoke lease of a namespace that left its grant", "lease not found")
	}
	id := s.Labels[objects.LabelLeaseID]
	reason := "namespace " + item.Namespace + " is no longer covered by grant " + item.Grant + " (" + item.Reason + ")"
	r.Metrics.ObserveUnmatched(item.Reason)
	r.Logger.Info("lease revoked",
		zap.String("identity", s.Annotations[objects.AnnotationIdentity]),
		zap.String("peer", item.Peer),
		zap.String("grant", item.Grant),
		zap.String("lease_id", id),
		zap.String("namespace", s.Namespace),
		zap.String("service_account", s.Annotations[objects.AnnotationSA]),
		zap.String("reason", item.Reason))
	r.Audit.Write(ctx, audit.Event{
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

// Sweep looks, once, at every lease Secret of the cluster for
// leases of a selector grant in a namespace it no longer covers: a
// namespace that left, or a grant removed, while no broker was watching.
// It needs list on Secrets in every namespace (the kustomize base's
// ClusterRoleBinding); without it the sweep is skipped with a warning, and
// the GC's passes look in the namespaces they may.
func (r *Revoker) Sweep(ctx context.Context) {
	r.QueueUncovered(ctx, UnmatchFoundAtStart, false)
}

// QueueUncovered queues, after its grant's delay (uncoveredRecheck at
// least), the revocation of every lease that its grant no longer covers
// (uncovered), under reason. It reads the lease counter when
// fromCounter is set and the counter has synced (memory only), else it
// lists every lease Secret of the cluster a page at a time. Nothing is
// judged before the namespace cache has synced: an empty cache covers
// nothing.
func (r *Revoker) QueueUncovered(ctx context.Context, reason string, fromCounter bool) {
	t := r.Tracker
	p := r.Policy.Load()
	if t == nil || p == nil || !t.Synced() {
		return
	}
	seen := map[Unmatch]bool{}
	consider := func(l lease.Ref) {
		if l.Grant == "" {
			return
		}
		delay, revoke := Uncovered(p, t, l)
		item := Unmatch{Peer: l.Peer, Grant: l.Grant, Namespace: l.Namespace, Reason: reason}
		if !revoke || seen[item] {
			return
		}
		seen[item] = true
		t.QueueAfter(item, max(delay, UncoveredRecheck))
	}
	if lc := r.Leases.Counter; fromCounter && lc != nil && lc.Synced() {
		for _, l := range lc.LeaseRefs() {
			consider(l)
		}
		return
	}
	// Page by page: the whole cluster's leases need not fit in memory.
	err := lease.EachSecretPage(ctx, r.Leases.Secrets, "", nil, func(secrets []corev1.Secret) error {
		for i := range secrets {
			consider(lease.RefOf(&secrets[i]))
		}
		return nil
	})
	if lc := r.Leases.Counter; err != nil && ctx.Err() == nil && lc != nil && lc.Synced() {
		// Per-namespace RBAC: the counter still watches the namespaces
		// where it saw marked leases, also those that left their grant.
		for _, l := range lc.LeaseRefs() {
			consider(l)
		}
	}
	switch {
	case err == nil || ctx.Err() != nil:
	case len(p.SelectorGrants()) == 0:
		r.Logger.Debug("cannot list lease Secrets in every namespace; leases of removed selector grants are revoked where the GC looks", zap.Error(err))
	default:
		r.Logger.Warn("cannot list lease Secrets in every namespace: leases in namespaces that left their grant while no broker of this process watched them (before it started) are not found; revoke them by hand if any (docs/operations.md)",
			zap.Error(err))
	}
}
