package lease

import (
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// Defaults of PoolConfig.
const (
	DefaultPoolPerNamespace = 4
	DefaultPoolMax          = 64
)

const (
	// poolHandout is the age past which a replica no longer hands out a
	// pooled Secret (it deletes it instead).
	PoolHandout = 5 * time.Minute
	// poolIdle is how long a namespace keeps its pool after its last token
	// issuance.
	PoolIdle = 5 * time.Minute
	// poolQuiet: the pool is refilled only once no issuance has been in
	// flight on the replica for this long, so that its creates use the
	// API server's idle time and never compete with issuances. Namespaces
	// with gateway demand are refilled at once (Take).
	PoolQuiet = 5 * time.Millisecond
	// poolTick is how often the pool is looked after without a kick.
	PoolTick = 30 * time.Second
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
type Pooled struct {
	Secret  *corev1.Secret
	ID      string
	Created time.Time
}

// leasePool is one replica's pool. Its Secrets are only in its memory: a
// replica never claims another's.
type Pool struct {
	perNS, max int
	// running is set while RunPool runs: only then does take hand out.
	running atomic.Bool
	// activity is the replica's issuances, whose quiet moments the pool
	// is refilled in.
	activity *Activity
	kick     chan struct{}

	mu     sync.Mutex
	ready  map[string][]*Pooled // by namespace, oldest first
	n      int                  // Secrets in ready
	wanted map[string]time.Time // namespace → its last token issuance
	// eager: namespace → its last gateway lease issuance. A gateway lease
	// on a pooled Secret makes no API call before its answer, so refilling
	// competes with no issuance's critical path: such namespaces are
	// refilled without waiting for a quiet moment.
	eager map[string]time.Time
	stale []*Pooled // taken out of ready, to delete
}

// NewPool returns a pool sized by cfg that refills in activity's quiet
// moments, or nil if cfg disables it.
func NewPool(cfg PoolConfig, activity *Activity) *Pool {
	if cfg.PerNamespace < 0 {
		return nil
	}
	if cfg.PerNamespace == 0 {
		cfg.PerNamespace = DefaultPoolPerNamespace
	}
	if cfg.Max == 0 {
		cfg.Max = DefaultPoolMax
	}
	return &Pool{
		perNS: cfg.PerNamespace, max: cfg.Max, activity: activity, kick: make(chan struct{}, 1),
		ready: map[string][]*Pooled{}, wanted: map[string]time.Time{}, eager: map[string]time.Time{},
	}
}

// Take hands out a ready Secret of namespace, or nil, and records the
// namespace's demand either way. For a token the pool is refilled once
// the issuance is done (Done), not while its own calls run; for a
// gateway lease (gateway), whose answer waits on no API call, at once.
func (p *Pool) Take(namespace string, now time.Time, gateway bool) *Pooled {
	if p == nil || !p.running.Load() {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.wanted[namespace] = now
	if gateway {
		p.eager[namespace] = now
		defer p.Wake()
	}
	q := p.ready[namespace]
	for len(q) > 0 {
		s := q[0]
		q = q[1:]
		p.n--
		if now.Sub(s.Created) < PoolHandout {
			p.setReady(namespace, q)
			return s
		}
		p.stale = append(p.stale, s)
	}
	p.setReady(namespace, q)
	return nil
}

// setReady stores q as namespace's ready Secrets; p.mu is held.
func (p *Pool) setReady(namespace string, q []*Pooled) {
	if len(q) == 0 {
		delete(p.ready, namespace)
		return
	}
	p.ready[namespace] = q
}

// QuietFor is how much longer the replica must stay without an issuance
// in flight before the pool may grow (Activity.QuietFor).
func (p *Pool) QuietFor(now time.Time) time.Duration { return p.activity.QuietFor(now) }

// Wake asks the keeper to tend the pool now (an issuance just ended, or
// took a Secret for a gateway lease).
func (p *Pool) Wake() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// sweep moves Secrets too old to hand out and those of namespaces without
// recent demand to stale, and returns stale (now empty).
func (p *Pool) Sweep(now time.Time) []*Pooled {
	p.mu.Lock()
	defer p.mu.Unlock()
	for ns, last := range p.wanted {
		if now.Sub(last) >= PoolIdle {
			delete(p.wanted, ns)
		}
	}
	for ns, last := range p.eager {
		if now.Sub(last) >= PoolIdle {
			delete(p.eager, ns)
		}
	}
	for ns, q := range p.ready {
		keep := q[:0:0]
		for _, s := range q {
			if _, ok := p.wanted[ns]; ok && now.Sub(s.Created) < PoolHandout {
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

// Next returns a namespace that wants one more Secret, if the pool holds
// fewer than max, and whether it is refilled without waiting for quiet
// (it had gateway demand lately). Those come first.
func (p *Pool) Next() (namespace string, eager, ok bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n >= p.max {
		return "", false, false
	}
	best, fewest, bestEager := "", p.perNS, false
	for ns := range p.wanted {
		n := len(p.ready[ns])
		_, e := p.eager[ns]
		switch {
		case n >= p.perNS:
		case best == "", e && !bestEager, e == bestEager && (n < fewest || n == fewest && ns < best):
			best, fewest, bestEager = ns, n, e
		}
	}
	return best, bestEager, best != ""
}

// add makes s ready, unless its namespace lost its demand meanwhile.
func (p *Pool) Add(namespace string, s *Pooled) bool {
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
func (p *Pool) Drain() []*Pooled {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.stale
	for _, q := range p.ready {
		out = append(out, q...)
	}
	p.ready, p.stale, p.n = map[string][]*Pooled{}, nil, 0
	return out
}

func (p *Pool) Size() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

// setRunning says whether RunPool runs: only then does take hand out.
func (p *Pool) SetRunning(on bool) { p.running.Store(on) }

// isRunning reports whether RunPool runs.
func (p *Pool) IsRunning() bool { return p.running.Load() }

// kicked receives when the pool wants tending before its next tick.
func (p *Pool) Kicked() <-chan struct{} { return p.kick }

// forget stops keeping a pool in namespace until its next issuance.
func (p *Pool) Forget(namespace string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.wanted, namespace)
	delete(p.eager, namespace)
}
