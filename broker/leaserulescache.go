package broker

import (
	"time"

	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/policy"
)

// leaseRulesCache is the rules built for one policy and one generation of
// the namespaces selector grants match.
type leaseRulesCache struct {
	policy *policy.Policy
	gen    uint64
	rules  *lease.Rules
}

// leaseRules returns the rules of the policy in force, rebuilt only when
// the policy or the namespaces its selector grants match change. Without
// a policy nothing verifies.
func (b *Broker) leaseRules() *lease.Rules {
	p := b.cfg.Policy.Load()
	var gen uint64
	if b.tenants != nil {
		gen = b.tenants.Generation()
	}
	if c := b.rulesCache.Load(); c != nil && c.policy == p && c.gen == gen {
		return c.rules
	}
	r := &lease.Rules{Peers: map[string]lease.PeerRule{}}
	if p != nil {
		maxTTL := time.Duration(p.TTL.Max)
		for _, iss := range b.cfg.Issuers {
			maxTTL = max(maxTTL, iss.Limits().MinTTL) // the issuer may raise a short TTL
		}
		r.MaxAge = maxTTL + lease.AgeSlack
		for i := range p.Peers {
			peer := &p.Peers[i]
			ns := map[string]struct{}{}
			for _, n := range b.peerNamespaces(peer) {
				ns[n] = struct{}{}
			}
			r.Peers[peer.Name] = lease.PeerRule{Identity: peer.Identity, Namespaces: ns}
		}
	}
	b.rulesCache.Store(&leaseRulesCache{policy: p, gen: gen, rules: r})
	return r
}
