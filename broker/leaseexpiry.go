package broker

import (
	"context"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/limits"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// MinLeaseTTL is the shortest lease the broker grants: a shorter ttl is
// raised to it (clampedBy ClampedByLeaseMinimum). A lease shorter than
// the credential bound to it (the TokenRequest and CSR APIs grant 10m at
// least) is revoked at its own expiry, so the minimum is the broker's,
// not the API server's: one minute leaves a client time to use what it
// was given, and the API server's ~10 s token cache is small beside it.
const MinLeaseTTL = time.Minute

// ClampedByLeaseMinimum reports a TTL raised to MinLeaseTTL.
const ClampedByLeaseMinimum = "lease.minimum"

// expireLeaseAt revokes the lease Secret s (just created) at its expiry
// at, for a credential that would outlive it: a token's exp or a
// certificate's NotAfter is the issuer's minimum at least. The timer is
// this replica's; should the replica stop first, any replica's GC deletes
// the lease once the expiry has passed (CollectGarbage), up to
// --gc-interval later.
func (b *Broker) expireLeaseAt(s *corev1.Secret, kind string, at time.Time, log *zap.Logger) {
	ref := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name, UID: s.UID}}
	if !b.expiries.At(at, func() { b.expireLease(ref, kind, log) }) {
		log.Warn("too many lease expiries pending; the GC revokes this lease after its expiry")
	}
}

// maxTimedExpiries bounds the leases waiting for their timer: the
// global lease quota's default. Beyond it the GC is the only revoker.
const maxTimedExpiries = limits.DefaultMaxLiveLeasesTotal

// expireLease revokes an expired lease as RevokeLease does: a client
// certificate's RoleBinding first, then the Secret. A failed deletion is
// retried in the background, like the GC's.
func (b *Broker) expireLease(s *corev1.Secret, kind string, log *zap.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.CleanupTimeout)
	defer cancel()
	// The binding first: the certificate is useless at the expiry, not a
	// moment after.
	b.deleteLeaseBinding(ctx, s, kind, log)
	if err := b.deleteSecret(ctx, s); err != nil {
		if apierrors.IsConflict(err) {
			return // another Secret under its name: not this lease
		}
		log.Warn("revoking an expired lease failed; retrying in the background", zap.Error(err))
		b.queueSecretDeletion(s, deleteExpired)
		return
	}
	b.cfg.Metrics.LeaseDeleted(deleteExpired, 1)
	log.Info("lease expired and revoked")
}
