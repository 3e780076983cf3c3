package broker

import (
	"context"
	"sort"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// ListLeases returns the caller's leases, oldest first. A peer sees only
// its own leases: the peer label narrows the query and the identity
// annotation must match, so that a renamed peer never inherits another's.
func (b *Broker) ListLeases(ctx context.Context, c Caller) ([]apiv1.Lease, error) {
	p, err := b.policy()
	if err != nil {
		return nil, err
	}
	peer := p.peer(c.Identity)
	if peer == nil {
		return []apiv1.Lease{}, nil
	}
	secrets, err := b.listLeaseSecrets(ctx, labels.Set{LabelPeer: peer.Name})
	if err != nil {
		return nil, err
	}
	out := make([]apiv1.Lease, 0, len(secrets))
	for i := range secrets {
		if secrets[i].Annotations[AnnotationIdentity] == c.Identity {
			out = append(out, leaseFromSecret(&secrets[i]))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, nil
}

// GetLease returns one of the caller's leases. A lease of another peer is
// reported as not found, like one that does not exist.
func (b *Broker) GetLease(ctx context.Context, c Caller, id string) (*apiv1.Lease, error) {
	s, err := b.findLease(ctx, c, id)
	if err != nil {
		return nil, err
	}
	l := leaseFromSecret(s)
	return &l, nil
}

// RevokeLease deletes one of the caller's leases, which makes the API
// server reject its credential.
func (b *Broker) RevokeLease(ctx context.Context, c Caller, id string) error {
	s, err := b.findLease(ctx, c, id)
	if err != nil {
		return err
	}
	if err := b.deleteSecret(ctx, s); err != nil {
		return classify(err, "revoke lease", "lease not found")
	}
	b.cfg.Metrics.leaseDeleted("revoked", 1)
	b.cfg.Logger.Info("lease revoked",
		zap.String("identity", c.Identity),
		zap.String("lease_id", id),
		zap.String("namespace", s.Namespace),
		zap.String("service_account", s.Annotations[AnnotationSA]))
	return nil
}

func (b *Broker) findLease(ctx context.Context, c Caller, id string) (*corev1.Secret, error) {
	notFound := Errorf(KindNotFound, "lease %q not found", id)
	if !ValidLeaseID(id) {
		return nil, notFound
	}
	secrets, err := b.listLeaseSecrets(ctx, labels.Set{LabelLeaseID: id})
	if err != nil {
		return nil, err
	}
	for i := range secrets {
		if secrets[i].Annotations[AnnotationIdentity] == c.Identity {
			return &secrets[i], nil
		}
	}
	return nil, notFound
}

// listLeaseSecrets lists lease Secrets (and only those: the kind label
// keeps used join token records out) matching sel in every namespace.
func (b *Broker) listLeaseSecrets(ctx context.Context, sel labels.Set) ([]corev1.Secret, error) {
	set := labels.Set{LabelKind: LeaseKind}
	for k, v := range sel {
		set[k] = v
	}
	return b.listManagedSecrets(ctx, set, "list_leases")
}

// listManagedSecrets lists the broker's Secrets of every kind matching sel
// in every namespace.
func (b *Broker) listManagedSecrets(ctx context.Context, sel labels.Set, call string) ([]corev1.Secret, error) {
	set := labels.Set{LabelManagedBy: ManagedByValue}
	for k, v := range sel {
		set[k] = v
	}
	t0 := time.Now()
	list, err := b.cfg.Secrets.Secrets(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
		LabelSelector: labels.SelectorFromSet(set).String(),
	})
	b.timeAPI(ctx, call, t0)
	if err != nil {
		return nil, classify(err, "list tokenbroker Secrets", "no Secrets")
	}
	return list.Items, nil
}

func leaseFromSecret(s *corev1.Secret) apiv1.Lease {
	exp, _ := time.Parse(time.RFC3339, s.Annotations[AnnotationExpiresAt])
	return apiv1.Lease{
		ID:             s.Labels[LabelLeaseID],
		Peer:           s.Labels[LabelPeer],
		Namespace:      s.Namespace,
		ServiceAccount: s.Annotations[AnnotationSA],
		Credential:     s.Annotations[AnnotationCred],
		CreatedAt:      s.CreationTimestamp.UTC(),
		ExpiresAt:      exp.UTC(),
	}
}

// CollectGarbage deletes every lease Secret and every used join token
// record whose expiry has passed, and returns how many it deleted. A lease
// without a readable expiry is deleted once it is older than the policy's
// maximum TTL, since no credential bound to it can still be valid; a used
// join token record without one is kept for usedJoinTokenFallbackRetention.
// Safe to run on several replicas at once.
func (b *Broker) CollectGarbage(ctx context.Context) (int, error) {
	// Every kind at once, including lease Secrets made before the kind
	// label existed.
	secrets, err := b.listManagedSecrets(ctx, nil, "list_gc")
	if err != nil {
		return 0, err
	}
	now := b.cfg.Now()
	maxTTL := 24 * time.Hour
	if p := b.cfg.Policy.Load(); p != nil {
		maxTTL = time.Duration(p.TTL.Max)
	}
	leases, tokens := 0, 0
	for i := range secrets {
		s := &secrets[i]
		usedToken := s.Labels[LabelKind] == UsedJoinTokenKind
		exp, err := time.Parse(time.RFC3339, s.Annotations[AnnotationExpiresAt])
		switch {
		case err == nil:
		case usedToken:
			exp = s.CreationTimestamp.Add(usedJoinTokenFallbackRetention)
		default:
			exp = s.CreationTimestamp.Add(maxTTL)
		}
		if now.Before(exp) {
			continue
		}
		if err := b.deleteSecret(ctx, s); err != nil {
			return leases + tokens, classify(err, "collect expired Secret", "Secret vanished")
		}
		if usedToken {
			tokens++
		} else {
			leases++
		}
	}
	b.cfg.Metrics.leaseDeleted("expired", leases)
	if tokens > 0 {
		b.cfg.Logger.Info("expired used join token records deleted", zap.Int("count", tokens))
	}
	return leases + tokens, nil
}

// RunGC collects expired leases and used join token records every
// interval until ctx is done ("expired leases deleted" counts both). Errors
// are logged, never fatal: the next round tries again.
func (b *Broker) RunGC(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		n, err := b.CollectGarbage(ctx)
		switch {
		case err != nil && ctx.Err() == nil:
			b.cfg.Logger.Warn("lease garbage collection failed", zap.Error(err))
		case n > 0:
			b.cfg.Logger.Info("expired leases deleted", zap.Int("count", n))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
