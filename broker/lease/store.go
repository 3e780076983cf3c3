package lease

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/utils/clock"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// Store reads and writes the broker's lease Secrets with the broker's own
// client, one namespace at a time (listing across all namespaces would
// need the right to read every Secret of the cluster), and times every
// API call. It answers what the lease API, the GC and the gateway ask of
// leases: a page of a holder's leases, one lease by id, the leases
// matching some labels, a credential recorded on a lease.
type Store struct {
	Secrets corev1client.SecretsGetter
	// Counter, if set and synced, tells in which namespaces a lease is,
	// so that a lookup is one list.
	Counter *Counter
	Clock   clock.WithTicker
	// Timed, if set, is told of every API call.
	Timed func(ctx context.Context, call string, start time.Time, err error)
}

func (st *Store) timed(ctx context.Context, call string, start time.Time, err error) {
	if st.Timed != nil {
		st.Timed(ctx, call, start, err)
	}
}

// Holder is whom a lease was made for: a peer, the identity it was
// authenticated as and, when the caller came with one, its workload
// ("namespace/serviceAccount"; "" sees every lease of the identity).
type Holder struct {
	Peer, Identity, Workload string
}

// Holds reports whether the lease Secret s, listed by the peer's label,
// is one the broker made for h: the lease type (a Secret of another type
// with the lease labels is anyone's), the peer's label, the identity and,
// when h has a workload, that workload.
func (h Holder) Holds(s *corev1.Secret) bool {
	if s.Type != objects.SecretTypeLease || s.Labels[objects.LabelPeer] != h.Peer || s.Annotations[objects.AnnotationIdentity] != h.Identity {
		return false
	}
	return h.Workload == "" || s.Annotations[objects.AnnotationWorkload] == h.Workload
}

// NewSecret is the lease Secret of id in namespace, made for h, for a
// credential of kind for serviceAccount under grant, that expires at
// expires.
func NewSecret(id, namespace string, h Holder, serviceAccount, kind, grant string, expires time.Time) *corev1.Secret {
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:      objects.LeaseSecretPrefix + id,
			Namespace: namespace,
			Labels: map[string]string{
				objects.LabelManagedBy: objects.ManagedByValue,
				objects.LabelKind:      objects.LeaseKind,
				objects.LabelLeaseID:   id,
				objects.LabelPeer:      h.Peer,
			},
			Annotations: map[string]string{
				objects.AnnotationExpiresAt: expiryValue(expires),
				objects.AnnotationIdentity:  h.Identity,
				objects.AnnotationSA:        serviceAccount,
				objects.AnnotationCred:      kind,
				objects.AnnotationGrant:     grant,
			},
		},
		Type: objects.SecretTypeLease,
	}
	if h.Workload != "" {
		s.Annotations[objects.AnnotationWorkload] = h.Workload
	}
	return s
}

// SetExpiry records expires as the expiry of the lease s (not yet
// written).
func SetExpiry(s *corev1.Secret, expires time.Time) {
	s.Annotations[objects.AnnotationExpiresAt] = expiryValue(expires)
}

// expiryValue is expires as AnnotationExpiresAt records it: whole seconds,
// UTC.
func expiryValue(expires time.Time) string { return expires.UTC().Format(time.RFC3339) }

// apiPageSize bounds the Secrets one API server list of Page returns.
const apiPageSize = 250

