package broker

import (
	"context"
	"encoding/json"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/issuers"
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
// takes the create off the critical path only if the create runs while
// the API server is idle. So it is refilled, one Secret at a time, only
// once no issuance has been in flight on the replica for poolQuiet; under
// back-to-back load it empties and issuances take the sequential path, so
// a busy API server gets no extra writes.

// Defaults of PoolConfig.
const (
	DefaultPoolPerNamespace = 4
	DefaultPoolMax          = 64
)

const (
	// poolHandout is the age past which a replica no longer hands out a
	// pooled Secret (it deletes it instead).
	poolHandout = 5 * time.Minute
	// poolIdle is how long a namespace keeps its pool after its last token
	// issuance.
	poolIdle = 5 * time.Minute
	// poolQuiet: the pool is refilled only once no issuance has been in
	// flight on the replica for this long, so that its creates use the
	// API server's idle time and never compete with issuances.
	poolQuiet = 5 * time.Millisecond
	// poolTick is how often the pool is looked after without a kick.
	poolTick = 30 * time.Second
)

// Issuance paths of tokenbroker_lease_pool_issuances_total.
const (
	pathPool       = "pool"
	pathSequential = "sequential"
)

// PoolConfig sizes the lease pool.
type PoolConfig struct {
	// PerNamespace is how many unclaimed Secrets a replica keeps ready in
	// each namespace it issued a token in during the last five minutes;
	// 0 means DefaultPoolPerNamespace, negative disables the pool.
	PerNamespace int
	// Max bounds a replica's unclaimed Secrets over all namespaces; 0
	// means DefaultPoolMax.
	Max int
}

// pooled is one unclaimed Secret: as the API server created it.
type pooled struct {
	secret  *corev1.Secret
	id      string
	created time.Time
}

// leasePool is one replica's pool. Its Secrets are only in its memory: a
// replica never claims another's.
type leasePool struct {
	perNS, max int
	// running is set while RunPool runs: only then does take hand out.
	running atomic.Bool
	// inflight counts the issuances in progress; lastDone is when the last
	// one ended (Unix nanoseconds on the broker's clock).
	inflight atomic.Int32
	lastDone atomic.Int64
	kick     chan struct{}

	mu     sync.Mutex
	ready  map[string][]*pooled // by namespace, oldest first
	n      int                  // Secrets in ready
	wanted map[string]time.Time // namespace → its last token issuance
	stale  []*pooled            // taken out of ready, to delete
}

func newLeasePool(cfg PoolConfig) *leasePool {
	if cfg.PerNamespace < 0 {
		return nil
	}
	if cfg.PerNamespace == 0 {
		cfg.PerNamespace = DefaultPoolPerNamespace
	}
	if cfg.Max == 0 {
		cfg.Max = DefaultPoolMax
	}
	return &leasePool{
		perNS: cfg.PerNamespace, max: cfg.Max, kick: make(chan struct{}, 1),
		ready: map[string][]*pooled{}, wanted: map[string]time.Time{},
	}
}

// take hands out a ready Secret of namespace, or nil, and records the
// namespace's demand either way. The pool is refilled once the issuance
// is done (done), not while its own calls run.
func (p *leasePool) take(namespace string, now time.Time) *pooled {
	if p == nil || !p.running.Load() {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.wanted[namespace] = now
	q := p.ready[namespace]
	for len(q) > 0 {
		s := q[0]
		q = q[1:]
		p.n--
		if now.Sub(s.created) < poolHandout {
			p.setReady(namespace, q)
			return s
		}
		p.stale = append(p.stale, s)
	}
	p.setReady(namespace, q)
	return nil
}

// setReady stores q as namespace's ready Secrets; p.mu is held.
func (p *leasePool) setReady(namespace string, q []*pooled) {
	if len(q) == 0 {
		delete(p.ready, namespace)
		return
	}
	p.ready[namespace] = q
}

// start and done bracket an issuance.
func (p *leasePool) start() { p.inflight.Add(1) }

func (p *leasePool) done(now time.Time) {
	p.lastDone.Store(now.UnixNano())
	p.inflight.Add(-1)
	p.wake()
}

// quietFor is how much longer the replica must stay without an issuance
// in flight before the pool may grow: 0 when it may now, poolQuiet while
// one is in flight.
func (p *leasePool) quietFor(now time.Time) time.Duration {
	if p.inflight.Load() > 0 {
		return poolQuiet
	}
	return max(0, poolQuiet-now.Sub(time.Unix(0, p.lastDone.Load())))
}

func (p *leasePool) wake() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// sweep moves Secrets too old to hand out and those of namespaces without
// recent demand to stale, and returns stale (now empty).
func (p *leasePool) sweep(now time.Time) []*pooled {
	p.mu.Lock()
	defer p.mu.Unlock()
	for ns, last := range p.wanted {
		if now.Sub(last) >= poolIdle {
			delete(p.wanted, ns)
		}
	}
	for ns, q := range p.ready {
		keep := q[:0:0]
		for _, s := range q {
			if _, ok := p.wanted[ns]; ok && now.Sub(s.created) < poolHandout {
				keep = append(keep, s)
				continue
			}
			p.stale = append(p.stale, s)
			p.n--
		}
		p.setReady(ns, keep)
	}
	out := p.stale
	p.stale = nil
	return out
}

// next returns a namespace that wants one more Secret, if the pool holds
// fewer than max.
func (p *leasePool) next() (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n >= p.max {
		return "", false
	}
	best, fewest := "", p.perNS
	for ns := range p.wanted {
		if n := len(p.ready[ns]); n < fewest || (n == fewest && n < p.perNS && ns < best) {
			best, fewest = ns, n
		}
	}
	return best, best != ""
}

// add makes s ready, unless its namespace lost its demand meanwhile.
func (p *leasePool) add(namespace string, s *pooled) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.wanted[namespace]; !ok || len(p.ready[namespace]) >= p.perNS {
		return false
	}
	p.ready[namespace] = append(p.ready[namespace], s)
	p.n++
	return true
}

// drain empties the pool and returns what it held.
func (p *leasePool) drain() []*pooled {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.stale
	for _, q := range p.ready {
		out = append(out, q...)
	}
	p.ready, p.stale, p.n = map[string][]*pooled{}, nil, 0
	return out
}

func (p *leasePool) size() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

// RunPool keeps the lease pool until ctx ends, then deletes the unclaimed
// Secrets it holds. Without it (or with the pool disabled) every issuance
// takes the sequential path.
func (b *Broker) RunPool(ctx context.Context) {
	p := b.pool
	if p == nil {
		return
	}
	p.running.Store(true)
	defer func() {
		p.running.Store(false)
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), b.cfg.CleanupTimeout)
		defer cancel()
		b.deletePooled(ctx, p.drain())
	}()
	for {
		wait := poolTick
		if again := b.tendPool(ctx); again > 0 {
			wait = again
		}
		select {
		case <-ctx.Done():
			return
		case <-p.kick:
		case <-b.cfg.Clock.After(wait):
		}
	}
}

