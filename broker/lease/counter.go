package lease

import (
	"container/heap"
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"
)

// Counter counts the lease Secrets of every peer from metadata-only
// reflectors (watches whose store is the counter itself, so that a lease
// costs one small entry), one per namespace the policy grants (listing
// across all namespaces would need the right to read every Secret of the
// cluster), so
// that the quota check of an issuance reads memory, not the API server. A
// lease counts from its creation until its Secret is deleted: revoked, or
// collected by GC within --gc-interval of its expiry. Requests between
// their check and the informer's sight of their Secret count as reserved,
// so concurrent requests of one replica cannot pass the quota together;
// several replicas can each let one more through in that moment. A lease
// deleted before the informer saw it (a failed issuance) counts until the
// informer's next relist. A lease counts until its recorded expiry (checked
// every leaseSweepInterval), so one GC never collects does not hold a
// place for ever.
//
// Only verifiable leases count (leaseRules): the counter lists and watches
// Secrets of the broker's own type only (a field selector the API server
// applies), and a Secret whose namespace, peer label and identity
// annotation the policy does not bear out, or whose recorded expiry lies
// past its creation plus the longest TTL, counts for nothing or only that
// long. So a tenant who forges lease Secrets takes no place in any quota.
//
// It watches every Secret of that type, whatever its labels, so that no
// edit of a lease's labels takes it out of the counter's sight (or out of
// a lookup's, NamespacesOf); a Secret whose kind label is neither a
// lease's nor a pooled Secret's is only indexed. A lease Secret it saw
// intact and then saw edited is tampered (intact.go): it holds and counts
// nothing from then on, and Tampered hands it to the GC to revoke.
type Counter struct {
	client metadata.Interface
	clock  clock.PassiveClock
	log    *zap.Logger
	// rules, if set, are the broker's leaseRules of the moment; applied
	// is what the counted entries were last verified with.
	rules   func() *Rules
	applied *Rules

	mu      sync.Mutex
	watches map[string]*nsWatch // by namespace
	byKey   map[string]*counted // namespace/name → the lease Secret
	// byName finds a Secret's namespace by its name, for lookups by lease
	// id: the first namespace seen with that name. A lease's name is
	// unique (128 random bits) but anyone may copy it into a Secret of
	// their own elsewhere; such copies go to dupNames, never over an
	// entry of byName, and a lookup sees them all.
	byName   map[string]string
	dupNames map[string][]string
	perPeer  map[string]int // unexpired leases by peer
	live     int            // unexpired leases of all peers
	// reserved are the places of requests not yet seen as Secrets, by
	// peer, oldest first.
	reserved map[string][]*reservation
	// expiring orders the Secrets with a readable expiry that have not
	// passed it, soonest first, so that a sweep touches only what expired;
	// expired holds those that have, for the GC, by key.
	expiring expiryHeap
	expired  map[string]*counted
	// tampered holds the lease Secrets someone else edited since the
	// counter saw them intact, by key, for the GC to revoke.
	tampered map[string]*counted
	// gone, if set, learns of each lease Secret the counter stops knowing
	// (deleted, relisted away, replaced under another UID, its namespace
	// no longer watched); added is closed and replaced whenever one is
	// added (WaitAdded).
	gone  func(namespace, name string, uid types.UID)
	added chan struct{}
}

// counted is a lease Secret the counter knows: its peer, its recorded
// expiry, and whether it still counts (it stops once expired, so that a
// lease GC never collects, left in a namespace the policy stopped
// granting, does not hold a place for ever).
type counted struct {
	key      string
	uid      types.UID
	peer     string
	identity string
	expires  time.Time
	// verified: leaseRules bear the Secret out, so it may count.
	// committed: the broker's own issuance counted it (place.commit)
	// before the informer saw it; it is verified until then.
	verified, committed bool
	// until is when it stops counting: its expiry, capped at creation
	// plus leaseRules.maxAge; due is when the sweep next looks at it.
	until, due time.Time
	live       bool
	// pool marks an unclaimed pooled Secret (PoolKind): never counted,
	// but collected past its deadline like an expired lease.
	pool bool
	// created is the Secret's creation time, for a lease without a
	// readable expiry.
	created time.Time
	// grant and mark are the lease's AnnotationGrant and
	// AnnotationRevokeOnUnmatch (marked: it has one), for the GC's
	// coverage check.
	grant, mark string
	marked      bool
	// foreign: its kind label is neither a lease's nor a pooled
	// Secret's (someone else's Secret of the lease type, or a lease
	// whose kind label was edited): indexed by name, nothing more.
	foreign bool
	// intact: it bears every mark the broker writes on a lease
	// (intactMeta); only an intact lease is held for the gateway. sig is
	// leaseSignature of it, certificate whether it is a client
	// certificate's lease (a revocation deletes its RoleBinding first).
	intact      bool
	sig         signature
	certificate bool
	// tampered: seen intact, then edited by someone else under the same
	// UID (intact.go); peer, identity and certificate are then as the
	// intact Secret had them. It stays so until the Secret is gone.
	tampered bool
}

