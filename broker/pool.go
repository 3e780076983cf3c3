package broker

import (
	"context"
	"encoding/json"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/issuers"
)

// The lease pool takes the lease Secret's create off a token issuance's
// critical path. A bound TokenRequest needs the name and UID of an
// existing Secret, so without a pool an issuance makes two API server
// calls one after the other: create the Secret, then ask for the token.
// With one, each replica keeps a few unclaimed Secrets ready in the
// namespaces it recently issued tokens in. An issuance claims one and
// runs the TokenRequest and the claim (a patch that makes the Secret a
// lease: its labels, expiry, holder) at the same time, and answers once
// both have succeeded. Any failure deletes the Secret, which revokes a
// token already bound to it.
//
// Safety rests on the claim deadline every pooled Secret records as its
// expiry (AnnotationExpiresAt): the GC deletes any Secret whose expiry has
// passed, claimed or not. A replica that stops between the TokenRequest
// and the claim leaves a token bound to a Secret that is deleted, and the
// token with it, within poolDeadline of the Secret's creation: a crash
// fails toward revocation. A replica hands out only Secrets it created
// itself, from memory, and none older than poolHandout, so the GC never
// deletes a Secret a request is claiming.
//
// Pooled Secrets are kind PoolKind, so no listing, lookup, quota or
// revocation of leases ever sees them: a lease is listed, audited and
// revocable exactly as one created on the sequential path.
//
// The pool costs one API server write per pooled issuance (the claim) and
// takes the create off the critical path only if the create runs while
// the API server is idle. So it is refilled, one Secret at a time, only
// once no issuance has been in flight on the replica for poolQuiet; under
// back-to-back load it empties and issuances take the sequential path, so
// a busy API server gets no extra writes.

// Issuance paths of tokenbroker_lease_pool_issuances_total.
const (
	pathPool       = "pool"
	pathSequential = "sequential"
)

// RunPool keeps the lease pool until ctx ends, then deletes the unclaimed
// Secrets it holds. Without it (or with the pool disabled) every issuance
// takes the sequential path.
func (b *Broker) RunPool(ctx context.Context) {
	p := b.pool
	if p == nil {
		return
	}
	p.SetRunning(true)
	defer func() {
		p.SetRunning(false)
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), b.cfg.CleanupTimeout)
		defer cancel()
		b.deletePooled(ctx, p.Drain())
	}()
	for {
		wait := lease.PoolTick
		if again := b.tendPool(ctx); again > 0 {
			wait = again
		}
		select {
		case <-ctx.Done():
			return
		case <-p.Kicked():
		case <-b.cfg.Clock.After(wait):
		}
	}
}

// tendPool deletes what may no longer be handed out and refills, one
// Secret at a time, while the pool may grow. It returns when to look again
// if it stopped because issuances were not quiet yet, else 0.
func (b *Broker) tendPool(ctx context.Context) time.Duration {
	p := b.pool
	defer func() { b.cfg.Metrics.SetPoolReady(p.Size()) }()
	b.deletePooled(ctx, p.Sweep(b.cfg.Clock.Now()))
	for ctx.Err() == nil {
		ns, ok := p.Next()
		if !ok {
			break
		}
		if wait := p.QuietFor(b.cfg.Clock.Now()); wait > 0 {
			return wait
		}
		s, err := b.createPooled(ctx, ns)
		if err != nil {
			if apierrors.IsNotFound(err) || apierrors.IsForbidden(err) {
				p.Forget(ns) // until the next issuance there
			}
			if ctx.Err() == nil {
				b.cfg.Logger.Warn("lease pool: creating a Secret failed; issuances there take the sequential path",
					zap.String("namespace", ns), zap.Error(err))
			}
			break // try again at the next kick or tick
		}
		if !p.Add(ns, s) {
			b.deletePooled(ctx, []*lease.Pooled{s})
		}
	}
	return 0
}

