package broker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
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
// token of the next page ("" after the last). A peer sees only its own
// leases: the peer label narrows the query and the identity annotation
// must match, so that a renamed peer never inherits another's. Only the
// namespaces the peer's grants name are searched, one at a time in name
// order, so that the broker needs no cluster-wide access to Secrets; in
// each, the API server pages the list (Limit/Continue) and orders it by
// Secret name, so the broker holds one page at most. A page may hold fewer
// than the limit, even none, and still have a next one: leases of another
// identity or workload are left out after the API server counted them.
//
// An invalid request is KindInvalid, and so is a continue token the API
// server no longer honours (expired: start again).
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
	namespaces := b.peerNamespaces(peer) // sorted
	i, _ := slices.BinarySearch(namespaces, cur.Namespace)
	if i >= len(namespaces) || namespaces[i] != cur.Namespace {
		cur.APIContinue = "" // its namespace left the peer's grants: the next one from its start
	}
	set := labels.Set{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.LeaseKind, objects.LabelPeer: peer.Name}
	opts := metav1.ListOptions{LabelSelector: labels.SelectorFromSet(set).String(), Continue: cur.APIContinue}
	for remaining := limit; i < len(namespaces) && remaining > 0; {
		// At most apiPageSize Secrets from the API server at a time, so
		// that a page of 1000 leases holds a quarter of them decoded.
		opts.Limit = int64(min(remaining, apiPageSize))
		t0 := b.cfg.Clock.Now()
		list, err := b.cfg.Secrets.Secrets(namespaces[i]).List(ctx, opts)
		b.timeAPI(ctx, "list_leases", t0, err)
		switch {
		case apierrors.IsResourceExpired(err) || (opts.Continue != "" && apierrors.IsBadRequest(err)):
			return nil, &problem.Error{Kind: problem.KindInvalid, Detail: "the request is invalid", Err: err, Fields: []apiv1.FieldError{
				{Field: "continue", Detail: "has expired or is not valid; start again without it"}}}
		case err != nil:
			return nil, problem.Classify(err, "list leases in "+namespaces[i], "no Secrets")
		}
		remaining -= len(list.Items)
		for j := range list.Items {
			if s := &list.Items[j]; ownLease(s, c, peer) {
				out.Items = append(out.Items, lease.ToAPI(s))
			}
		}
		if list.Continue != "" {
			opts.Continue = list.Continue
			if remaining <= 0 {
				out.Continue = lease.EncodeContinue(lease.Cursor{Namespace: namespaces[i], APIContinue: list.Continue})
				return out, nil
			}
			continue // the API server answered fewer than asked; same namespace
		}
		i, opts.Continue = i+1, ""
	}
	if i < len(namespaces) {
		out.Continue = lease.EncodeContinue(lease.Cursor{Namespace: namespaces[i]})
	}
	return out, nil
}

// apiPageSize bounds the Secrets one API server list of ListLeases
// returns.
const apiPageSize = 250

// GetLease returns one of the caller's leases. A lease of another peer, or
// of another workload when the caller comes with one, is reported as not
// found, like one that does not exist.
func (b *Broker) GetLease(ctx context.Context, c Caller, id string) (*apiv1.Lease, error) {
	done, err := b.admitLeaseRead(c, nil)
	if err != nil {
		return nil, err
	}
	defer done()
	s, err := b.findLease(ctx, c, id, false)
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
	a := &audit.Pending{Event: audit.Event{Action: audit.ActionRevoke, Identity: c.Identity, CertSHA256: c.CertSHA256, LeaseID: id}}
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
	s, err := b.findLease(ctx, c, id, true)
	if err != nil {
		return err
	}
	ev.Peer, ev.Namespace = s.Labels[objects.LabelPeer], s.Namespace
	ev.ServiceAccount, ev.Credential, ev.User = s.Annotations[objects.AnnotationSA], s.Annotations[objects.AnnotationCred], s.Annotations[objects.AnnotationUser]
	bindingErr, err := b.deleter().Revoke(ctx, s)
	logBindingErr(b.cfg.Logger.With(zap.String("lease_id", id)), bindingErr)
	if err != nil && !errors.Is(err, lease.ErrGone) {
		return problem.Classify(err, "revoke lease", "lease not found")
	}
	b.cfg.Metrics.LeaseDeleted("revoked", 1)
	b.cfg.Logger.Info("lease revoked",
		zap.String("identity", c.Identity),
		zap.String("lease_id", id),
		zap.String("namespace", s.Namespace),
		zap.String("service_account", s.Annotations[objects.AnnotationSA]))
	return nil
}