// baseline reports whether c is a sight of an intact lease that later
// sights of the same UID are held to.
func (c *counted) baseline() bool {
	return c.intact && !c.committed && !c.tampered && !c.pool && !c.foreign
}

// inert reports whether c neither counts nor is collected as a lease or
// a pooled Secret: someone else's Secret, or a tampered lease (revoked
// by Tampered's path instead).
func (c *counted) inert() bool { return c.foreign || c.tampered }

// reservation is one request's place in a quota; done once its Secret is
// counted or the request gave the place back.
type reservation struct{ done bool }

// nsWatch is the reflector of one namespace (or all), which feeds the
// counter directly: the counter is its store, so a lease costs the counter's
// own entry and no informer cache beside it.
type nsWatch struct {
	stop   chan struct{}
	synced atomic.Bool // the first list has been counted
	// watching: a watch of the reflector is open now; open: and the
	// counter's memory is caught up with it (a watch from a resource
	// version at once, a streaming list once its initial events are
	// replaced in); since is when the memory was last known current (the
	// end of a caught-up watch, a list replaced in, or the reflector's
	// start). All are guarded by the counter's mu (Blind).
	watching, open bool
	since          time.Time
}

// NewCounter makes a counter; Run starts it.
func NewCounter(client metadata.Interface, clk clock.PassiveClock, log *zap.Logger) *Counter {
	return &Counter{
		client: client, clock: clk, log: log,
		watches: map[string]*nsWatch{}, byKey: map[string]*counted{}, perPeer: map[string]int{}, reserved: map[string][]*reservation{},
		expired: map[string]*counted{}, byName: map[string]string{}, dupNames: map[string][]string{},
		tampered: map[string]*counted{},
	}
}

// setRules makes the counter count only what rules() verifies; the broker
// sets it. Without it every lease Secret the counter sees counts.
func (lc *Counter) SetRules(rules func() *Rules) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	lc.rules = rules
}

// currentRules returns the rules of the moment; lc.mu must not be held
// (building them reads the policy and the namespace index).
func (lc *Counter) currentRules() *Rules {
	lc.mu.Lock()
	f := lc.rules
	lc.mu.Unlock()
	if f == nil {
		return nil
	}
	return f()
}

// applyLocked re-verifies every counted Secret if r differs from the rules
// they were verified with (a policy reload, a namespace that started or
// stopped matching a selector grant); lc.mu is held.
func (lc *Counter) applyLocked(r *Rules) {
	if r == lc.applied {
		return
	}
	lc.applied = r
	for key, c := range lc.byKey {
		verified := c.committed || !c.pool && !c.inert() && r.verify(keyNamespace(key), c.peer, c.identity)
		if c.verified == verified && c.until.Equal(lc.until(c)) {
			continue
		}
		if c.verified && !verified && lc.gone != nil {
			// The policy no longer bears it out: it holds no gateway
			// lease from now on.
			ns, name, _ := cache.SplitMetaNamespaceKey(key)
			lc.gone(ns, name, c.uid)
		}
		lc.drop(key, c)
		lc.count(&counted{key: key, uid: c.uid, peer: c.peer, identity: c.identity, expires: c.expires,
			pool: c.pool, created: c.created, verified: verified, committed: c.committed,
			grant: c.grant, mark: c.mark, marked: c.marked,
			foreign: c.foreign, intact: c.intact, sig: c.sig, certificate: c.certificate, tampered: c.tampered})
	}
}

// until is when c stops counting: its recorded expiry, capped at its
// creation plus the rules' maxAge (zero: never); lc.mu is held.
func (lc *Counter) until(c *counted) time.Time {
	u := c.expires
	if lc.applied != nil && lc.applied.MaxAge > 0 && !c.created.IsZero() {
		if cap := c.created.Add(lc.applied.MaxAge); u.IsZero() || cap.Before(u) {
			u = cap
		}
	}
	return u
}

// TypeSelector selects Secrets of the lease type only: the API server
// checks it, so a Secret of another type with the lease labels never
// reaches the counter, which sees metadata only. It is the counter's only
// selector: a Secret's type cannot change, its labels can, and a lease
// whose labels someone stripped must stay in sight (intact.go).
var TypeSelector = fields.OneTermEqualSelector("type", string(objects.SecretTypeLease)).String()

