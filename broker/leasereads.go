package broker

import (
	"time"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/limits"
)

// leaseReadsRetry is the Retry-After of a refusal by the in-flight cap: a
// lease read takes milliseconds, one lookup waits a second at most.
const leaseReadsRetry = time.Second

// admitLeaseRead applies the caller's lease read limits (LimitsSpec
// LeaseReadsPerMinute, LeaseReadsInFlight) to a GET /v1/leases page or a
// GET or DELETE of one lease: first the cap on reads in flight, then the
// bucket, so that a read the cap refuses takes no token. On success the
// caller calls done when the read is over. An identity the policy does
// not know is not limited here: it is answered from memory (an empty
// list, not found) without an API call. A refusal is counted, and set as
// a's denial if a is not nil.
func (b *Broker) admitLeaseRead(c Caller, a *audit.Pending) (done func(), err error) {
	p, err := b.policy()
	if err != nil {
		return nil, err
	}
	peer := p.Peer(c.Identity)
	if peer == nil {
		return func() {}, nil
	}
	lim := p.LimitsFor(peer)
	if !b.reads.Acquire(c.Identity, lim.LeaseReadsInFlight) {
		return nil, b.refuseLimited(a, peer.Name, limits.ReasonLeaseReads, limits.Limited(leaseReadsRetry,
			"peer %s has its leaseReadsInFlight of %d lease reads waiting on the API server; retry in %ds", peer.Name, lim.LeaseReadsInFlight, limits.RetrySeconds(leaseReadsRetry)))
	}
	if ok, wait := b.limits.Take("read:"+c.Identity, lim.LeaseReadsPerMinute, lim.LeaseReadsPerMinute); !ok {
		b.reads.Release(c.Identity)
		return nil, b.refuseLimited(a, peer.Name, limits.ReasonLeaseReadRate, limits.Limited(wait,
			"peer %s is over its limit of %d lease reads a minute; retry in %ds", peer.Name, lim.LeaseReadsPerMinute, limits.RetrySeconds(wait)))
	}
	return func() { b.reads.Release(c.Identity) }, nil
}