// deleteLeaseBinding deletes, before the lease Secret s of credential kind
// kind, a client certificate's RoleBinding, the certificate's only
// permission, at once; only one the lease owns (lease.Deleter).
// The garbage collector would delete an owned binding with the lease a
// moment later, so a failure is only logged.
func (b *Broker) deleteLeaseBinding(ctx context.Context, s *corev1.Secret, kind string, log *zap.Logger) {
	if kind != apiv1.CredentialClientCertificate || b.cfg.RoleBindings == nil {
		return
	}
	logBindingErr(log, b.deleter().DeleteOwnedRoleBinding(ctx, s))
}

// logBindingErr logs what became of a lease's RoleBinding that a
// revocation could not delete.
func logBindingErr(log *zap.Logger, err error) {
	switch {
	case errors.Is(err, lease.ErrNotOwned):
		log.Info("the RoleBinding of the lease's name is not the lease's; left alone")
	case err != nil:
		log.Warn("deleting the lease's RoleBinding failed; the garbage collector deletes it with the lease", zap.Error(err))
	}
}

// ownLease reports whether the lease Secret s, listed by the peer's label,
// is one the broker made for caller c: the lease type (a Secret of another
// type with the lease labels is anyone's), the peer's label, the caller's
// identity and, when the caller comes with a workload, that workload.
func ownLease(s *corev1.Secret, c Caller, peer *policy.PeerSpec) bool {
	if s.Type != objects.SecretTypeLease || s.Labels[objects.LabelPeer] != peer.Name || s.Annotations[objects.AnnotationIdentity] != c.Identity {
		return false
	}
	// A workload sees only its own leases.
	return c.Workload == nil || s.Annotations[objects.AnnotationWorkload] == c.Workload.String()
}

// findLease returns the caller's lease id (ownLease), or KindNotFound. A
// lease's name is unique, but whoever may create Secrets in one of the
// peer's namespaces and learns an id can copy it; the copy is made after
// the lease, so the earliest created of the Secrets that pass wins. wait
// is as for leaseLookupNamespaces.
func (b *Broker) findLease(ctx context.Context, c Caller, id string, wait bool) (*corev1.Secret, error) {
	notFound := problem.Errorf(problem.KindNotFound, "lease %q not found", id)
	if !apiv1.ValidLeaseID(id) {
		return nil, notFound
	}
	p, err := b.policy()
	if err != nil {
		return nil, err
	}
	peer := p.Peer(c.Identity)
	if peer == nil {
		return nil, notFound
	}
	namespaces, err := b.leaseLookupNamespaces(ctx, peer, id, wait)
	if err != nil {
		return nil, err
	}
	secrets, err := b.listLeaseSecrets(ctx, namespaces, labels.Set{objects.LabelLeaseID: id, objects.LabelPeer: peer.Name})
	if err != nil {
		return nil, err
	}
	var found *corev1.Secret
	for i := range secrets {
		s := &secrets[i]
		if s.Name != objects.LeaseSecretPrefix+id || !ownLease(s, c, peer) {
			continue
		}
		if found == nil || s.CreationTimestamp.Before(&found.CreationTimestamp) {
			found = s
		}
	}
	if found == nil {
		return nil, notFound
	}
	return found, nil
}