// NamedSelector selects the Secret of the lease type named name: how a
// lease is looked up by its id (the name holds it), since a label can be
// stripped and a name cannot.
func NamedSelector(name string) string {
	return fields.AndSelectors(fields.OneTermEqualSelector("metadata.name", name),
		fields.OneTermEqualSelector("type", string(objects.SecretTypeLease))).String()
}

// Run counts until ctx ends. If the broker may list Secrets in every
// namespace (deploy/base binds its role cluster-wide), one informer
// watches them all, however many namespaces a selector grant matches.
// Otherwise (RBAC bound only in the granted namespaces) it keeps one
// informer per namespace of namespaces(), which a policy reload or a
// namespace label can change, checking every interval.
func (lc *Counter) Run(ctx context.Context, namespaces func() []string, interval time.Duration) {
	_, err := lc.client.Resource(SecretsGVR).Namespace(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: TypeSelector, Limit: 1})
	if err == nil {
		lc.log.Info("counting leases with one cluster-wide informer")
		lc.watch([]string{metav1.NamespaceAll})
	} else {
		lc.log.Info("counting leases with one informer per granted namespace", zap.String("cluster_wide_list", err.Error()))
		go wait.UntilWithContext(ctx, func(context.Context) { lc.watch(namespaces()) }, interval)
	}
	wait.UntilWithContext(ctx, func(context.Context) { lc.Sweep() }, leaseSweepInterval)
	lc.stopWatches()
}

// leaseSweepInterval is how often expired leases stop counting.
const leaseSweepInterval = 5 * time.Second

var SecretsGVR = corev1.SchemeGroupVersion.WithResource("secrets")

// watch starts informers for new namespaces and stops those of dropped
// ones, whose Secrets stop counting: the broker no longer looks there.
// A dropped namespace that still holds a lease marked to be revoked on
// unmatch (a namespace that left its selector grant, or whose grant was
// removed) is watched until the last such lease is gone: the GC finds
// what to revoke from the counter, and with per-namespace RBAC nothing
// else would look there again.
func (lc *Counter) watch(namespaces []string) { lc.setWatches(namespaces, true) }

// stopWatches stops every informer.
func (lc *Counter) stopWatches() { lc.setWatches(nil, false) }

func (lc *Counter) setWatches(namespaces []string, keepMarked bool) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	var marked map[string]bool
	for ns, w := range lc.watches {
		if slices.Contains(namespaces, ns) {
			continue
		}
		if keepMarked && marked == nil {
			marked = lc.markedNamespacesLocked()
		}
		if marked[ns] {
			continue
		}
		close(w.stop)
		delete(lc.watches, ns)
		for key, c := range lc.byKey {
			if ns == metav1.NamespaceAll || keyNamespace(key) == ns {
				lc.forget(key, c)
			}
		}
	}
	for _, ns := range namespaces {
		if lc.watches[ns] != nil {
			continue
		}
		w := &nsWatch{stop: make(chan struct{}), since: lc.clock.Now()}
		lw := &cache.ListWatch{
			ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				o.FieldSelector = TypeSelector
				return lc.client.Resource(SecretsGVR).Namespace(ns).List(ctx, o)
			},
			WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				o.FieldSelector = TypeSelector
				wi, err := lc.client.Resource(SecretsGVR).Namespace(ns).Watch(ctx, o)
				if err != nil {
					return nil, err
				}
				// A streaming list (client-go's WatchListClient) starts
				// with the initial events, which the counter sees only
				// at their Replace.
				return lc.tracked(w, wi, o.SendInitialEvents != nil && *o.SendInitialEvents), nil
			},
		}
		r := cache.NewReflectorWithOptions(lw, &metav1.PartialObjectMetadata{}, &counterStore{lc: lc, ns: ns, w: w},
			cache.ReflectorOptions{Name: "lease counter " + ns})
		lc.watches[ns] = w
		go r.Run(w.stop)
	}
}

// markedNamespacesLocked are the namespaces where the counter knows an
// unexpired lease marked AnnotationRevokeOnUnmatch; lc.mu is held.
func (lc *Counter) markedNamespacesLocked() map[string]bool {
	out := map[string]bool{}
	for key, c := range lc.byKey {
		if lc.markedUnexpiredLocked(c) {
			out[keyNamespace(key)] = true
		}
	}
	return out
}

