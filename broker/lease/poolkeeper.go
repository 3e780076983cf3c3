package lease

import (
	"context"
	"encoding/base32"
	"encoding/json"
	"fmt"
	"io"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tokenbroker/tokenbroker/broker/objects"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
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
// takes the create off a token's critical path only if the create runs
// while the API server is idle. So for tokens it is refilled, one Secret
// at a time, only once no issuance has been in flight on the replica for
// poolQuiet; under back-to-back load it empties and token issuances take
// the sequential path, so a busy API server gets no extra writes. A
// gateway lease on a pooled Secret is answered before its claim (the
// broker's pool.go): no API call of it, nor the refill, is on any answer's
// path, so namespaces with gateway demand are refilled at once.

// PoolKeeper fills and empties a replica's Pool: it creates pooled
// Secrets once issuances are quiet and deletes those that may no longer
// be handed out.
type PoolKeeper struct {
	Pool  *Pool
	Store *Store
	// Delete deletes one pooled Secret (Deleter.DeleteSecret).
	Delete func(ctx context.Context, s *corev1.Secret) error
	// Rand makes lease ids (NewID).
	Rand io.Reader
	// Ready is told the pool's size after every round.
	Ready          func(int)
	CleanupTimeout time.Duration
	Logger         *zap.Logger
}

// idEncoding makes 26-character lowercase ids from 16 random bytes; they
// are valid label values and Secret name suffixes.
var idEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// NewID returns a new lease id read from rand.
func NewID(rand io.Reader) (string, error) {
	var buf [16]byte
	if _, err := io.ReadFull(rand, buf[:]); err != nil {
		return "", fmt.Errorf("generate lease id: %w", err)
	}
	return idEncoding.EncodeToString(buf[:]), nil
}

// Run keeps the pool until ctx ends, then deletes the unclaimed Secrets
// it holds. Without it every issuance takes the sequential path.
func (k *PoolKeeper) Run(ctx context.Context) {
	p := k.Pool
	p.SetRunning(true)
	defer func() {
		p.SetRunning(false)
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), k.CleanupTimeout)
		defer cancel()
		k.deletePooled(ctx, p.Drain())
	}()
	for {
		wait := PoolTick
		if again := k.Tend(ctx); again > 0 {
			wait = again
		}
		select {
		case <-ctx.Done():
			return
		case <-p.Kicked():
		case <-k.Store.Clock.After(wait):
		}
	}
}

// Tend deletes what may no longer be handed out and refills, one
// Secret at a time, while the pool may grow. It returns when to look again
// if it stopped because issuances were not quiet yet, else 0.
func (k *PoolKeeper) Tend(ctx context.Context) time.Duration {
	p := k.Pool
	defer func() { k.Ready(p.Size()) }()
	k.deletePooled(ctx, p.Sweep(k.Store.Clock.Now()))
	for ctx.Err() == nil {
		ns, eager, ok := p.Next()
		if !ok {
			break
		}
		if wait := p.QuietFor(k.Store.Clock.Now()); wait > 0 && !eager {
			return wait
		}
		s, err := k.createPooled(ctx, ns)
		if err != nil {
			if apierrors.IsNotFound(err) || apierrors.IsForbidden(err) {
				p.Forget(ns) // until the next issuance there
			}
			if ctx.Err() == nil {
				k.Logger.Warn("lease pool: creating a Secret failed; issuances there take the sequential path",
					zap.String("namespace", ns), zap.Error(err))
			}
			break // try again at the next kick or tick
		}
		if !p.Add(ns, s) {
			k.deletePooled(ctx, []*Pooled{s})
		}
	}
	return 0
}

func (k *PoolKeeper) createPooled(ctx context.Context, namespace string) (*Pooled, error) {
	id, err := NewID(k.Rand)
	if err != nil {
		return nil, err
	}
	now := k.Store.Clock.Now()
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:      objects.LeaseSecretPrefix + id,
			Namespace: namespace,
			Labels:    map[string]string{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.PoolKind},
			// The claim deadline: the GC deletes the Secret past it
			// unless a claim recorded the lease's expiry instead.
			Annotations: map[string]string{objects.AnnotationExpiresAt: expiryValue(now.Add(PoolDeadline))},
		},
		Type: objects.SecretTypeLease,
	}
	created, err := k.Store.Create(ctx, s, "create_pooled_lease")
	if err != nil {
		return nil, err
	}
	return &Pooled{Secret: created, ID: id, Created: now}, nil
}

func (k *PoolKeeper) deletePooled(ctx context.Context, ss []*Pooled) {
	for _, s := range ss {
		if err := k.Delete(ctx, s.Secret); err != nil && ctx.Err() == nil {
			// Nothing is bound to it; the GC deletes it past its deadline.
			k.Logger.Info("lease pool: deleting an unclaimed Secret failed; the GC deletes it past its deadline",
				zap.String("secret", s.Secret.Namespace+"/"+s.Secret.Name), zap.Error(err))
		}
	}
}

// claimPatch makes the pooled Secret the lease: lease's labels and
// annotations, its expiry replacing the claim deadline. Its UID and
// resource version as the pool created it are preconditions: the patch
// fails rather than claim another Secret of the same name, or one anybody
// edited since (a tenant who relabels pooled Secrets as leases must not
// make a lease's claim land unseen: Find's wait for a claim knows pooled
// Secrets only by their kind).
func claimPatch(lease *corev1.Secret, pooled *corev1.Secret) ([]byte, error) {
	type meta struct {
		UID             types.UID         `json:"uid"`
		ResourceVersion string            `json:"resourceVersion,omitempty"`
		Labels          map[string]string `json:"labels"`
		Annotations     map[string]string `json:"annotations"`
	}
	return json.Marshal(struct {
		Metadata meta `json:"metadata"`
	}{meta{UID: pooled.UID, ResourceVersion: pooled.ResourceVersion, Labels: lease.Labels, Annotations: lease.Annotations}})
}

// Claim makes the pooled Secret s the lease ls (ClaimNow) and runs
// alongside (the issuer's call for the credential bound to s) at the same
// time; it returns once both are done, with the claimed Secret (nil if
// the claim failed) and the claim's error. If the patch cannot even be
// made, alongside does not run.
func (st *Store) Claim(ctx context.Context, s *Pooled, ls *corev1.Secret, alongside func()) (*corev1.Secret, error) {
	patch, err := claimPatch(ls, s.Secret)
	if err != nil {
		return nil, err
	}
	var (
		claimed  *corev1.Secret
		claimErr error
		done     = make(chan struct{})
	)
	go func() {
		defer close(done)
		claimed, claimErr = st.patchClaim(ctx, s, patch)
	}()
	alongside()
	<-done
	return claimed, claimErr
}

// ClaimNow makes the pooled Secret s the lease ls, with a patch under s's
// UID and resource version (claimPatch).
func (st *Store) ClaimNow(ctx context.Context, s *Pooled, ls *corev1.Secret) (*corev1.Secret, error) {
	patch, err := claimPatch(ls, s.Secret)
	if err != nil {
		return nil, err
	}
	return st.patchClaim(ctx, s, patch)
}

func (st *Store) patchClaim(ctx context.Context, s *Pooled, patch []byte) (*corev1.Secret, error) {
	t0 := st.Clock.Now()
	claimed, err := st.Secrets.Secrets(s.Secret.Namespace).Patch(ctx, s.Secret.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	st.timed(ctx, "claim_lease", t0, err)
	return claimed, err
}
