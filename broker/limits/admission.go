package limits

import (
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// DefaultMaxLiveLeasesTotal bounds the leases of all peers together
// (serve --max-live-leases): 20,000 lease Secrets are about 20 MB of etcd's
// default 2 GiB quota.
const DefaultMaxLiveLeasesTotal = 20000

// Admission applies the limits of the policy in force to one request:
// which bucket, cap or quota applies, in which order, and the refusal it
// answers. Every refusal is counted (tokenbroker_limited_total) and set
// as the denial of the request's audit event when there is one.
type Admission struct {
	// Buckets are the per-identity buckets of issuances, renewals and
	// lease reads; Enrollments those of sources and join tokens.
	Buckets     *Limiter
	Enrollments *EnrollLimiter
	Reads       *InFlight
	// Leases holds the quota places; nil enforces no quota.
	// MaxLiveLeases bounds all peers' leases together.
	Leases        *lease.Counter
	MaxLiveLeases int
	Metrics       *metrics.Metrics
}

// refuse counts and records a refusal by a limit.
func (ad *Admission) refuse(a *audit.Pending, peer, reason string, err *problem.Error) error {
	ad.Metrics.ObserveLimited(peer, reason)
	if a != nil {
		a.Denial = reason
	}
	return err
}

// quotaRetry is the Retry-After of a full lease quota: a place frees up
// when a lease is revoked or collected, and GC runs every minute.
const quotaRetry = time.Minute

// Lease applies the limits of a request that will create a lease: its
// quota and the global one, then the peer's issuance bucket. On success
// it holds a place in the quota (nil without Leases), which the caller
// commits once the lease Secret exists or releases.
//
// key names the buckets taken from: the peer's identity, or a workload's
// own (its workload identity) for one that asks without the peer (a pod
// certificate), with the peer's figures; the live-lease quota is the
// peer's whoever asks.
func (ad *Admission) Lease(p *policy.Policy, identity, key, peer string, a *audit.Pending) (*lease.Place, error) {
	lim := p.LimitsFor(p.Peer(identity))
	var pl *lease.Place
	if ad.Leases != nil {
		// The quota first: a request it refuses takes no token of the
		// rate bucket, so the peer can issue as soon as a place is free.
		var full string
		pl, full = ad.Leases.Reserve(peer, lim.MaxLiveLeases, ad.MaxLiveLeases)
		switch full {
		case lease.QuotaPeer:
			return nil, ad.refuse(a, peer, ReasonLiveLeases, Limited(quotaRetry,
				"peer %s holds its maxLiveLeases of %d live leases: revoke one (DELETE /v1/leases/{id}) or wait for one to expire", peer, lim.MaxLiveLeases))
		case lease.QuotaTotal:
			return nil, ad.refuse(a, peer, ReasonLiveLeasesAll, Limited(quotaRetry,
				"the broker holds its --max-live-leases of %d live leases for all peers together; retry later", ad.MaxLiveLeases))
		}
	}
	if err := ad.issuance(key, peer, lim, a); err != nil {
		if pl != nil {
			pl.Release()
		}
		return nil, err
	}
	return pl, nil
}

// Issuance applies the peer's issuance bucket alone (key as for Lease).
func (ad *Admission) Issuance(p *policy.Policy, identity, key, peer string, a *audit.Pending) error {
	return ad.issuance(key, peer, p.LimitsFor(p.Peer(identity)), a)
}

// issuance takes a token of the issuance bucket of key, whose figures are
// lim.
func (ad *Admission) issuance(key, peer string, lim policy.Limits, a *audit.Pending) error {
	if ok, wait := ad.Buckets.Take("issue:"+key, lim.IssuancesPerMinute, lim.Burst); !ok {
		return ad.refuse(a, peer, ReasonIssuanceRate, Limited(wait,
			"peer %s is over its limit of %d issuances a minute (burst %d); retry in %ds", peer, lim.IssuancesPerMinute, lim.Burst, RetrySeconds(wait)))
	}
	return nil
}

// leaseReadsRetry is the Retry-After of a refusal by the in-flight cap: a
// lease read takes milliseconds, one lookup waits a second at most.
const leaseReadsRetry = time.Second

// LeaseRead applies the caller's lease read limits (LimitsSpec
// LeaseReadsPerMinute, LeaseReadsInFlight) to a GET /v1/leases page or a
// GET or DELETE of one lease: first the cap on reads in flight, then the
// bucket, so that a read the cap refuses takes no token. On success the
// caller calls done when the read is over. An identity the policy does
// not know is not limited here: it is answered from memory (an empty
// list, not found) without an API call. key is as for Lease.
func (ad *Admission) LeaseRead(p *policy.Policy, identity, key string, a *audit.Pending) (done func(), err error) {
	peer := p.Peer(identity)
	if peer == nil {
		return func() {}, nil
	}
	lim := p.LimitsFor(peer)
	if !ad.Reads.Acquire(key, lim.LeaseReadsInFlight) {
		return nil, ad.refuse(a, peer.Name, ReasonLeaseReads, Limited(leaseReadsRetry,
			"peer %s has its leaseReadsInFlight of %d lease reads waiting on the API server; retry in %ds", peer.Name, lim.LeaseReadsInFlight, RetrySeconds(leaseReadsRetry)))
	}
	if ok, wait := ad.Buckets.Take("read:"+key, lim.LeaseReadsPerMinute, lim.LeaseReadsPerMinute); !ok {
		ad.Reads.Release(key)
		return nil, ad.refuse(a, peer.Name, ReasonLeaseReadRate, Limited(wait,
			"peer %s is over its limit of %d lease reads a minute; retry in %ds", peer.Name, lim.LeaseReadsPerMinute, RetrySeconds(wait)))
	}
	return func() { ad.Reads.Release(key) }, nil
}

// Renewal applies the peer's renewal bucket.
func (ad *Admission) Renewal(p *policy.Policy, identity string, a *audit.Pending) error {
	peer := p.Peer(identity)
	name := ""
	if peer != nil {
		name = peer.Name
	}
	lim := p.LimitsFor(peer)
	if ok, wait := ad.Buckets.Take("renew:"+identity, lim.RenewalsPerMinute, lim.RenewalsPerMinute); !ok {
		return ad.refuse(a, name, ReasonRenewalRate, Limited(wait,
			"over the limit of %d renewals a minute; retry in %ds", lim.RenewalsPerMinute, RetrySeconds(wait)))
	}
	return nil
}

// Enrollment applies the enrollment buckets of the source (when the
// transport gave one) and then of the join token, before the token is
// even verified, so that guessing costs the guesser. The source comes
// first: a source over its limit is refused before a bucket is made for
// its token, so one address cannot fill the limiter with junk tokens.
func (ad *Admission) Enrollment(p *policy.Policy, addr, token string, a *audit.Pending) error {
	n := p.EnrollmentsPerMinute()
	keys := make([]string, 0, 2)
	if addr != "" {
		keys = append(keys, EnrollSourceKey(addr))
	}
	keys = append(keys, JoinTokenKey(token))
	for _, k := range keys {
		if ok, wait := ad.Enrollments.Take(k, n, n); !ok {
			return ad.refuse(a, "", ReasonEnrollRate, Limited(wait,
				"over the limit of %d enrollments a minute from one address or with one join token; retry in %ds", n, RetrySeconds(wait)))
		}
	}
	return nil
}

// Usage is the wire form of a peer's limits and its live leases, for
// whoami.
func Usage(l policy.Limits, live int) *apiv1.PeerLimits {
	return &apiv1.PeerLimits{
		IssuancesPerMinute: l.IssuancesPerMinute, Burst: l.Burst, RenewalsPerMinute: l.RenewalsPerMinute,
		MaxLiveLeases: l.MaxLiveLeases, LiveLeases: live,
	}
}
