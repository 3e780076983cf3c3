package lease

import "time"

// leaseRules say which lease Secrets are verifiably the broker's, from the
// policy in force: only those count against a quota or are found by id. A
// tenant who may create Secrets in some namespace can give one the lease
// labels; it counts for nothing unless its peer label names a peer of the
// policy, its identity annotation is that peer's identity, and its
// namespace is one the policy grants that peer. (Its type is checked by the
// API server: the counter lists and watches with a field selector on it.)
type Rules struct {
	// peers by name.
	Peers map[string]PeerRule
	// maxAge caps a lease's recorded expiry at its creation plus maxAge,
	// so that a forged far-future expiry holds no place for long.
	MaxAge time.Duration
}

type PeerRule struct {
	Identity   string
	Namespaces map[string]struct{}
}

// verify reports whether a lease Secret in namespace with these peer label
// and identity annotation is one the broker may have made for that peer.
// nil rules (a counter without a broker) verify everything.
func (r *Rules) verify(namespace, peer, identity string) bool {
	if r == nil {
		return true
	}
	p, ok := r.Peers[peer]
	if !ok || p.Identity != identity {
		return false
	}
	_, ok = p.Namespaces[namespace]
	return ok
}

// leaseAgeSlack is added to the longest TTL to make leaseRules.maxAge: a
// pooled Secret is claimed up to poolHandout after its creation, and the
// broker's clock, which sets the expiry, may run a little ahead of the API
// server's, which sets the creation time.
const AgeSlack = PoolDeadline

// poolDeadline is a pooled Secret's recorded expiry, counted from its
// creation: past it the GC deletes it.
const PoolDeadline = 10 * time.Minute

// ClaimWait bounds the claim of a gateway lease signed for a pooled Secret
// after its answer; past it the claimer deletes the Secret, and a
// revocation that found the Secret still unclaimed deletes it (Find).
const ClaimWait = 5 * time.Second