// leaseLookupWait is how long a lookup waits for the lease counter to see
// a lease it does not know: one just issued by another replica.
const leaseLookupWait = time.Second

// leaseLookupNamespaces returns the namespaces where the lease id may be:
// those of the peer the lease counter saw it in (usually one; copies made
// by others may add some), when the counter has synced, so that a lookup
// is one list however many namespaces the peer's grants match; else every
// namespace of the peer, listed one at a time. A lease the counter has not
// seen within leaseLookupWait, or seen only outside the peer's namespaces,
// is not found without a list. Without wait, a lease the synced counter
// has not seen is not found at once: a GET of an unknown id costs neither
// an API call nor a wait. A DELETE waits, for its 404 tells the caller
// there is nothing to revoke.
func (b *Broker) leaseLookupNamespaces(ctx context.Context, peer *policy.PeerSpec, id string, wait bool) ([]string, error) {
	all := b.peerNamespaces(peer)
	lc := b.cfg.Leases
	if lc == nil || !lc.Synced() {
		return all, nil
	}
	name := objects.LeaseSecretPrefix + id
	deadline := b.cfg.Clock.Now().Add(leaseLookupWait)
	for {
		if seen := lc.NamespacesOf(name); len(seen) > 0 {
			var out []string
			for _, ns := range seen {
				if _, granted := slices.BinarySearch(all, ns); granted {
					out = append(out, ns)
				}
			}
			return out, nil // none: only in namespaces the peer holds no leases in
		}
		if !wait || !b.cfg.Clock.Now().Before(deadline) {
			return nil, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-b.cfg.Clock.After(20 * time.Millisecond):
		}
	}
}

// listLeaseSecrets lists lease Secrets (and only those: the kind label
// keeps used join token records out, the type Secrets of anyone else who
// copied the labels) matching sel in the given namespaces.
func (b *Broker) listLeaseSecrets(ctx context.Context, namespaces []string, sel labels.Set) ([]corev1.Secret, error) {
	set := labels.Set{objects.LabelKind: objects.LeaseKind}
	for k, v := range sel {
		set[k] = v
	}
	list, err := b.listManagedSecrets(ctx, namespaces, set, "list_leases")
	return slices.DeleteFunc(list, func(s corev1.Secret) bool { return s.Type != objects.SecretTypeLease }), err
}

// listManagedSecrets lists the broker's Secrets of every kind matching sel
// in the given namespaces, one namespace at a time: listing across all
// namespaces would need the right to read every Secret of the cluster.
func (b *Broker) listManagedSecrets(ctx context.Context, namespaces []string, sel labels.Set, call string) ([]corev1.Secret, error) {
	// Unpaged, for the API server answers a list without a limit from its
	// watch cache: a lookup by lease id in a namespace of 20,000 Secrets
	// took 10.9 s with a limit (read from etcd, filtered there) and takes
	// milliseconds without.
	set := labels.Set{objects.LabelManagedBy: objects.ManagedByValue}
	for k, v := range sel {
		set[k] = v
	}
	opts := metav1.ListOptions{LabelSelector: labels.SelectorFromSet(set).String()}
	var out []corev1.Secret
	for _, ns := range namespaces {
		t0 := b.cfg.Clock.Now()
		list, err := b.cfg.Secrets.Secrets(ns).List(ctx, opts)
		b.timeAPI(ctx, call, t0, err)
		if err != nil {
			return nil, problem.Classify(err, "list tokenbroker Secrets in "+ns, "no Secrets")
		}
		out = append(out, list.Items...)
	}
	return out, nil
}

// gcPageSize is the page size of eachManagedSecretPage.
const gcPageSize = 500