// markedUnexpiredLocked reports whether c is a lease (not a pooled Secret)
// marked AnnotationRevokeOnUnmatch whose recorded expiry has not passed,
// counted or not; lc.mu is held.
func (lc *Counter) markedUnexpiredLocked(c *counted) bool {
	if !c.marked || c.pool || c.inert() {
		return false
	}
	_, expired := lc.expired[c.key]
	// The capped expiry (until): a forged far-future or missing one would
	// keep its namespace watched for ever.
	u := lc.until(c)
	return !expired && (u.IsZero() || lc.clock.Now().Before(u))
}

// counterStore is a reflector's store that counts: what the reflector
// lists and watches in namespace ns (metav1.NamespaceAll: every one) goes
// straight into the counter, and nothing else is kept.
type counterStore struct {
	lc *Counter
	ns string
	w  *nsWatch
}

func (s *counterStore) Add(obj any) error    { s.lc.Observe(obj); return nil }
func (s *counterStore) Update(obj any) error { s.lc.Observe(obj); return nil }
func (s *counterStore) Delete(obj any) error { s.lc.remove(obj); return nil }
func (s *counterStore) Resync() error        { return nil }

// Replace makes the counter's Secrets of the store's namespace those of
// list, after a (re)list.
func (s *counterStore) Replace(list []any, _ string) error {
	lc := s.lc
	keep := make(map[string]bool, len(list))
	r := lc.currentRules()
	lc.mu.Lock()
	lc.applyLocked(r)
	for _, obj := range list {
		if m, ok := obj.(*metav1.PartialObjectMetadata); ok {
			keep[lc.addLocked(m)] = true
		}
	}
	for key, c := range lc.byKey {
		if !keep[key] && (s.ns == metav1.NamespaceAll || keyNamespace(key) == s.ns) {
			lc.forget(key, c)
		}
	}
	// The memory is the list's now; a streaming list's watch goes on
	// from it.
	s.w.since = lc.clock.Now()
	s.w.open = s.w.watching
	lc.mu.Unlock()
	s.w.synced.Store(true)
	return nil
}

func keyNamespace(key string) string {
	ns, _, _ := cache.SplitMetaNamespaceKey(key)
	return ns
}

func (lc *Counter) Observe(obj any) {
	m, ok := obj.(*metav1.PartialObjectMetadata)
	if !ok {
		return
	}
	r := lc.currentRules()
	lc.mu.Lock()
	defer lc.mu.Unlock()
	lc.applyLocked(r)
	lc.addLocked(m)
}

// addLocked counts m, replacing what the counter knew under its key, and
// returns the key; lc.mu is held, and applyLocked has run. Only what the
// counter reads is kept.
func (lc *Counter) addLocked(m *metav1.PartialObjectMetadata) string {
	key := m.Namespace + "/" + m.Name
	if m.DeletionTimestamp != nil {
		// Being deleted (a finalizer holds it): revoked, whatever keeps
		// the object, so it neither counts nor holds a gateway lease.
		if c, seen := lc.byKey[key]; seen {
			lc.forget(key, c)
		}
		return key
	}
	exp, err := time.Parse(time.RFC3339, m.Annotations[objects.AnnotationExpiresAt])
	if err != nil {
		exp = time.Time{} // no readable expiry: counts until creation plus maxAge
	}
	var was *counted
	if c, seen := lc.byKey[key]; seen {
		if c.uid == m.UID {
			lc.drop(key, c)
			was = c
		} else {
			lc.forget(key, c)
		}
	}
	mark, marked := m.Annotations[objects.AnnotationRevokeOnUnmatch]
	kind := m.Labels[objects.LabelKind]
	// Anyone who may create Secrets can make one of the lease type (unless
	// the lease admission policy is on): what is kept of it is bounded, so
	// that large annotations cost the broker no memory. A value longer
	// than the broker ever writes is kept as "", which verifies as nothing.
	c := &counted{key: key, uid: m.UID, peer: m.Labels[objects.LabelPeer], identity: bounded(m.Annotations[objects.AnnotationIdentity], maxKeptIdentity), expires: exp,
		pool: kind == objects.PoolKind, created: m.CreationTimestamp.Time,
		grant: bounded(m.Annotations[objects.AnnotationGrant], maxKeptGrant), mark: bounded(mark, maxKeptMark), marked: marked,
		foreign: kind != objects.LeaseKind && kind != objects.PoolKind,
		intact:  intactMeta(m.Name, m.Labels, m.Annotations), sig: leaseSignature(m.Labels, m.Annotations),
		certificate: m.Annotations[objects.AnnotationCred] == apiv1.CredentialClientCertificate}
	if was != nil && (was.tampered || was.baseline() && (!c.intact || c.sig != was.sig || c.expires.After(was.expires))) {
		// Edited by someone else since it was seen intact (intact.go):
		// revoked as the lease it was, trusted for nothing meanwhile.
		if !was.tampered {
			lc.log.Warn("lease Secret edited by someone other than the broker: it is trusted for nothing and revoked",
				zap.String("namespace", m.Namespace), zap.String("name", m.Name), zap.String("uid", string(m.UID)),
				zap.String("peer", was.peer), zap.String("identity", was.identity))
		}
		c.tampered, c.peer, c.identity, c.certificate = true, was.peer, was.identity, was.certificate
	}
	c.verified = !c.pool && !c.inert() && lc.applied.verify(m.Namespace, c.peer, c.identity)
	if was != nil && was.verified && !was.pool && !was.committed && lc.gone != nil && (!c.verified || c.identity != was.identity) {
		// Edited under its UID (by whoever may write Secrets there) so
		// that it no longer holds the lease it held: its gateway
		// connections end, as at a deletion. A place this replica's
		// issuance committed held no lease yet (a pooled Secret being
		// claimed): its first sight as a lease ends nothing.
		lc.gone(m.Namespace, m.Name, m.UID)
	}
	lc.count(c)
	if lc.added != nil {
		close(lc.added)
		lc.added = nil
	}
	return key
}