// Page returns up to limit of h's leases from cur on, in namespaces
// (sorted; the holder's), and the continue token of the next page (""
// after the last). Namespaces are searched one at a time in name order;
// in each, the API server pages the list (Limit/Continue) and orders it by
// Secret name, so at most one page is held. A page may hold fewer than
// the limit, even none, and still have a next one: leases of another
// identity or workload are left out after the API server counted them. A
// continue token the API server no longer honours is KindInvalid.
func (st *Store) Page(ctx context.Context, namespaces []string, h Holder, cur Cursor, limit int) (*apiv1.LeaseList, error) {
	out := &apiv1.LeaseList{Items: []apiv1.Lease{}}
	i, _ := slices.BinarySearch(namespaces, cur.Namespace)
	if i >= len(namespaces) || namespaces[i] != cur.Namespace {
		cur.APIContinue = "" // its namespace left the holder's grants: the next one from its start
	}
	set := labels.Set{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.LeaseKind, objects.LabelPeer: h.Peer}
	opts := metav1.ListOptions{LabelSelector: labels.SelectorFromSet(set).String(), Continue: cur.APIContinue}
	for remaining := limit; i < len(namespaces) && remaining > 0; {
		// At most apiPageSize Secrets from the API server at a time, so
		// that a page of 1000 leases holds a quarter of them decoded.
		opts.Limit = int64(min(remaining, apiPageSize))
		t0 := st.Clock.Now()
		list, err := st.Secrets.Secrets(namespaces[i]).List(ctx, opts)
		st.timed(ctx, "list_leases", t0, err)
		switch {
		case apierrors.IsResourceExpired(err) || (opts.Continue != "" && apierrors.IsBadRequest(err)):
			return nil, &problem.Error{Kind: problem.KindInvalid, Detail: "the request is invalid", Err: err, Fields: []apiv1.FieldError{
				{Field: "continue", Detail: "has expired or is not valid; start again without it"}}}
		case err != nil:
			return nil, problem.Classify(err, "list leases in "+namespaces[i], "no Secrets")
		}
		remaining -= len(list.Items)
		for j := range list.Items {
			if s := &list.Items[j]; h.Holds(s) {
				out.Items = append(out.Items, ToAPI(s))
			}
		}
		if list.Continue != "" {
			opts.Continue = list.Continue
			if remaining <= 0 {
				out.Continue = EncodeContinue(Cursor{Namespace: namespaces[i], APIContinue: list.Continue})
				return out, nil
			}
			continue // the API server answered fewer than asked; same namespace
		}
		i, opts.Continue = i+1, ""
	}
	if i < len(namespaces) {
		out.Continue = EncodeContinue(Cursor{Namespace: namespaces[i]})
	}
	return out, nil
}

// Find returns h's lease id from namespaces (the holder's), or
// KindNotFound. It reads the Secrets of the lease type named after the id
// by their name and type, never by a label, which whoever may patch
// Secrets there could strip or rewrite (intact.go). A lease's name is
// unique in its namespace, but whoever may create Secrets in another of
// those namespaces and learns an id can copy it; the copy is made after
// the lease, so the earliest created (on a tie, the first in namespaces,
// which lookupNamespaces orders as the counter saw them) is the lease,
// and it is h's if it names h (namesHolder). wait is as for
// lookupNamespaces.
func (st *Store) Find(ctx context.Context, namespaces []string, h Holder, id string, wait bool) (*corev1.Secret, error) {
	notFound := problem.Errorf(problem.KindNotFound, "lease %q not found", id)
	if !apiv1.ValidLeaseID(id) {
		return nil, notFound
	}
	all := namespaces
	namespaces, err := st.lookupNamespaces(ctx, namespaces, id, wait)
	if err != nil {
		return nil, err
	}
	first, _, err := st.earliestNamed(ctx, namespaces, objects.LeaseSecretPrefix+id)
	if err != nil {
		return nil, err
	}
	switch {
	case first != nil && st.namesHolder(first, h):
		return first, nil
	case wait:
		return st.awaitClaim(ctx, namespaces, all, h, id, notFound)
	}
	return nil, notFound
}