// eachManagedSecretPage is listManagedSecrets one page of at most
// gcPageSize Secrets at a time, so that no more than a page is held.
func (b *Broker) eachManagedSecretPage(ctx context.Context, namespaces []string, sel labels.Set, call string, fn func([]corev1.Secret) error) error {
	set := labels.Set{objects.LabelManagedBy: objects.ManagedByValue}
	for k, v := range sel {
		set[k] = v
	}
	for _, ns := range namespaces {
		opts := metav1.ListOptions{LabelSelector: labels.SelectorFromSet(set).String(), Limit: gcPageSize}
		for {
			t0 := b.cfg.Clock.Now()
			list, err := b.cfg.Secrets.Secrets(ns).List(ctx, opts)
			b.timeAPI(ctx, call, t0, err)
			if err != nil {
				return problem.Classify(err, "list tokenbroker Secrets in "+ns, "no Secrets")
			}
			if err := fn(list.Items); err != nil {
				return err
			}
			if list.Continue == "" {
				break
			}
			opts.Continue = list.Continue
		}
	}
	return nil
}

// CollectGarbage deletes every lease Secret and every used join token
// record whose expiry has passed, and returns how many it deleted. It also
// queues the revocation of every lease whose selector grant no longer
// covers its namespace (queueUncovered: from the lease counter, on full
// passes from a cluster-wide list), which RunTenants carries out after the
// grant's revokeDelay. It looks
// in the namespaces the policy grants and the broker's own: a lease left in
// a namespace that no grant names any more is not collected (its token
// still expires on time; delete it with kubectl by its labels). A lease
// without a readable expiry is deleted once it is older than the policy's
// maximum TTL, since no credential bound to it can still be valid; a used
// join token record without one is kept for usedJoinTokenFallbackRetention.
// Safe to run on several replicas at once.
func (b *Broker) CollectGarbage(ctx context.Context) (int, error) {
	start := b.cfg.Clock.Now()
	n, active, err := b.collectGarbage(ctx)
	b.cfg.Metrics.ObserveGC(b.cfg.Clock.Since(start), active, b.cfg.Clock.Now(), err)
	return n, err
}

// gcFullEvery: every gcFullEvery-th GC pass, the first, and every pass
// while the lease counter is not synced list every Secret of the broker in
// the lease namespaces; the others delete what the counter saw expire and
// list only the used join token records of the broker's own namespace, so
// that their work follows what expired, not how many leases live. The full
// passes collect what the counter cannot know: leases without a readable
// expiry.
const gcFullEvery = 30

// gcBatch bounds the Secrets one pass deletes from the counter's list.
const gcBatch = 5000

// collectGarbage is CollectGarbage; it also returns the number of lease
// Secrets that have not expired, for tokenbroker_leases_active.
func (b *Broker) collectGarbage(ctx context.Context) (int, int, error) {
	now := b.cfg.Clock.Now()
	maxTTL := 24 * time.Hour
	if p := b.cfg.Policy.Load(); p != nil {
		maxTTL = time.Duration(p.TTL.Max)
	}
	namespaces := b.LeaseNamespaces()
	if b.cfg.Namespace != "" && !slices.Contains(namespaces, b.cfg.Namespace) {
		namespaces = append(namespaces, b.cfg.Namespace)
	}
	pass := b.gcPasses.Add(1)
	full := b.cfg.Leases == nil || !b.cfg.Leases.Synced() || pass%gcFullEvery == 1
	// Revocation is durable: leases whose grant no longer covers them are
	// found here, by any replica, whatever happened to the revocation the
	// namespace informer queued (tenants.go).
	b.queueUncovered(ctx, tenants.UnmatchFoundByGC, !full)
	if full {
		// Every kind at once, including lease Secrets made before the kind
		// label existed, a page at a time.
		deleted, active := 0, 0
		var errs []error
		err := b.eachManagedSecretPage(ctx, namespaces, nil, "list_gc", func(page []corev1.Secret) error {
			n, a, err := b.collect(ctx, page, now, maxTTL)
			deleted, active = deleted+n, active+a
			if err != nil {
				errs = append(errs, err) // the other pages still go
			}
			return nil
		})
		if err != nil {
			return deleted, 0, err
		}
		return deleted, active, errors.Join(errs...)
	}
	var secrets []corev1.Secret
	if b.cfg.Namespace != "" {
		var err error
		secrets, err = b.listManagedSecrets(ctx, []string{b.cfg.Namespace}, labels.Set{objects.LabelKind: objects.UsedJoinTokenKind}, "list_gc")
		if err != nil {
			return 0, 0, err
		}
	}
	looked := make(map[string]bool, len(namespaces))
	for _, ns := range namespaces {
		looked[ns] = true
	}
	for _, e := range b.cfg.Leases.Expired(gcBatch) {
		if !looked[e.Namespace] {
			continue // not a namespace the GC looks in (see CollectGarbage)
		}
		kind := objects.LeaseKind
		if e.Pool {
			kind = objects.PoolKind
		}
		secrets = append(secrets, corev1.Secret{ObjectMeta: metav1.ObjectMeta{
			Namespace: e.Namespace, Name: e.Name, UID: e.UID,
			Labels:      map[string]string{objects.LabelKind: kind},
			Annotations: map[string]string{objects.AnnotationExpiresAt: e.Expires.UTC().Format(time.RFC3339)},
		}, Type: objects.SecretTypeLease}) // the counter sees that type only
	}
	n, _, err := b.collect(ctx, secrets, now, maxTTL)
	return n, b.cfg.Leases.Counted(), err
}

