package gateway

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/tokenbroker/tokenbroker/pki"
)

// Leases is what the gateway reads of the live leases: the lease counter
// (lease.Counter).
type Leases interface {
	// Holds reports whether namespace/name is a live lease under uid at
	// now.
	Holds(namespace, name string, uid types.UID, now time.Time) (time.Time, bool)
	// WaitAdded is closed at the next lease Secret the counter learns of.
	WaitAdded() <-chan struct{}
	// Synced reports whether every watched namespace was listed once.
	Synced() bool
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
// yet: wait a little for it.
func (g *Gateway) live(ctx context.Context, n pki.LeaseName, issued time.Time) bool {
	name, uid := secretName(n), types.UID(n.UID)
	if _, ok := g.cfg.Leases.Holds(n.Namespace, name, uid, g.cfg.Clock.Now()); ok {
		return true
	}
	// NotBefore is backdated by pki.Backdate.
	if g.cfg.Clock.Since(issued.Add(pki.Backdate)) > newLeaseAge || g.goneLately(leaseKey(n.Namespace, name, uid)) {
		return false
	}
	deadline := g.cfg.Clock.NewTimer(newLeaseWait)
	defer deadline.Stop()
	for {
		added := g.cfg.Leases.WaitAdded()
		if _, ok := g.cfg.Leases.Holds(n.Namespace, name, uid, g.cfg.Clock.Now()); ok {
			return true
		}
		select {
		case <-added:
		case <-deadline.C():
			return false
		case <-ctx.Done():
			return false
		}
	}
}