// earliestNamed returns the earliest created Secret of the lease type
// named name in namespaces (the first in namespaces on a tie), or nil, and
// every Secret created in that same second (first among them): creation
// times are in whole seconds, so those cannot be told from it. It lists
// by name and type (field selectors the API server applies; unpaged, one
// Secret per namespace at most), with the list RBAC the broker holds.
func (st *Store) earliestNamed(ctx context.Context, namespaces []string, name string) (*corev1.Secret, []*corev1.Secret, error) {
	opts := metav1.ListOptions{FieldSelector: NamedSelector(name)}
	var first *corev1.Secret
	var tied []*corev1.Secret
	for _, ns := range namespaces {
		t0 := st.Clock.Now()
		list, err := st.Secrets.Secrets(ns).List(ctx, opts)
		st.timed(ctx, "list_leases", t0, err)
		if err != nil {
			return nil, nil, problem.Classify(err, "list lease Secrets in "+ns, "no Secrets")
		}
		for i := range list.Items {
			s := &list.Items[i]
			if s.Name != name || s.Type != objects.SecretTypeLease {
				continue
			}
			switch {
			case first == nil || s.CreationTimestamp.Before(&first.CreationTimestamp):
				first, tied = s, []*corev1.Secret{s}
			case s.CreationTimestamp.Equal(&first.CreationTimestamp):
				tied = append(tied, s)
			}
		}
	}
	return first, tied, nil
}

// Tied returns the Secrets that h's revocation of the lease id must
// revoke besides s, the one Find returned: those of its name in
// namespaces created in the same second as s that also name h. A copy
// someone made in the same second as the lease cannot be told from it
// (creation times are in whole seconds, and which the counter saw first
// proves nothing after a restart or a relist), so rather than leave the
// lease alive when its copy is taken for it, the revocation takes both.
// What else it takes is a Secret of the lease type, named after h's
// lease and naming h: someone's imitation of it.
func (st *Store) Tied(ctx context.Context, namespaces []string, h Holder, id string, s *corev1.Secret) ([]*corev1.Secret, error) {
	namespaces, err := st.lookupNamespaces(ctx, namespaces, id, false)
	if err != nil {
		return nil, err
	}
	_, tied, err := st.earliestNamed(ctx, namespaces, objects.LeaseSecretPrefix+id)
	if err != nil {
		return nil, err
	}
	var out []*corev1.Secret
	for _, t := range tied {
		if t.UID != s.UID && t.CreationTimestamp.Equal(&s.CreationTimestamp) && st.namesHolder(t, h) {
			out = append(out, t)
		}
	}
	return out, nil
}

// namesHolder reports whether the lease Secret s, found by its name, is
// h's: its identity annotation is h's identity (the one thing a lease
// certificate names and the caller proves; a peer label can be edited
// away, so it is not asked for), or was when the counter last saw s,
// under its UID, intact (Counter.IntactHolder: someone else edited it
// since); and, when h comes with a workload, its workload annotation is
// h's.
func (st *Store) namesHolder(s *corev1.Secret, h Holder) bool {
	if s.Annotations[objects.AnnotationIdentity] != h.Identity {
		if st.Counter == nil {
			return false
		}
		if was, ok := st.Counter.IntactHolder(s.Namespace, s.Name, s.UID); !ok || was != h.Identity {
			return false
		}
	}
	return h.Workload == "" || s.Annotations[objects.AnnotationWorkload] == h.Workload
}

// maxBlindLookups bounds the namespaces a revocation asks the API server
// about while the counter is blind to them (unclaimedWhileBlind).
const maxBlindLookups = 16

// unclaimedWhileBlind asks the API server, in the namespaces (at most
// maxBlindLookups) the counter is blind to, for the pooled Secret of a
// lease answered before its claim, which the counter cannot have seen: a
// revocation there deletes it (with its UID as precondition, which a claim
// keeps, so the lease goes whether or not its claim lands first), as after
// ClaimWait.
func (st *Store) unclaimedWhileBlind(ctx context.Context, namespaces []string, name string, notFound error) (*corev1.Secret, error) {
	if st.Counter == nil {
		return nil, notFound
	}
	asked := 0
	for _, n := range namespaces {
		if asked == maxBlindLookups {
			break
		}
		if !st.Counter.Blind(n, st.Clock.Now()) {
			continue
		}
		asked++
		s, pooled, err := st.getPooled(ctx, n, name)
		switch {
		case err != nil:
			return nil, err
		case pooled:
			return s, ErrUnclaimed
		}
	}
	return nil, notFound
}