// collect deletes those of secrets whose expiry has passed and returns
// how many it deleted and how many leases have not expired.
func (b *Broker) collect(ctx context.Context, secrets []corev1.Secret, now time.Time, maxTTL time.Duration) (int, int, error) {
	leases, others, active := 0, 0, 0
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
			exp = s.CreationTimestamp.Add(enrollment.UsedJoinTokenFallbackRetention)
		default:
			exp = s.CreationTimestamp.Add(maxTTL)
		}
		if now.Before(exp) {
			if !usedToken && kind != objects.PoolKind {
				active++
			}
			continue
		}
		if err := b.deleteSecret(ctx, s); err != nil {
			// One Secret that cannot be deleted must not keep the others;
			// it is retried with backoff until it is gone, not only at
			// the next round.
			errs = append(errs, err)
			b.queueSecretDeletion(s, deleteExpired)
			continue
		}
		if usedToken || kind == objects.PoolKind {
			others++
		} else {
			leases++
		}
	}
	b.cfg.Metrics.LeaseDeleted("expired", leases)
	if others > 0 {
		b.cfg.Logger.Info("expired used join token records and unclaimed pooled Secrets deleted", zap.Int("count", others))
	}
	if len(errs) > 0 {
		return leases + others, active, problem.Classify(errors.Join(errs...), fmt.Sprintf("collect %d expired Secrets", len(errs)), "Secret vanished")
	}
	return leases + others, active, nil
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

// LeaseNamespaces are the namespaces where any peer may hold leases: those
// the policy's grants name and those its selector grants match now,
// sorted, each once.
func (b *Broker) LeaseNamespaces() []string {
	var namespaces []string
	if p := b.cfg.Policy.Load(); p != nil {
		namespaces = p.Namespaces()
	}
	if b.tenants != nil {
		namespaces = append(namespaces, b.tenants.Namespaces("")...)
		slices.Sort(namespaces)
		namespaces = slices.Compact(namespaces)
	}
	return namespaces
}

// peerNamespaces returns the namespaces where the peer may hold leases:
// those its grants name and those its selector grants match now, sorted,
// each once.
func (b *Broker) peerNamespaces(peer *policy.PeerSpec) []string {
	ns := peer.Namespaces()
	if b.tenants == nil {
		return ns
	}
	ns = append(ns, b.tenants.Namespaces(peer.Name)...)
	slices.Sort(ns)
	return slices.Compact(ns)
}