// The longest identity, grant and revoke-on-unmatch mark the counter
// keeps of a lease Secret: a peer's identity is a URI the policy names
// (pki bounds it well below), a grant a policy path or name, a mark a
// duration.
const (
	maxKeptIdentity = 2048
	maxKeptGrant    = 256
	maxKeptMark     = 64
)

// bounded is s, or "" if s is longer than max bytes.
func bounded(s string, max int) string {
	if len(s) > max {
		return ""
	}
	return s
}

// count starts counting c, unless it has expired, is not verified or is a
// pooled Secret; lc.mu is held. A foreign or tampered Secret is only
// indexed (and, tampered, kept for Tampered).
func (lc *Counter) count(c *counted) {
	lc.byKey[c.key] = c
	lc.index(c.key)
	if c.tampered {
		lc.tampered[c.key] = c
	}
	if c.inert() {
		return
	}
	now := lc.clock.Now()
	if !c.expires.IsZero() && !now.Before(c.expires) {
		lc.expired[c.key] = c
		return
	}
	c.until = lc.until(c)
	if c.verified && !c.pool && (c.until.IsZero() || now.Before(c.until)) {
		c.live = true
		lc.perPeer[c.peer]++
		lc.live++
	}
	c.due = c.expires
	if c.live {
		c.due = c.until
	}
	if !c.due.IsZero() {
		lc.schedule(c)
	}
}

// schedule has the sweep look at c at c.due; lc.mu is held.
func (lc *Counter) schedule(c *counted) {
	heap.Push(&lc.expiring, c)
	if len(lc.expiring) > 2*len(lc.byKey)+64 {
		lc.compact() // many deleted before they expired
	}
}

// index records key's namespace under its name; the first namespace seen
// keeps byName, later ones go to dupNames. lc.mu is held.
func (lc *Counter) index(key string) {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	first, ok := lc.byName[name]
	switch {
	case !ok:
		lc.byName[name] = ns
	case first != ns && !slices.Contains(lc.dupNames[name], ns):
		lc.dupNames[name] = append(lc.dupNames[name], ns)
	}
}

// unindex removes key from the index; lc.mu is held.
func (lc *Counter) unindex(key string) {
	ns, name, _ := cache.SplitMetaNamespaceKey(key)
	dups := lc.dupNames[name]
	if lc.byName[name] == ns {
		if len(dups) == 0 {
			delete(lc.byName, name)
			return
		}
		lc.byName[name], dups = dups[0], dups[1:]
	} else if i := slices.Index(dups, ns); i >= 0 {
		dups = slices.Delete(slices.Clone(dups), i, i+1)
	}
	if len(dups) == 0 {
		delete(lc.dupNames, name)
	} else {
		lc.dupNames[name] = dups
	}
}

func (lc *Counter) remove(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	lc.mu.Lock()
	defer lc.mu.Unlock()
	if c, ok := lc.byKey[key]; ok {
		lc.forget(key, c)
	}
}

func (lc *Counter) forget(key string, c *counted) {
	lc.drop(key, c)
	if lc.gone != nil {
		ns, name, _ := cache.SplitMetaNamespaceKey(key)
		lc.gone(ns, name, c.uid)
	}
}

