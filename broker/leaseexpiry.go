package broker

import (
	"container/heap"
	"context"
	"sync"
	"time"

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
	q := b.expiries
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.heap) >= maxTimedExpiries {
		log.Warn("too many lease expiries pending; the GC revokes this lease after its expiry")
		return
	}
	ref := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name, UID: s.UID}}
	heap.Push(&q.heap, &timedExpiry{at: at, secret: ref, kind: kind, log: log})
	if !q.running {
		// The worker runs while a lease waits for its expiry.
		q.running = true
		go b.runExpiries()
		return
	}
	select {
	case q.wake <- struct{}{}: // it may now have a sooner one
	default:
	}
}

// maxTimedExpiries bounds the leases waiting for their timer: the
// global lease quota's default. Beyond it the GC is the only revoker.
const maxTimedExpiries = DefaultMaxLiveLeasesTotal

// expiryQueue holds the leases that the broker revokes at their expiry,
// soonest first; one goroutine waits for the soonest while it is not
// empty.
type expiryQueue struct {
	mu      sync.Mutex
	heap    expiryTimers
	running bool
	wake    chan struct{}
}

func newExpiryQueue() *expiryQueue { return &expiryQueue{wake: make(chan struct{}, 1)} }

type timedExpiry struct {
	at     time.Time
	secret *corev1.Secret
	kind   string
	log    *zap.Logger
}

// runExpiries revokes each queued lease at its expiry, and returns when
// none is left.
func (b *Broker) runExpiries() {
	q := b.expiries
	for {
		q.mu.Lock()
		now := b.cfg.Clock.Now()
		var due []*timedExpiry
		for len(q.heap) > 0 && !now.Before(q.heap[0].at) {
			due = append(due, heap.Pop(&q.heap).(*timedExpiry))
		}
		if len(due) == 0 && len(q.heap) == 0 {
			q.running = false
			q.mu.Unlock()
			return
		}
		var next time.Duration
		if len(q.heap) > 0 {
			next = q.heap[0].at.Sub(now)
		}
		q.mu.Unlock()
		for _, e := range due {
			b.expireLease(e.secret, e.kind, e.log)
		}
		if len(due) > 0 {
			continue // time passed while revoking
		}
		t := b.cfg.Clock.NewTimer(next)
		select {
		case <-t.C():
		case <-q.wake:
			t.Stop()
		}
	}
}

// expiryTimers is a min-heap of timed expiries by time.
type expiryTimers []*timedExpiry

func (h expiryTimers) Len() int           { return len(h) }
func (h expiryTimers) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h expiryTimers) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiryTimers) Push(x any)        { *h = append(*h, x.(*timedExpiry)) }
func (h *expiryTimers) Pop() any {
	old := *h
	x := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return x
}

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
