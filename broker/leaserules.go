package broker

import (
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"time"
)

// leaseRules say which lease Secrets are verifiably the broker's, from the
// policy in force: only those count against a quota or are found by id. A
// tenant who may create Secrets in some namespace can give one the lease
// labels; it counts for nothing unless its peer label names a peer of the
// policy, its identity annotation is that peer's identity, and its
// namespace is one the policy grants that peer. (Its type is checked by the
// API server: the counter lists and watches with a field selector on it.)
type leaseRules struct {
	// peers by name.
	peers map[string]leasePeerRule
	// maxAge caps a lease's recorded expiry at its creation plus maxAge,
	// so that a forged far-future expiry holds no place for long.
	maxAge time.Duration
}

type leasePeerRule struct {
	identity   string
	namespaces map[string]struct{}
}

// verify reports whether a lease Secret in namespace with these peer label
// and identity annotation is one the broker may have made for that peer.
// nil rules (a counter without a broker) verify everything.
func (r *leaseRules) verify(namespace, peer, identity string) bool {
	if r == nil {
		return true
	}
	p, ok := r.peers[peer]
	if !ok || p.identity != identity {
		return false
	}
	_, ok = p.namespaces[namespace]
	return ok
}

// leaseAgeSlack is added to the longest TTL to make leaseRules.maxAge: a
// pooled Secret is claimed up to poolHandout after its creation, and the
// broker's clock, which sets the expiry, may run a little ahead of the API
// server's, which sets the creation time.
const leaseAgeSlack = poolDeadline

// leaseRulesCache is the rules built for one policy and one generation of
// the namespaces selector grants match.
type leaseRulesCache struct {
	policy *policy.Policy
	gen    uint64
	rules  *leaseRules
}

// leaseRules returns the rules of the policy in force, rebuilt only when
// the policy or the namespaces its selector grants match change. Without
// a policy nothing verifies.
func (b *Broker) leaseRules() *leaseRules {
	p := b.cfg.Policy.Load()
	var gen uint64
	if b.tenants != nil {
		gen = b.tenants.gen.Load()
	}
	if c := b.rulesCache.Load(); c != nil && c.policy == p && c.gen == gen {
		return c.rules
	}
	r := &leaseRules{peers: map[string]leasePeerRule{}}
	if p != nil {
		maxTTL := time.Duration(p.TTL.Max)
		for _, iss := range b.cfg.Issuers {
			maxTTL = max(maxTTL, iss.Limits().MinTTL) // the issuer may raise a short TTL
		}
		r.maxAge = maxTTL + leaseAgeSlack
		for i := range p.Peers {
			peer := &p.Peers[i]
			ns := map[string]struct{}{}
			for _, n := range b.peerNamespaces(peer) {
				ns[n] = struct{}{}
			}
			r.peers[peer.Name] = leasePeerRule{identity: peer.Identity, namespaces: ns}
		}
	}
	b.rulesCache.Store(&leaseRulesCache{policy: p, gen: gen, rules: r})
	return r
}