// getPooled reads the Secret namespace/name from the API server (nil if
// there is none) and reports whether it is an unclaimed pooled Secret.
func (st *Store) getPooled(ctx context.Context, namespace, name string) (*corev1.Secret, bool, error) {
	t0 := st.Clock.Now()
	s, err := st.Secrets.Secrets(namespace).Get(ctx, name, metav1.GetOptions{})
	st.timed(ctx, "get_lease", t0, err)
	switch {
	case apierrors.IsNotFound(err):
		return nil, false, nil
	case err != nil:
		return nil, false, err
	}
	return s, s.Labels[objects.LabelKind] == objects.PoolKind, nil
}

// ErrUnclaimed is Find's answer, with the Secret, for a lease id whose
// pooled Secret is still unclaimed ClaimWait after it was asked for.
var ErrUnclaimed = errors.New("the lease's pooled Secret is not claimed")

// awaitClaim finds h's lease id once its claim lands. A gateway lease is
// answered before its pooled Secret is claimed (the broker's pool.go), so
// its revocation may come first: while the counter sees the Secret
// unclaimed in one of namespaces (where it saw the name), it waits up to
// ClaimWait, by when the claimer has given up. A Secret still unclaimed
// then is returned with ErrUnclaimed, for the revocation to delete it, so
// that no claim can land after it. A claim cannot land unseen on a Secret
// edited since the pool made it (claimPatch's resource version). In the
// holder's namespaces (all) the counter is blind to, the API server is
// asked (unclaimedWhileBlind).
func (st *Store) awaitClaim(ctx context.Context, namespaces, all []string, h Holder, id string, notFound error) (*corev1.Secret, error) {
	lc, name, ns := st.Counter, objects.LeaseSecretPrefix+id, ""
	for _, n := range namespaces {
		if lc != nil && lc.Claiming(n, name) {
			ns = n
			break
		}
	}
	if ns == "" {
		return st.unclaimedWhileBlind(ctx, all, name, notFound)
	}
	deadline := st.Clock.Now().Add(ClaimWait)
	for lc.Claiming(ns, name) && st.Clock.Now().Before(deadline) {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-st.Clock.After(20 * time.Millisecond):
		}
	}
	if !lc.Claiming(ns, name) {
		return st.Find(ctx, all, h, id, false)
	}
	s, pooled, err := st.getPooled(ctx, ns, name)
	switch {
	case err != nil:
		return nil, err
	case s == nil:
		return nil, notFound
	case !pooled:
		return st.Find(ctx, all, h, id, false)
	}
	return s, ErrUnclaimed
}

// lookupWait is how long a lookup waits for the lease counter to see a
// lease it does not know: one just issued by another replica.
const lookupWait = time.Second

// lookupNamespaces returns those of all (sorted) where the lease id may
// be: those the lease counter saw it in (usually one; copies made by
// others may add some), when the counter has synced, so that a lookup is
// one list however many namespaces the holder's grants match; else all,
// listed one at a time. A lease the counter has not seen within
// lookupWait, or seen only outside all, is not found without a list.
// Without wait, a lease the synced counter has not seen is not found at
// once: a GET of an unknown id costs neither an API call nor a wait. A
// DELETE waits, for its 404 tells the caller there is nothing to revoke.
func (st *Store) lookupNamespaces(ctx context.Context, all []string, id string, wait bool) ([]string, error) {
	lc := st.Counter
	if lc == nil || !lc.Synced() {
		return all, nil
	}
	name := objects.LeaseSecretPrefix + id
	deadline := st.Clock.Now().Add(lookupWait)
	for {
		if seen := lc.NamespacesOf(name); len(seen) > 0 {
			var out []string
			for _, ns := range seen {
				if _, granted := slices.BinarySearch(all, ns); granted {
					out = append(out, ns)
				}
			}
			return out, nil // none: only in namespaces the holder holds no leases in
		}
		if !wait || !st.Clock.Now().Before(deadline) {
			return nil, nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-st.Clock.After(20 * time.Millisecond):
		}
	}
}

