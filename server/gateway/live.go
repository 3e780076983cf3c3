package gateway

import (
	"context"
	"sync"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/types"

	"github.com/tokenbroker/tokenbroker/pki"
)

// Leases is what the gateway reads of the live leases: the lease counter
// (lease.Counter).
type Leases interface {
	// Holds reports whether namespace/name is a live lease under uid,
	// issued to the peer identity identity, at now, from memory.
	Holds(namespace, name string, uid types.UID, identity string, now time.Time) (time.Time, bool)
	// Blind reports whether the memory of namespace's leases may be
	// stale at now (its watch broken for a while).
	Blind(namespace string, now time.Time) bool
	// Recheck is Holds asked of the API server; err means it could not
	// tell.
	Recheck(ctx context.Context, namespace, name string, uid types.UID, identity string, now time.Time) (time.Time, bool, error)
	// WaitAdded is closed at the next lease Secret the counter learns of.
	WaitAdded() <-chan struct{}
	// Synced reports whether every watched namespace was listed once.
	Synced() bool
}

// liveness is what live finds of a request's lease.
type liveness int

const (
	// leaseLive: forward the request.
	leaseLive liveness = iota
	// leaseGone: revoked, expired, or not this certificate's (401).
	leaseGone
	// leaseUnconfirmed: the counter is blind and the API server did not
	// answer the recheck (503, Retry-After).
	leaseUnconfirmed
)

// How a blind counter's leases are rechecked with the API server: a
// lease found live is not asked again for recheckFor, so that a blind
// replica costs at most one request to the API server per lease and
// second; at most maxRechecks answers are kept (past them a lease is
// asked at each request); a recheck waits at most recheckTimeout.
const (
	recheckFor     = time.Second
	maxRechecks    = 4096
	recheckTimeout = 2 * time.Second
)

// rechecks are the answers of recent rechecks, and those under way, by
// lease and peer.
type rechecks struct {
	mu sync.Mutex
	m  map[string]*recheck
}

// recheck is one question to the API server; its fields are set before
// done is closed.
type recheck struct {
	done    chan struct{}
	at      time.Time // when it was asked
	expires time.Time
	ok      bool
	result  liveness
}

// fresh reports whether e is an answer that the lease is live that can
// still be used at now.
func (e *recheck) fresh(now time.Time) bool {
	select {
	case <-e.done:
	default:
		return false
	}
	return e.ok && now.Sub(e.at) < recheckFor && now.Before(e.expires)
}

// remember keeps key among the leases gone lately, for as long as a
// request of it could wait for a new lease.
func (g *Gateway) remember(key string) {
	now := g.cfg.Clock.Now()
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.gone) >= maxRecentlyGone {
		for k, until := range g.gone {
			if !now.Before(until) {
				delete(g.gone, k)
			}
		}
		if len(g.gone) >= maxRecentlyGone {
			return
		}
	}
	g.gone[key] = now.Add(newLeaseAge + newLeaseWait)
}

// goneLately reports whether the counter reported key gone lately.
func (g *Gateway) goneLately(key string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	until, ok := g.gone[key]
	if ok && !g.cfg.Clock.Now().Before(until) {
		delete(g.gone, key)
		return false
	}
	return ok
}

// live reports whether the lease n names is live. A lease whose
// certificate was signed moments ago may not have reached the counter
// yet: wait a little for it. While the counter is blind to n's namespace
// (Leases.Blind), its memory is not trusted: the API server is asked.
func (g *Gateway) live(ctx context.Context, n pki.LeaseName, issued time.Time) liveness {
	name, uid := secretName(n), types.UID(n.UID)
	if g.cfg.Leases.Blind(n.Namespace, g.cfg.Clock.Now()) {
		if g.goneLately(leaseKey(n.Namespace, name, uid)) {
			return leaseGone
		}
		return g.recheck(ctx, n, name, uid)
	}
	if _, ok := g.cfg.Leases.Holds(n.Namespace, name, uid, n.Peer, g.cfg.Clock.Now()); ok {
		return leaseLive
	}
	// NotBefore is backdated by pki.Backdate.
	if g.cfg.Clock.Since(issued.Add(pki.Backdate)) > newLeaseAge || g.goneLately(leaseKey(n.Namespace, name, uid)) {
		return leaseGone
	}
	deadline := g.cfg.Clock.NewTimer(newLeaseWait)
	defer deadline.Stop()
	for {
		added := g.cfg.Leases.WaitAdded()
		if _, ok := g.cfg.Leases.Holds(n.Namespace, name, uid, n.Peer, g.cfg.Clock.Now()); ok {
			return leaseLive
		}
		select {
		case <-added:
		case <-deadline.C():
			return leaseGone
		case <-ctx.Done():
			return leaseGone
		}
	}
}

// recheck asks the API server whether the lease n names (the Secret name
// under uid) is live, or reuses an answer given less than recheckFor ago
// or under way.
func (g *Gateway) recheck(ctx context.Context, n pki.LeaseName, name string, uid types.UID) liveness {
	key := leaseKey(n.Namespace, name, uid) + "/" + n.Peer
	now := g.cfg.Clock.Now()
	rc := &g.rechecks
	rc.mu.Lock()
	if rc.m == nil {
		rc.m = map[string]*recheck{}
	}
	e := rc.m[key]
	if e != nil && e.fresh(now) {
		rc.mu.Unlock()
		return leaseLive
	}
	asker := e == nil || isDone(e.done)
	if asker {
		e = &recheck{done: make(chan struct{}), at: now}
		if len(rc.m) >= maxRechecks {
			for k, old := range rc.m {
				if !old.fresh(now) && isDone(old.done) {
					delete(rc.m, k)
				}
			}
		}
		if len(rc.m) < maxRechecks || rc.m[key] != nil {
			rc.m[key] = e
		}
	}
	rc.mu.Unlock()
	if !asker {
		select {
		case <-e.done:
			return e.result
		case <-ctx.Done():
			return leaseUnconfirmed
		}
	}
	// The question outlives the request that asked it: others wait for
	// its answer.
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recheckTimeout)
	defer cancel()
	exp, ok, err := g.cfg.Leases.Recheck(qctx, n.Namespace, name, uid, n.Peer, now)
	result := g.rechecked(n, ok, err)
	if result == leaseGone {
		// Refused from memory from now on, as a lease the counter saw
		// go: a blind replica asks about a gone lease once, not at every
		// request of its holder.
		g.remember(leaseKey(n.Namespace, name, uid))
	}
	rc.mu.Lock()
	e.expires, e.ok, e.result = exp, ok, result
	if !ok && rc.m[key] == e {
		delete(rc.m, key) // only a live answer is reused
	}
	rc.mu.Unlock()
	close(e.done)
	return result
}

// rechecked counts and logs a recheck's answer and says what it means.
func (g *Gateway) rechecked(n pki.LeaseName, ok bool, err error) liveness {
	switch {
	case err != nil:
		g.cfg.Metrics.recheck(recheckError)
		g.cfg.Logger.Warn("lease gateway: blind to the leases and cannot recheck this one with the API server",
			zap.String("lease_id", n.ID), zap.Error(err))
		return leaseUnconfirmed
	case ok:
		g.cfg.Metrics.recheck(recheckLive)
		return leaseLive
	default:
		g.cfg.Metrics.recheck(recheckGone)
		return leaseGone
	}
}

func isDone(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