// drop removes c from the counter without telling gone: it is being
// replaced by a newer version of the same Secret.
func (lc *Counter) drop(key string, c *counted) {
	delete(lc.byKey, key)
	lc.unindex(key)
	delete(lc.expired, key)
	delete(lc.tampered, key)
	lc.uncount(c)
}

// OnGone makes the counter call f with every lease Secret it stops
// knowing or holding: deleted or being deleted, gone at a relist,
// replaced under another UID, in a namespace no longer watched, or no
// longer borne out by the policy. f runs under the counter's lock and must
// not block or call back into the counter; the lease gateway ends the
// lease's connections from it.
func (lc *Counter) OnGone(f func(namespace, name string, uid types.UID)) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	lc.gone = f
}

// Holds reports whether the counter knows the lease Secret
// namespace/name under uid, as an intact lease (not an unclaimed pooled
// Secret, nor one that lacks a mark the broker writes or that someone
// else edited since: intact.go) issued to the peer identity identity
// (its AnnotationIdentity, which the policy bears out as its peer label's
// identity: a lease certificate names its peer by identity, as
// pki.LeaseName.Peer, and one naming another peer holds nothing), that
// the policy bears out (its peer and
// namespace still granted, as for the quotas) and whose recorded expiry
// has not passed at now; expires is that expiry.
// It reads memory only: a lease Secret created a moment ago may not be
// known yet (WaitAdded), and one deleted while the counter is Blind may
// still be (Recheck asks the API server).
func (lc *Counter) Holds(namespace, name string, uid types.UID, identity string, now time.Time) (expires time.Time, ok bool) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	c, found := lc.byKey[namespace+"/"+name]
	if !found || c.uid != uid || c.identity != identity || c.pool || !c.verified || !c.intact || c.expires.IsZero() || !now.Before(c.expires) {
		return time.Time{}, false
	}
	return c.expires, true
}

// WaitAdded returns a channel closed at the next Secret the counter adds
// or updates, for a caller waiting to learn of a lease just created.
func (lc *Counter) WaitAdded() <-chan struct{} {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	if lc.added == nil {
		lc.added = make(chan struct{})
	}
	return lc.added
}

func (lc *Counter) uncount(c *counted) {
	if !c.live {
		return
	}
	c.live = false
	lc.live--
	if lc.perPeer[c.peer]--; lc.perPeer[c.peer] <= 0 {
		delete(lc.perPeer, c.peer)
	}
}

// sweep stops counting the leases that have expired since they were
// counted and hands them to the GC; Run calls it every few seconds. It
// touches only what expired (and, once each, entries replaced since).
func (lc *Counter) Sweep() {
	r := lc.currentRules()
	now := lc.clock.Now()
	lc.mu.Lock()
	defer lc.mu.Unlock()
	lc.applyLocked(r)
	for len(lc.expiring) > 0 && !now.Before(lc.expiring[0].due) {
		c := heap.Pop(&lc.expiring).(*counted)
		if lc.byKey[c.key] != c {
			continue // replaced or forgotten since
		}
		lc.uncount(c)
		if !c.expires.IsZero() && now.Before(c.expires) {
			// Past creation plus maxAge but not its recorded expiry: it
			// no longer counts, and the GC waits for the expiry.
			c.due = c.expires
			heap.Push(&lc.expiring, c)
			continue
		}
		lc.expired[c.key] = c
	}
}

// compact rebuilds the heap from the entries still current; lc.mu is held.
func (lc *Counter) compact() {
	h := lc.expiring[:0]
	for _, c := range lc.expiring {
		if lc.byKey[c.key] == c {
			h = append(h, c)
		}
	}
	clear(lc.expiring[len(h):])
	lc.expiring = h
	heap.Init(&lc.expiring)
}

// ExpiredSecret is a lease Secret (or an unclaimed pooled one) past its
// recorded expiry, as the counter last saw it.
type ExpiredSecret struct {
	Namespace, Name string
	UID             types.UID
	Expires         time.Time
	// Pool marks an unclaimed pooled Secret past its claim deadline.
	Pool bool
}

// Expired returns, after a sweep, the Secrets whose recorded expiry has
// passed and that the informers have not yet seen deleted, at most max.
func (lc *Counter) Expired(max int) []ExpiredSecret {
	lc.Sweep()
	lc.mu.Lock()
	defer lc.mu.Unlock()
	out := make([]ExpiredSecret, 0, min(max, len(lc.expired)))
	for key, c := range lc.expired {
		if len(out) == max {
			break
		}
		ns, name, _ := cache.SplitMetaNamespaceKey(key)
		out = append(out, ExpiredSecret{Namespace: ns, Name: name, UID: c.uid, Expires: c.expires, Pool: c.pool})
	}
	return out
}

