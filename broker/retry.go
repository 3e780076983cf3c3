package broker

import (
	"context"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
)

// Lease deletions that failed are not forgotten: a revocation the API
// server could not carry out (the DELETE was answered 503), an expired
// lease the GC could not delete and the lease of a failed request are kept
// in the broker's retry queue and deleted, with capped exponential
// backoff, until they are gone. The queue lives in the replica's memory:
// a replica that stops loses it, and then the GC removes what is left
// once it expires (a revoked lease whose DELETE was answered 503 must then
// be revoked again).

// Reasons a deletion is queued; revoked and expired are also the reason
// label of tokenbroker_leases_deleted_total once it succeeds (failed
// requests' leases are not counted there, as when they are deleted at
// once).
const (
	deleteRevoked = "revoked"
	deleteExpired = "expired"
	deleteFailed  = "failed_request"
)

// queueSecretDeletion queues the deletion of s for reason (deleteExpired
// or deleteFailed); it reports false when the queue is full.
func (b *Broker) queueSecretDeletion(s *corev1.Secret, reason string) bool {
	return b.retries.Queue("secret/"+s.Namespace+"/"+s.Name, reason, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), b.cfg.CleanupTimeout)
		defer cancel()
		if err := b.deleter().DeleteSecret(ctx, s); err != nil {
			return err
		}
		b.cfg.Logger.Info("lease deleted after retries", zap.String("secret", s.Namespace+"/"+s.Name), zap.String("reason", reason))
		if reason == deleteExpired {
			b.cfg.Metrics.LeaseDeleted(deleteExpired, 1)
		}
		return nil
	})
}

// queueRevocation queues the revocation of the caller's lease id, which
// could not be looked up: at every attempt it is looked up again as its
// caller, so that only the caller's own lease is deleted.
func (b *Broker) queueRevocation(c Caller, id string) bool {
	return b.retries.Queue("revoke/"+c.Identity+"/"+id, deleteRevoked, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), b.cfg.CleanupTimeout)
		defer cancel()
		ev := c.event(audit.ActionRevoke)
		ev.LeaseID = id
		err := b.revokeLease(ctx, c, id, &ev)
		switch {
		case err == nil:
			ev.Decision, ev.Reason = audit.DecisionAllow, "revoked after the API server was unavailable"
			b.recorder().Write(ctx, ev)
			return nil
		case problem.KindOf(err) == problem.KindNotFound:
			return nil // gone already (or never the caller's)
		}
		return err
	})
}

// PendingDeletions is the number of lease deletions waiting for a retry.
func (b *Broker) PendingDeletions() int { return b.retries.Pending() }
