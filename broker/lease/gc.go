package lease

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// GCPass is one pass of the garbage collector: what it looks at and how
// it deletes.
type GCPass struct {
	// Namespaces are where it looks for lease Secrets; Own, the broker's
	// namespace ("" for none), is where used join token records are.
	Namespaces []string
	Own        string
	// Full lists every Secret of the broker in Namespaces, a page at a
	// time; otherwise the pass deletes what the Counter saw expire (at
	// most GCBatch) and lists only the used join token records of Own,
	// so that its work follows what expired, not how many leases live.
	// Only full passes collect what the Counter cannot know: leases
	// without a readable expiry.
	Full bool
	Now  time.Time
	// MaxTTL is the age past which a lease without a readable expiry is
	// collected: no credential bound to it can still be valid.
	// UsedTokenRetention is that of a used join token record without one.
	MaxTTL             time.Duration
	UsedTokenRetention time.Duration
	// Delete deletes one expired Secret (Deleter.DeleteSecret); a Secret
	// it fails on goes to Requeue, to be retried with backoff rather than
	// only at the next pass.
	Delete  func(ctx context.Context, s *corev1.Secret) error
	Requeue func(s *corev1.Secret)
	// RevokeTampered, if set, revokes one lease Secret that someone else
	// edited after the Counter saw it intact (Counter.Tampered), and
	// reports whether it deleted it (false: gone already, or replaced);
	// it queues its own retry of a failure. Every pass, full or not,
	// revokes those in Namespaces.
	RevokeTampered func(ctx context.Context, t TamperedSecret) (bool, error)
}

// GCBatch bounds the Secrets one pass deletes from the Counter's list.
const GCBatch = 5000

// GCResult is what one pass deleted: Leases, Others (used join token
// records and unclaimed pooled Secrets) and Tampered (leases someone else
// edited); and Active, the leases that have not expired (from the Counter
// on a pass that is not full).
type GCResult struct {
	Leases, Others, Tampered, Active int
}

// Collect runs one pass: the expired Secrets, then the tampered leases.
// A Secret that cannot be deleted does not keep the others: the error says
// how many failed. Safe to run on several replicas at once.
func (st *Store) Collect(ctx context.Context, pass GCPass) (GCResult, error) {
	res, err := st.collectExpired(ctx, pass)
	terr := st.collectTampered(ctx, pass, &res)
	if err == nil {
		return res, terr
	}
	if terr == nil {
		return res, err
	}
	return res, errors.Join(err, terr)
}

// collectTampered revokes the lease Secrets in pass.Namespaces that the
// Counter saw edited by someone else since they were intact (intact.go),
// at most GCBatch a pass, and counts those it deleted in res.Tampered.
func (st *Store) collectTampered(ctx context.Context, pass GCPass, res *GCResult) error {
	if st.Counter == nil || pass.RevokeTampered == nil {
		return nil
	}
	looked := make(map[string]bool, len(pass.Namespaces))
	for _, ns := range pass.Namespaces {
		looked[ns] = true
	}
	var errs []error
	for _, t := range st.Counter.Tampered(GCBatch) {
		if !looked[t.Namespace] {
			continue
		}
		deleted, err := pass.RevokeTampered(ctx, t)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if deleted {
			res.Tampered++
		}
	}
	if len(errs) > 0 {
		return problem.Classify(errors.Join(errs...), fmt.Sprintf("revoke %d tampered leases", len(errs)), "Secret vanished")
	}
	return nil
}

// collectExpired deletes what expired: every Secret of the broker listed a
// page at a time on a full pass, else what the Counter saw expire.
func (st *Store) collectExpired(ctx context.Context, pass GCPass) (GCResult, error) {
	var res GCResult
	if pass.Full {
		// Every kind at once, including lease Secrets made before the kind
		// label existed, a page at a time.
		var errs []error
		err := st.eachManagedPage(ctx, pass.Namespaces, "list_gc", func(page []corev1.Secret) error {
			if err := st.collect(ctx, page, pass, &res); err != nil {
				errs = append(errs, err) // the other pages still go
			}
			return nil
		})
		if err != nil {
			res.Active = 0
			return res, err
		}
		return res, errors.Join(errs...)
	}
	var secrets []corev1.Secret
	if pass.Own != "" {
		var err error
		secrets, err = st.listManaged(ctx, []string{pass.Own}, labels.Set{objects.LabelKind: objects.UsedJoinTokenKind}, "list_gc")
		if err != nil {
			return res, err
		}
	}
	looked := make(map[string]bool, len(pass.Namespaces))
	for _, ns := range pass.Namespaces {
		looked[ns] = true
	}
	for _, e := range st.Counter.Expired(GCBatch) {
		if !looked[e.Namespace] {
			continue // not a namespace this pass looks in
		}
		kind := objects.LeaseKind
		if e.Pool {
			kind = objects.PoolKind
		}
		secrets = append(secrets, corev1.Secret{ObjectMeta: metav1.ObjectMeta{
			Namespace: e.Namespace, Name: e.Name, UID: e.UID,
			Labels:      map[string]string{objects.LabelKind: kind},
			Annotations: map[string]string{objects.AnnotationExpiresAt: expiryValue(e.Expires)},
		}, Type: objects.SecretTypeLease}) // the counter sees that type only
	}
	err := st.collect(ctx, secrets, pass, &res)
	res.Active = st.Counter.Counted()
	return res, err
}

// collect deletes those of secrets whose expiry has passed and adds to
// res what it deleted and how many leases have not expired.
func (st *Store) collect(ctx context.Context, secrets []corev1.Secret, pass GCPass, res *GCResult) error {
	var errs []error
	for i := range secrets {
		s := &secrets[i]
		kind := s.Labels[objects.LabelKind]
		if kind == objects.PeerKeysKind {
			continue // a peer's key set does not expire; it is replaced
		}
		if kind != objects.UsedJoinTokenKind && s.Type != objects.SecretTypeLease {
			continue // the lease labels on someone else's Secret: not the broker's to delete
		}
		usedToken := kind == objects.UsedJoinTokenKind
		exp, err := time.Parse(time.RFC3339, s.Annotations[objects.AnnotationExpiresAt])
		switch {
		case err == nil:
		case usedToken:
			exp = s.CreationTimestamp.Add(pass.UsedTokenRetention)
		default:
			exp = s.CreationTimestamp.Add(pass.MaxTTL)
		}
		if pass.Now.Before(exp) {
			if !usedToken && kind != objects.PoolKind {
				res.Active++
			}
			continue
		}
		if err := pass.Delete(ctx, s); err != nil {
			errs = append(errs, err)
			pass.Requeue(s)
			continue
		}
		if usedToken || kind == objects.PoolKind {
			res.Others++
		} else {
			res.Leases++
		}
	}
	if len(errs) > 0 {
		return problem.Classify(errors.Join(errs...), fmt.Sprintf("collect %d expired Secrets", len(errs)), "Secret vanished")
	}
	return nil
}