// List lists lease Secrets (and only those: the kind label keeps used
// join token records out, the type Secrets of anyone else who copied the
// labels) matching sel in namespaces.
func (st *Store) List(ctx context.Context, namespaces []string, sel labels.Set) ([]corev1.Secret, error) {
	set := labels.Set{objects.LabelKind: objects.LeaseKind}
	for k, v := range sel {
		set[k] = v
	}
	list, err := st.listManaged(ctx, namespaces, set, "list_leases")
	return slices.DeleteFunc(list, func(s corev1.Secret) bool { return s.Type != objects.SecretTypeLease }), err
}

// listManaged lists the broker's Secrets of every kind matching sel in
// namespaces, one namespace at a time, timed as call.
func (st *Store) listManaged(ctx context.Context, namespaces []string, sel labels.Set, call string) ([]corev1.Secret, error) {
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
		t0 := st.Clock.Now()
		list, err := st.Secrets.Secrets(ns).List(ctx, opts)
		st.timed(ctx, call, t0, err)
		if err != nil {
			return nil, problem.Classify(err, "list tokenbroker Secrets in "+ns, "no Secrets")
		}
		out = append(out, list.Items...)
	}
	return out, nil
}

// eachManagedPage is listManaged one page of at most SecretPageSize
// Secrets at a time (eachPage), so that no more than a page is held.
func (st *Store) eachManagedPage(ctx context.Context, namespaces []string, call string, fn func([]corev1.Secret) error) error {
	sel := labels.SelectorFromSet(labels.Set{objects.LabelManagedBy: objects.ManagedByValue}).String()
	for _, ns := range namespaces {
		err := eachPage(func(opts metav1.ListOptions) (*corev1.SecretList, error) {
			t0 := st.Clock.Now()
			list, err := st.Secrets.Secrets(ns).List(ctx, opts)
			st.timed(ctx, call, t0, err)
			if err != nil {
				return nil, problem.Classify(err, "list tokenbroker Secrets in "+ns, "no Secrets")
			}
			return list, nil
		}, sel, fn)
		if err != nil {
			return err
		}
	}
	return nil
}

// Create creates the Secret s (a lease, or a pooled Secret, timed as
// call) and returns it as stored.
func (st *Store) Create(ctx context.Context, s *corev1.Secret, call string) (*corev1.Secret, error) {
	t0 := st.Clock.Now()
	created, err := st.Secrets.Secrets(s.Namespace).Create(ctx, s, metav1.CreateOptions{})
	st.timed(ctx, call, t0, err)
	return created, err
}

// RecordCredential writes the credential's API server id (apiID, unless
// empty) and, unless nil, a new expiry on the lease Secret s, in one
// merge patch that applies only to the Secret of s's UID.
func (st *Store) RecordCredential(ctx context.Context, s *corev1.Secret, apiID string, expiresAt *time.Time) error {
	ann := map[string]string{}
	if apiID != "" {
		ann[objects.AnnotationCredentialID] = apiID
	}
	if expiresAt != nil {
		ann[objects.AnnotationExpiresAt] = expiryValue(*expiresAt)
	}
	if len(ann) == 0 {
		return nil
	}
	meta := map[string]any{"annotations": ann}
	if s.UID != "" {
		// The Secret this lease created, not one made since under its name.
		meta["uid"] = s.UID
	}
	patch, err := json.Marshal(map[string]any{"metadata": meta})
	if err != nil {
		return err
	}
	t0 := st.Clock.Now()
	_, err = st.Secrets.Secrets(s.Namespace).Patch(ctx, s.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	st.timed(ctx, "patch_lease", t0, err)
	if err != nil {
		return problem.Classify(err, "record lease credential", "lease Secret vanished")
	}
	return nil
}

// Expired reports whether a lease's recorded expiry has passed; a lease
// without one counts as live.
func Expired(s *corev1.Secret, now time.Time) bool {
	exp, err := time.Parse(time.RFC3339, s.Annotations[objects.AnnotationExpiresAt])
	return err == nil && !now.Before(exp)
}
