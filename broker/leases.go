package broker

import (
	"context"
	"errors"
	"slices"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/tenants"
)

// ListLeases returns one page of the caller's leases and the continue
// token of the next page ("" after the last): those its peer holds in the
// namespaces the peer's grants name or match, made for its identity (and
// its workload, when it comes with one), so that a renamed peer never
// inherits another's (lease.Store.Page). An invalid request is
// KindInvalid, and so is a continue token the API server no longer
// honours (expired: start again).
func (b *Broker) ListLeases(ctx context.Context, c Caller, req lease.PageRequest) (*apiv1.LeaseList, error) {
	cur, limit, err := req.Parse()
	if err != nil {
		return nil, err
	}
	done, err := b.admitLeaseRead(c, nil)
	if err != nil {
		return nil, err
	}
	defer done()
	out := &apiv1.LeaseList{Items: []apiv1.Lease{}}
	p, err := b.policy()
	if err != nil {
		return nil, err
	}
	peer := p.Peer(c.Identity)
	if peer == nil {
		return out, nil
	}
	return b.store().Page(ctx, b.tenants.PeerNamespaces(peer), holder(c, peer), cur, limit)
}

// GetLease returns one of the caller's leases. A lease of another peer, or
// of another workload when the caller comes with one, is reported as not
// found, like one that does not exist.
func (b *Broker) GetLease(ctx context.Context, c Caller, id string) (*apiv1.Lease, error) {
	done, err := b.admitLeaseRead(c, nil)
	if err != nil {
		return nil, err
	}
	defer done()
	s, _, err := b.findLease(ctx, c, id, false)
	if err != nil {
		return nil, err
	}
	l := lease.ToAPI(s)
	return &l, nil
}

// RevokeLease deletes one of the caller's leases, which makes the API
// server reject its credential. Every call ends in one audit event
// (ActionRevoke). When the API server is unavailable it returns
// KindUnavailable (retryable) and has deleted nothing, but the revocation
// is queued: the broker looks the lease up again as the caller and deletes
// it, with backoff, once the API server answers (a second audit event
// then says so). A retried DELETE is harmless: it finds the lease or gets
// KindNotFound once it is gone.
func (b *Broker) RevokeLease(ctx context.Context, c Caller, id string) error {
	a := &audit.Pending{Event: c.event(audit.ActionRevoke)}
	a.Event.LeaseID = id
	done, err := b.admitLeaseRead(c, a)
	if err == nil {
		defer done()
		err = b.revokeLease(ctx, c, id, &a.Event)
	}
	if problem.KindOf(err) == problem.KindUnavailable && apiv1.ValidLeaseID(id) && b.queueRevocation(c, id) {
		b.cfg.Logger.Warn("revocation failed: API server unavailable; retrying in the background",
			zap.String("identity", c.Identity), zap.String("lease_id", id), zap.Error(err))
	}
	if !apiv1.ValidLeaseID(id) {
		a.Event.LeaseID = "" // not an id: keep what the caller sent out of the audit log
	}
	outcome := outcomeGranted
	if err != nil {
		outcome = outcomeFor(err)
	}
	b.concludeOutcome(ctx, a, outcome, err)
	return err
}

func (b *Broker) revokeLease(ctx context.Context, c Caller, id string, ev *audit.Event) error {
	s, h, err := b.findLease(ctx, c, id, true)
	// A gateway lease answered before its claim, which has not landed
	// since, is revoked as any: deleting its pooled Secret under its UID
	// makes sure the claim never lands.
	unclaimed := errors.Is(err, lease.ErrUnclaimed)
	if err != nil && !unclaimed {
		return err
	}
	if !unclaimed && !lease.Intact(s) {
		// Found by its name and the caller's identity, though someone
		// else edited its labels or annotations (lease/intact.go): its
		// holder revokes it all the same.
		b.cfg.Logger.Warn("the lease Secret was edited by someone other than the broker; revoking it as its holder asked",
			zap.String("identity", c.Identity), zap.String("lease_id", id), zap.String("namespace", s.Namespace))
	}
	// The caller's peer, not the Secret's peer label, which anyone who may
	// patch the Secret can change.
	ev.Peer, ev.Namespace = h.Peer, s.Namespace
	ev.ServiceAccount, ev.Credential, ev.User = s.Annotations[objects.AnnotationSA], s.Annotations[objects.AnnotationCred], s.Annotations[objects.AnnotationUser]
	bindingErr, err := b.deleter().Revoke(ctx, s)
	lease.LogBindingError(b.cfg.Logger.With(zap.String("lease_id", id)), bindingErr)
	if err != nil && !errors.Is(err, lease.ErrGone) {
		return problem.Classify(err, "revoke lease", "lease not found")
	}
	b.cfg.Metrics.LeaseDeleted("revoked", 1)
	b.cfg.Logger.Info("lease revoked",
		zap.String("identity", c.Identity),
		zap.String("lease_id", id),
		zap.String("namespace", s.Namespace),
		zap.String("service_account", s.Annotations[objects.AnnotationSA]),
		zap.Bool("unclaimed", unclaimed))
	if !unclaimed {
		return b.revokeTied(ctx, c, h, id, s)
	}
	return nil
}