// tendPool deletes what may no longer be handed out and refills, one
// Secret at a time, while the pool may grow. It returns when to look again
// if it stopped because issuances were not quiet yet, else 0.
func (b *Broker) tendPool(ctx context.Context) time.Duration {
	p := b.pool
	defer func() { b.cfg.Metrics.SetPoolReady(p.size()) }()
	b.deletePooled(ctx, p.sweep(b.cfg.Clock.Now()))
	for ctx.Err() == nil {
		ns, ok := p.next()
		if !ok {
			break
		}
		if wait := p.quietFor(b.cfg.Clock.Now()); wait > 0 {
			return wait
		}
		s, err := b.createPooled(ctx, ns)
		if err != nil {
			if apierrors.IsNotFound(err) || apierrors.IsForbidden(err) {
				p.mu.Lock()
				delete(p.wanted, ns) // until the next issuance there
				p.mu.Unlock()
			}
			if ctx.Err() == nil {
				b.cfg.Logger.Warn("lease pool: creating a Secret failed; issuances there take the sequential path",
					zap.String("namespace", ns), zap.Error(err))
			}
			break // try again at the next kick or tick
		}
		if !p.add(ns, s) {
			b.deletePooled(ctx, []*pooled{s})
		}
	}
	return 0
}

func (b *Broker) createPooled(ctx context.Context, namespace string) (*pooled, error) {
	id, err := b.newLeaseID()
	if err != nil {
		return nil, err
	}
	now := b.cfg.Clock.Now()
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:      objects.LeaseSecretPrefix + id,
			Namespace: namespace,
			Labels:    map[string]string{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.PoolKind},
			// The claim deadline: the GC deletes the Secret past it
			// unless a claim recorded the lease's expiry instead.
			Annotations: map[string]string{objects.AnnotationExpiresAt: now.Add(lease.PoolDeadline).UTC().Format(time.RFC3339)},
		},
		Type: objects.SecretTypeLease,
	}
	t0 := b.cfg.Clock.Now()
	created, err := b.cfg.Secrets.Secrets(namespace).Create(ctx, s, metav1.CreateOptions{})
	b.timeAPI(ctx, "create_pooled_lease", t0, err)
	if err != nil {
		return nil, err
	}
	return &pooled{secret: created, id: id, created: now}, nil
}

