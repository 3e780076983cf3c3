package broker

import (
	"context"
	"errors"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// expireLeaseAt revokes the lease Secret s (just created) at its expiry
// at, for a credential that would outlive it: a token's exp or a
// certificate's NotAfter is the issuer's minimum at least. The timer is
// this replica's; should the replica stop first, any replica's GC deletes
// the lease once the expiry has passed (CollectGarbage), up to
// --gc-interval later.
func (b *Broker) expireLeaseAt(s *corev1.Secret, kind string, at time.Time, log *zap.Logger) {
	ref := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name, UID: s.UID,
		Annotations: map[string]string{objects.AnnotationCred: kind}}}
	if !b.expiries.At(at, func() { b.expireLease(ref, log) }) {
		log.Warn("too many lease expiries pending; the GC revokes this lease after its expiry")
	}
}

// expireLease revokes an expired lease as RevokeLease does
// (lease.Deleter.Revoke): a client certificate's RoleBinding first, so
// that the certificate is useless at the expiry, not a moment after, then
// the Secret. A failed deletion is retried in the background, like the
// GC's.
func (b *Broker) expireLease(s *corev1.Secret, log *zap.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), b.cfg.CleanupTimeout)
	defer cancel()
	bindingErr, err := b.deleter().Revoke(ctx, s)
	lease.LogBindingError(log, bindingErr)
	switch {
	case apierrors.IsConflict(err):
		return // another Secret under its name: not this lease
	case err != nil && !errors.Is(err, lease.ErrGone):
		log.Warn("revoking an expired lease failed; retrying in the background", zap.Error(err))
		b.queueSecretDeletion(s, deleteExpired)
		return
	}
	b.cfg.Metrics.LeaseDeleted(deleteExpired, 1)
	log.Info("lease expired and revoked")
}