// revokeTied revokes, after the lease s of h, the Secrets that cannot be
// told from it (lease.Store.Tied: of its name, created in the same second,
// naming h), one of which may be the lease itself if s was a copy. A
// failure is the revocation's: the caller may ask again.
func (b *Broker) revokeTied(ctx context.Context, c Caller, h lease.Holder, id string, s *corev1.Secret) error {
	p, err := b.policy()
	if err != nil {
		return err
	}
	peer := p.Peer(c.Identity)
	if peer == nil {
		return nil
	}
	tied, err := b.store().Tied(ctx, b.tenants.PeerNamespaces(peer), h, id, s)
	if err != nil {
		return problem.Classify(err, "revoke lease", "lease not found")
	}
	for _, t := range tied {
		b.cfg.Logger.Warn("a Secret created in the same second as the lease, under its name, naming its holder: revoked with it, since the two cannot be told apart",
			zap.String("lease_id", id), zap.String("namespace", t.Namespace), zap.String("revoked_namespace", s.Namespace))
		bindingErr, err := b.deleter().Revoke(ctx, t)
		lease.LogBindingError(b.cfg.Logger.With(zap.String("lease_id", id)), bindingErr)
		if err != nil && !errors.Is(err, lease.ErrGone) {
			return problem.Classify(err, "revoke lease", "lease not found")
		}
		b.cfg.Metrics.LeaseDeleted("revoked", 1)
	}
	return nil
}

// holder is whom caller c's leases are made for, as peer of the policy.
func holder(c Caller, peer *policy.PeerSpec) lease.Holder {
	return lease.Holder{Peer: peer.Name, Identity: c.Identity, Workload: c.Workload.String()}
}

// findLease returns the caller's lease id (lease.Store.Find) and the
// caller as its holder, or KindNotFound.
func (b *Broker) findLease(ctx context.Context, c Caller, id string, wait bool) (*corev1.Secret, lease.Holder, error) {
	p, err := b.policy()
	if err != nil {
		return nil, lease.Holder{}, err
	}
	peer := p.Peer(c.Identity)
	if peer == nil {
		return nil, lease.Holder{}, problem.Errorf(problem.KindNotFound, "lease %q not found", id)
	}
	h := holder(c, peer)
	s, err := b.store().Find(ctx, b.tenants.PeerNamespaces(peer), h, id, wait)
	return s, h, err
}

// store reads and writes lease Secrets with the broker's client, clock,
// lease counter and API timing.
func (b *Broker) store() *lease.Store {
	return &lease.Store{Secrets: b.cfg.Secrets, Counter: b.cfg.Leases, Clock: b.cfg.Clock,
		Timed: b.timed}
}

// CollectGarbage runs one GC pass (lease.Store.Collect) and returns how
// many expired Secrets, and leases someone else edited (revokeTampered),
// it deleted. It looks in the namespaces the policy
// grants and the broker's own: a lease left in a namespace that no grant
// names any more is not collected (its token still expires on time;
// delete it with kubectl by its labels). It also queues the revocation of
// every lease whose selector grant no longer covers its namespace
// (tenants.Revoker.QueueUncovered), carried out after the grant's
// revokeDelay. Safe to run on several replicas at once.
func (b *Broker) CollectGarbage(ctx context.Context) (int, error) {
	start := b.cfg.Clock.Now()
	n, active, err := b.collectGarbage(ctx)
	b.cfg.Metrics.ObserveGC(b.cfg.Clock.Since(start), active, b.cfg.Clock.Now(), err)
	return n, err
}

// gcFullEvery: every gcFullEvery-th GC pass, the first, and every pass
// while the lease counter is not synced are full (lease.GCPass.Full).
const gcFullEvery = 30