func (b *Broker) createPooled(ctx context.Context, namespace string) (*lease.Pooled, error) {
	id, err := b.newLeaseID()
	if err != nil {
		return nil, err
	}
	now := b.cfg.Clock.Now()
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:      objects.LeaseSecretPrefix + id,
			Namespace: namespace,
			Labels:    map[string]string{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.PoolKind},
			// The claim deadline: the GC deletes the Secret past it
			// unless a claim recorded the lease's expiry instead.
			Annotations: map[string]string{objects.AnnotationExpiresAt: now.Add(lease.PoolDeadline).UTC().Format(time.RFC3339)},
		},
		Type: objects.SecretTypeLease,
	}
	t0 := b.cfg.Clock.Now()
	created, err := b.cfg.Secrets.Secrets(namespace).Create(ctx, s, metav1.CreateOptions{})
	b.timeAPI(ctx, "create_pooled_lease", t0, err)
	if err != nil {
		return nil, err
	}
	return &lease.Pooled{Secret: created, ID: id, Created: now}, nil
}

func (b *Broker) deletePooled(ctx context.Context, ss []*lease.Pooled) {
	for _, s := range ss {
		if err := b.deleteSecret(ctx, s.Secret); err != nil && ctx.Err() == nil {
			// Nothing is bound to it; the GC deletes it past its deadline.
			b.cfg.Logger.Info("lease pool: deleting an unclaimed Secret failed; the GC deletes it past its deadline",
				zap.String("secret", s.Secret.Namespace+"/"+s.Secret.Name), zap.Error(err))
		}
	}
}

// claimPatch makes a pooled Secret the lease: lease's labels and
// annotations, its expiry replacing the claim deadline. The UID makes it
// a precondition: the patch fails rather than claim another Secret of the
// same name.
func claimPatch(lease *corev1.Secret, uid types.UID) ([]byte, error) {
	type meta struct {
		UID         types.UID         `json:"uid"`
		Labels      map[string]string `json:"labels"`
		Annotations map[string]string `json:"annotations"`
	}
	return json.Marshal(struct {
		Metadata meta `json:"metadata"`
	}{meta{UID: uid, Labels: lease.Labels, Annotations: lease.Annotations}})
}

// claim makes the pooled Secret s the lease and asks issuer for the
// credential bound to it, both at once. It returns the claimed Secret
// (nil if the claim failed) and the errors of each call. The time spent
// on both counts once as API server wait.
func (b *Broker) claim(ctx context.Context, s *lease.Pooled, lease *corev1.Secret, issuer Issuer, kind string, ireq issuers.Request) (*corev1.Secret, issuers.Credential, error, error) {
	patch, err := claimPatch(lease, s.Secret.UID)
	if err != nil {
		return nil, issuers.Credential{}, err, nil
	}
	ireq.Lease = issuers.ObjectRef{Kind: "Secret", Name: s.Secret.Name, UID: s.Secret.UID}
	start := b.cfg.Clock.Now()
	inner := context.WithValue(ctx, apiWaitKey{}, nil) // counted once below
	var (
		claimed  *corev1.Secret
		claimErr error
		done     = make(chan struct{})
	)
	go func() {
		defer close(done)
		t0 := b.cfg.Clock.Now()
		claimed, claimErr = b.cfg.Secrets.Secrets(s.Secret.Namespace).Patch(inner, s.Secret.Name, types.MergePatchType, patch, metav1.PatchOptions{})
		b.timeAPI(inner, "claim_lease", t0, claimErr)
	}()
	t0 := b.cfg.Clock.Now()
	cred, issueErr := issuer.Issue(inner, ireq)
	b.cfg.Metrics.ObserveIssuer(kind, b.timeAPI(inner, "issue_"+kind, t0, issueErr), issueErr)
	<-done
	if w, ok := ctx.Value(apiWaitKey{}).(*apiWait); ok {
		w.d.Add(int64(b.cfg.Clock.Since(start)))
	}
	return claimed, cred, claimErr, issueErr
}