// TamperedSecret is a lease Secret that someone other than the broker
// edited after the counter saw it intact (intact.go), with the holder it
// named then.
type TamperedSecret struct {
	Namespace, Name string
	UID             types.UID
	Peer, Identity  string
	// Certificate: a client certificate's lease, whose RoleBinding its
	// revocation deletes first.
	Certificate bool
}

// Tampered returns at most max of the lease Secrets the counter saw edited
// by someone else, for the GC to revoke. Of several Secrets of one name
// (a lease and copies made of it in other namespaces), only the one a
// lookup by id takes for the lease, the earliest created (the first seen
// on a tie), is returned: a later one is a copy, someone else's Secret,
// which the broker does not delete; it holds nothing either way.
func (lc *Counter) Tampered(max int) []TamperedSecret {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	var out []TamperedSecret
	for key, c := range lc.tampered {
		if len(out) == max {
			break
		}
		ns, name, _ := cache.SplitMetaNamespaceKey(key)
		if !lc.earliestLocked(ns, name, c) {
			continue
		}
		out = append(out, TamperedSecret{Namespace: ns, Name: name, UID: c.uid, Peer: c.peer, Identity: c.identity, Certificate: c.certificate})
	}
	return out
}

// earliestLocked reports whether c, the Secret namespace/name, was
// created before every other Secret of its name the counter knows, or
// with one at the same second but seen first; lc.mu is held.
func (lc *Counter) earliestLocked(namespace, name string, c *counted) bool {
	first := lc.byName[name]
	for _, ns := range append([]string{first}, lc.dupNames[name]...) {
		o := lc.byKey[ns+"/"+name]
		if ns == namespace || o == nil {
			continue
		}
		if o.created.Before(c.created) || o.created.Equal(c.created) && ns == first {
			return false
		}
	}
	return true
}

// TamperedHolder returns the identity the lease Secret namespace/name of
// uid named when the counter last saw it intact, if someone else has
// edited it since (intact.go): whatever the Secret says now (restored,
// even), it is no live lease (Recheck).
func (lc *Counter) TamperedHolder(namespace, name string, uid types.UID) (identity string, ok bool) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	c, found := lc.byKey[namespace+"/"+name]
	if !found || !c.tampered || c.uid != uid {
		return "", false
	}
	return c.identity, true
}

// IntactHolder returns the identity the lease Secret namespace/name of
// uid named when the counter last saw it intact, if it did: its holder
// may still find and revoke it by id whatever someone else has made of
// its identity annotation since, whether the counter has seen that edit
// yet or not (Store.Find reads the Secret from the API server, which may
// be ahead of the counter's watch).
func (lc *Counter) IntactHolder(namespace, name string, uid types.UID) (identity string, ok bool) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	c, found := lc.byKey[namespace+"/"+name]
	if !found || c.uid != uid || !c.tampered && !c.baseline() {
		return "", false
	}
	return c.identity, true
}

// leaseRefs returns the leases the counter knows that record a grant, for
// the GC's coverage check: those that count, and the unexpired ones marked
// to be revoked on unmatch that no longer count because the policy no
// longer grants their peer their namespace (it left its selector grant, or
// the grant or peer was removed) — exactly those the check is for. A
// forged one costs nothing: the revocation deletes only Secrets of the
// lease type in that namespace, which the forger could delete anyway.
func (lc *Counter) LeaseRefs() []Ref {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	var out []Ref
	for key, c := range lc.byKey {
		if c.pool || c.inert() || c.grant == "" || !c.live && !lc.markedUnexpiredLocked(c) {
			continue
		}
		out = append(out, Ref{Namespace: keyNamespace(key), Peer: c.peer, Grant: c.grant,
			Mark: c.mark, Marked: c.marked})
	}
	return out
}

// NamespacesOf returns the namespaces where the counter has seen a lease
// Secret named name, the first seen first; nil if none. More than one
// means someone copied a lease's name: the caller tells them apart.
func (lc *Counter) NamespacesOf(name string) []string {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	ns, ok := lc.byName[name]
	if !ok {
		return nil
	}
	return append([]string{ns}, lc.dupNames[name]...)
}

// Claiming reports whether the Secret namespace/name is, as far as the
// counter knows, a pooled Secret not claimed yet: seen unclaimed, or
// counted by this replica's own issuance (Place.Commit) and not seen
// since.
func (lc *Counter) Claiming(namespace, name string) bool {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	c, ok := lc.byKey[namespace+"/"+name]
	return ok && !c.inert() && (c.pool || c.committed)
}