func (b *Broker) deletePooled(ctx context.Context, ss []*pooled) {
	for _, s := range ss {
		if err := b.deleteSecret(ctx, s.secret); err != nil && ctx.Err() == nil {
			// Nothing is bound to it; the GC deletes it past its deadline.
			b.cfg.Logger.Info("lease pool: deleting an unclaimed Secret failed; the GC deletes it past its deadline",
				zap.String("secret", s.secret.Namespace+"/"+s.secret.Name), zap.Error(err))
		}
	}
}

// claimPatch makes a pooled Secret the lease: lease's labels and
// annotations, its expiry replacing the claim deadline. The UID makes it
// a precondition: the patch fails rather than claim another Secret of the
// same name.
func claimPatch(lease *corev1.Secret, uid types.UID) ([]byte, error) {
	type meta struct {
		UID         types.UID         `json:"uid"`
		Labels      map[string]string `json:"labels"`
		Annotations map[string]string `json:"annotations"`
	}
	return json.Marshal(struct {
		Metadata meta `json:"metadata"`
	}{meta{UID: uid, Labels: lease.Labels, Annotations: lease.Annotations}})
}

// claim makes the pooled Secret s the lease and asks issuer for the
// credential bound to it, both at once. It returns the claimed Secret
// (nil if the claim failed) and the errors of each call. The time spent
// on both counts once as API server wait.
func (b *Broker) claim(ctx context.Context, s *pooled, lease *corev1.Secret, issuer Issuer, kind string, ireq issuers.Request) (*corev1.Secret, issuers.Credential, error, error) {
	patch, err := claimPatch(lease, s.secret.UID)
	if err != nil {
		return nil, issuers.Credential{}, err, nil
	}
	ireq.Lease = issuers.ObjectRef{Kind: "Secret", Name: s.secret.Name, UID: s.secret.UID}
	start := b.cfg.Clock.Now()
	inner := context.WithValue(ctx, apiWaitKey{}, nil) // counted once below
	var (
		claimed  *corev1.Secret
		claimErr error
		done     = make(chan struct{})
	)
	go func() {
		defer close(done)
		t0 := b.cfg.Clock.Now()
		claimed, claimErr = b.cfg.Secrets.Secrets(s.secret.Namespace).Patch(inner, s.secret.Name, types.MergePatchType, patch, metav1.PatchOptions{})
		b.timeAPI(inner, "claim_lease", t0, claimErr)
	}()
	t0 := b.cfg.Clock.Now()
	cred, issueErr := issuer.Issue(inner, ireq)
	b.cfg.Metrics.ObserveIssuer(kind, b.timeAPI(inner, "issue_"+kind, t0, issueErr), issueErr)
	<-done
	if w, ok := ctx.Value(apiWaitKey{}).(*apiWait); ok {
		w.d.Add(int64(b.cfg.Clock.Since(start)))
	}
	return claimed, cred, claimErr, issueErr
}
