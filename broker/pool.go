package broker

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/issuers"
	corev1 "k8s.io/api/core/v1"
)

// Issuance paths of tokenbroker_lease_pool_issuances_total.
const (
	pathPool       = "pool"
	pathSequential = "sequential"
)

// poolKeeper fills and empties the lease pool (lease.PoolKeeper), with
// the broker's configuration as it is now; nil when the pool is disabled.
func (b *Broker) poolKeeper() *lease.PoolKeeper {
	if b.pool == nil {
		return nil
	}
	return &lease.PoolKeeper{Pool: b.pool, Store: b.store(), Delete: b.deleter().DeleteSecret, Rand: b.cfg.Rand,
		Ready: b.cfg.Metrics.SetPoolReady, CleanupTimeout: b.cfg.CleanupTimeout, Logger: b.cfg.Logger}
}

// RunPool keeps the lease pool (lease.PoolKeeper.Run) until ctx ends.
// Without it (or with the pool disabled) every issuance takes the
// sequential path.
func (b *Broker) RunPool(ctx context.Context) {
	if k := b.poolKeeper(); k != nil {
		k.Run(ctx)
	}
}

// claim makes the pooled Secret s the lease ls and asks issuer for the
// credential bound to it, both at once (lease.Store.Claim). It returns the
// claimed Secret (nil if the claim failed) and the errors of each call.
// The time spent on both counts once as API server wait.
func (b *Broker) claim(ctx context.Context, s *lease.Pooled, ls *corev1.Secret, issuer Issuer, kind string, ireq issuers.Request) (*corev1.Secret, issuers.Credential, error, error) {
	ireq.Lease = issuers.ObjectRef{Kind: "Secret", Name: s.Secret.Name, UID: s.Secret.UID}
	start := b.cfg.Clock.Now()
	inner := context.WithValue(ctx, apiWaitKey{}, nil) // counted once below
	var (
		cred     issuers.Credential
		issueErr error
	)
	claimed, claimErr := b.store().Claim(inner, s, ls, func() {
		t0 := b.cfg.Clock.Now()
		cred, issueErr = issuer.Issue(inner, ireq)
		b.cfg.Metrics.ObserveIssuer(kind, b.timeAPI(inner, "issue_"+kind, t0, issueErr), issueErr)
	})
	if w, ok := ctx.Value(apiWaitKey{}).(*apiWait); ok {
		w.d.Add(int64(b.cfg.Clock.Since(start)))
	}
	return claimed, cred, claimErr, issueErr
}

// signPooled signs a gateway lease for the pooled Secret s, which becomes
// the lease ls once claimAfterAnswer's claim lands. It returns what the
// lease Secret is to be (ls under s's name and UID) and the credential.
// The signature is local: nothing waits on the API server.
func (b *Broker) signPooled(ctx context.Context, s *lease.Pooled, ls *corev1.Secret, issuer Issuer, kind string, ireq issuers.Request) (*corev1.Secret, issuers.Credential, error) {
	ireq.Lease = issuers.ObjectRef{Kind: "Secret", Name: s.Secret.Name, UID: s.Secret.UID}
	start := b.cfg.Clock.Now()
	cred, err := issuer.Issue(ctx, ireq)
	b.cfg.Metrics.ObserveIssuer(kind, b.cfg.Clock.Since(start), err)
	pending := ls.DeepCopy()
	pending.UID = s.Secret.UID
	return pending, cred, err
}

// claimAfterAnswer makes the pooled Secret s the gateway lease ls after
// the answer, within lease.ClaimWait. Until the claim lands no gateway
// holds the lease, so its certificate is refused (a request waits for it
// while the certificate is new, as for any lease just made); a failed
// claim deletes s, so the certificate can never become good. A replica
// that dies first leaves s pooled, deleted by the GC at its deadline: the
// certificate was never good anywhere.
func (b *Broker) claimAfterAnswer(ctx context.Context, s *lease.Pooled, ls *corev1.Secret, log *zap.Logger) {
	b.after.Go(ctx, lease.ClaimWait, func(ctx context.Context) {
		if _, err := b.store().ClaimNow(ctx, s, ls); err != nil {
			b.cfg.Metrics.LeaseDeleted(deletedUnclaimed, 1)
			log.Error("a gateway lease's claim failed after its answer: its pooled Secret is deleted and its certificate is good for nothing", zap.Error(err))
			b.deleteLease(ctx, s.Secret, log)
		}
	})
}

// deletedUnclaimed is the reason of tokenbroker_leases_deleted_total for a
// gateway lease whose claim failed after its answer.
const deletedUnclaimed = "unclaimed"

// poolSightLag is how long after its creation a pooled Secret the lease
// counter has not seen is taken for gone: its watch sees one within
// milliseconds, unless it is blind, and a blind replica signs nothing
// for a Secret it cannot vouch for.
const poolSightLag = time.Second

// stillPooled reports whether the pooled Secret s is, as far as the lease
// counter knows, as the pool made it. A gateway lease is answered before
// its claim, so a Secret deleted or edited since (by a tenant, or another
// replica's GC) would give its holder a certificate that can never be
// good; a token's claim finds that out before its answer.
func (b *Broker) stillPooled(s *lease.Pooled) bool {
	if b.cfg.Leases == nil {
		return true
	}
	seen, intact := b.cfg.Leases.Pooled(s.Secret.Namespace, s.Secret.Name, s.Secret.UID)
	if seen {
		return intact
	}
	return b.cfg.Clock.Since(s.Created) < poolSightLag
}
