package tenants

import (
	"slices"
	"sync/atomic"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/policy"
)

// LeaseNamespaces are the namespaces where any peer of p (nil: none) may
// hold leases: those p's grants name and those its selector grants match
// now (none on a nil Tracker), sorted, each once.
func (t *Tracker) LeaseNamespaces(p *policy.Policy) []string {
	var namespaces []string
	if p != nil {
		namespaces = p.Namespaces()
	}
	if t != nil {
		namespaces = append(namespaces, t.Namespaces("")...)
		slices.Sort(namespaces)
		namespaces = slices.Compact(namespaces)
	}
	return namespaces
}

// PeerNamespaces are the namespaces where peer may hold leases: those its
// grants name and those its selector grants match now (none on a nil
// Tracker), sorted, each once.
func (t *Tracker) PeerNamespaces(peer *policy.PeerSpec) []string {
	ns := peer.Namespaces()
	if t == nil {
		return ns
	}
	ns = append(ns, t.Namespaces(peer.Name)...)
	slices.Sort(ns)
	return slices.Compact(ns)
}

// RulesCache holds the lease rules (lease.Rules) of one policy and one
// generation of the namespaces its selector grants match, so that they
// are rebuilt only when either changes.
type RulesCache struct {
	last atomic.Pointer[rulesEntry]
}

type rulesEntry struct {
	policy *policy.Policy
	gen    uint64
	rules  *lease.Rules
}

// Rules returns the lease rules of p with the namespaces t matches (t
// may be nil); minTTL is the longest minimum lifetime of an issuer, which
// may raise a short TTL. Without a policy nothing verifies.
func (rc *RulesCache) Rules(p *policy.Policy, t *Tracker, minTTL time.Duration) *lease.Rules {
	var gen uint64
	if t != nil {
		gen = t.Generation()
	}
	if c := rc.last.Load(); c != nil && c.policy == p && c.gen == gen {
		return c.rules
	}
	r := &lease.Rules{Peers: map[string]lease.PeerRule{}}
	if p != nil {
		r.MaxAge = max(time.Duration(p.TTL.Max), minTTL) + lease.AgeSlack
		for i := range p.Peers {
			peer := &p.Peers[i]
			ns := map[string]struct{}{}
			for _, n := range t.PeerNamespaces(peer) {
				ns[n] = struct{}{}
			}
			r.Peers[peer.Name] = lease.PeerRule{Identity: peer.Identity, Namespaces: ns}
		}
	}
	rc.last.Store(&rulesEntry{policy: p, gen: gen, rules: r})
	return r
}