// collectGarbage is CollectGarbage; it also returns the number of lease
// Secrets that have not expired, for tokenbroker_leases_active.
func (b *Broker) collectGarbage(ctx context.Context) (int, int, error) {
	pass := lease.GCPass{
		Namespaces: b.LeaseNamespaces(), Own: b.cfg.Namespace, Now: b.cfg.Clock.Now(), MaxTTL: 24 * time.Hour,
		UsedTokenRetention: enrollment.UsedJoinTokenFallbackRetention,
		Delete:             b.deleter().DeleteSecret,
		Requeue:            func(s *corev1.Secret) { b.queueSecretDeletion(s, deleteExpired) },
		RevokeTampered:     b.revokeTampered,
	}
	if p := b.cfg.Policy.Load(); p != nil {
		pass.MaxTTL = time.Duration(p.TTL.Max)
	}
	if pass.Own != "" && !slices.Contains(pass.Namespaces, pass.Own) {
		pass.Namespaces = append(pass.Namespaces, pass.Own)
	}
	n := b.gcPasses.Add(1)
	pass.Full = b.cfg.Leases == nil || !b.cfg.Leases.Synced() || n%gcFullEvery == 1
	// Revocation is durable: leases whose grant no longer covers them are
	// found here, by any replica, whatever happened to the revocation the
	// namespace informer queued (tenants.go).
	b.queueUncovered(ctx, tenants.UnmatchFoundByGC, !pass.Full)
	res, err := b.store().Collect(ctx, pass)
	b.cfg.Metrics.LeaseDeleted(deleteExpired, res.Leases)
	if res.Others > 0 {
		b.cfg.Logger.Info("expired used join token records and unclaimed pooled Secrets deleted", zap.Int("count", res.Others))
	}
	return res.Leases + res.Others + res.Tampered, res.Active, err
}

// deleteTampered is the reason of tokenbroker_leases_deleted_total for a
// lease Secret someone other than the broker edited (lease/intact.go).
const deleteTampered = "tampered"

// revokeTampered revokes the lease Secret t, which someone other than the
// broker edited after the lease counter saw it intact (lease/intact.go):
// its RoleBinding first for a client certificate (only one the lease
// owns), then the Secret under its UID, so that a Secret made since under
// its name is never deleted. It reports whether this replica deleted it,
// and then logs, counts and audits the revocation as one of the lease of
// t's holder; a failure is retried in the background.
func (b *Broker) revokeTampered(ctx context.Context, t lease.TamperedSecret) (bool, error) {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: t.Namespace, Name: t.Name, UID: t.UID}}
	if t.Certificate {
		s.Annotations = map[string]string{objects.AnnotationCred: apiv1.CredentialClientCertificate}
	}
	id := lease.IDOf(t.Name)
	log := b.cfg.Logger.With(zap.String("lease_id", id), zap.String("namespace", t.Namespace))
	bindingErr, err := b.deleter().Revoke(ctx, s)
	lease.LogBindingError(log, bindingErr)
	switch {
	case errors.Is(err, lease.ErrGone) || apierrors.IsConflict(err):
		return false, nil // revoked already (another replica, its holder), or another Secret of its name
	case err != nil:
		b.queueSecretDeletion(s, deleteTampered)
		return false, err
	}
	b.cfg.Metrics.LeaseDeleted(deleteTampered, 1)
	log.Warn("lease revoked: its Secret was edited by someone other than the broker",
		zap.String("identity", t.Identity), zap.String("peer", t.Peer))
	b.recorder().Write(ctx, audit.Event{
		Action: audit.ActionRevoke, Decision: audit.DecisionAllow,
		Reason:   "the lease Secret was edited by someone other than the broker",
		Identity: t.Identity, Peer: t.Peer, Namespace: t.Namespace, LeaseID: id,
	})
	return true, nil
}

// RunGC collects expired leases and used join token records every
// interval until ctx is done ("expired leases deleted" counts both). Errors
// are logged, never fatal: the next round tries again.
func (b *Broker) RunGC(ctx context.Context, interval time.Duration) {
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		n, err := b.CollectGarbage(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			b.cfg.Logger.Warn("lease garbage collection failed", zap.Error(err))
		case n > 0:
			b.cfg.Logger.Info("expired leases deleted", zap.Int("count", n))
		}
	}, interval)
}

// LeaseNamespaces are the namespaces where any peer may hold leases
// (tenants.Tracker.LeaseNamespaces).
func (b *Broker) LeaseNamespaces() []string { return b.tenants.LeaseNamespaces(b.cfg.Policy.Load()) }