// Pooled reports whether the counter has seen the Secret namespace/name
// (seen), and whether it saw it as the unclaimed pooled Secret of uid
// (intact): not deleted, relabelled or replaced since the pool made it.
func (lc *Counter) Pooled(namespace, name string, uid types.UID) (seen, intact bool) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	c, ok := lc.byKey[namespace+"/"+name]
	if !ok {
		return false, false
	}
	return true, c.pool && !c.inert() && c.uid == uid
}

// Counted is how many unexpired leases the informers see, reserved places
// left out.
func (lc *Counter) Counted() int {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return lc.live
}

// expiryHeap is a min-heap of counted Secrets by expiry.
type expiryHeap []*counted

func (h expiryHeap) Len() int           { return len(h) }
func (h expiryHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h expiryHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiryHeap) Push(x any)        { *h = append(*h, x.(*counted)) }
func (h *expiryHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return x
}

// Synced reports whether every informer has listed its namespace.
func (lc *Counter) Synced() bool {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	for _, w := range lc.watches {
		if !w.synced.Load() {
			return false
		}
	}
	return true
}

// Live is how many leases peer holds (reserved places included) and how
// many all peers hold.
func (lc *Counter) Live(peer string) (own, total int) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	return lc.perPeer[peer] + len(lc.reserved[peer]), lc.totalLocked()
}

func (lc *Counter) totalLocked() int {
	n := lc.live
	for _, rs := range lc.reserved {
		n += len(rs)
	}
	return n
}

func (lc *Counter) setReserved(peer string, rs []*reservation) {
	if len(rs) == 0 {
		delete(lc.reserved, peer)
		return
	}
	lc.reserved[peer] = rs
}

// reserve takes a place for one more lease of peer if it holds fewer than
// perPeer and all hold fewer than total, or reports which quota is full.
// The request then calls exactly one of the returned place's commit, once
// its lease Secret exists, and release, when it created none.
func (lc *Counter) Reserve(peer string, perPeer, total int) (*Place, string) {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	switch {
	case lc.totalLocked() >= total:
		return nil, QuotaTotal
	case lc.perPeer[peer]+len(lc.reserved[peer]) >= perPeer:
		return nil, QuotaPeer
	}
	r := &reservation{}
	lc.reserved[peer] = append(lc.reserved[peer], r)
	return &Place{lc: lc, peer: peer, r: r}, ""
}

// place is a reserved place in the quota.
type Place struct {
	lc   *Counter
	peer string
	r    *reservation
}

// commit counts the lease Secret namespace/name from now on, as the
// informer will when it sees it.
func (p *Place) Commit(namespace, name string, expires time.Time) {
	lc := p.lc
	lc.mu.Lock()
	defer lc.mu.Unlock()
	if !p.drop() {
		return
	}
	key := namespace + "/" + name
	if c, seen := lc.byKey[key]; !seen || c.pool && !c.inert() {
		var uid types.UID
		if seen {
			lc.drop(key, c) // a claimed pooled Secret the informer saw unclaimed
			uid = c.uid
		}
		// The broker made it just now: it counts until the informer's
		// sight of it is verified in its place.
		lc.count(&counted{key: key, uid: uid, peer: p.peer, expires: expires, created: lc.clock.Now(), verified: true, committed: true})
	}
}

// release gives the place back; after commit it does nothing.
func (p *Place) Release() {
	p.lc.mu.Lock()
	defer p.lc.mu.Unlock()
	p.drop()
}

// drop removes the reservation, once; lc.mu is held.
func (p *Place) drop() bool {
	if p.r.done {
		return false
	}
	p.r.done = true
	rs := p.lc.reserved[p.peer]
	for i, x := range rs {
		if x == p.r {
			p.lc.setReserved(p.peer, append(rs[:i:i], rs[i+1:]...))
			break
		}
	}
	return true
}

// The quotas reserve can find full.
const (
	QuotaPeer  = "maxLiveLeases"
	QuotaTotal = "--max-live-leases"
)

// leaseRef is what the GC's coverage check needs of a lease.
type Ref struct {
	Namespace, Peer, Grant string
	// mark is the lease's AnnotationRevokeOnUnmatch, marked whether it has
	// one.
	Mark   string
	Marked bool
}

func RefOf(s *corev1.Secret) Ref {
	mark, marked := s.Annotations[objects.AnnotationRevokeOnUnmatch]
	return Ref{Namespace: s.Namespace, Peer: s.Labels[objects.LabelPeer], Grant: s.Annotations[objects.AnnotationGrant],
		Mark: mark, Marked: marked}
}
