package broker

import (
	"context"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/limits"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// DefaultMaxLiveLeasesTotal bounds the leases of all peers together
// (serve --max-live-leases): 20,000 lease Secrets are about 20 MB of etcd's
// default 2 GiB quota.
const DefaultMaxLiveLeasesTotal = 20000

// limitsOf is the wire form of a peer's limits and usage for whoami.
func limitsOf(l policy.Limits, live int) *apiv1.PeerLimits {
	return &apiv1.PeerLimits{
		IssuancesPerMinute: l.IssuancesPerMinute, Burst: l.Burst, RenewalsPerMinute: l.RenewalsPerMinute,
		MaxLiveLeases: l.MaxLiveLeases, LiveLeases: live,
	}
}

// quotaRetry is the Retry-After of a full lease quota: a place frees up
// when a lease is revoked or collected, and GC runs every minute.
const quotaRetry = time.Minute

// admitLease applies the limits of a request that will create a lease:
// its quota and the global one, then the peer's issuance bucket. On
// success it holds a place in the quota (nil without a LeaseCounter),
// which the caller commits once the lease Secret exists or releases.
// Refusals are counted and set a's denial.
func (b *Broker) admitLease(p *policy.Policy, identity, peer string, a *audit.Pending) (*lease.Place, error) {
	lim := p.LimitsFor(p.Peer(identity))
	var pl *lease.Place
	if b.cfg.Leases != nil {
		// The quota first: a request it refuses takes no token of the
		// rate bucket, so the peer can issue as soon as a place is free.
		var full string
		pl, full = b.cfg.Leases.Reserve(peer, lim.MaxLiveLeases, b.cfg.MaxLiveLeases)
		switch full {
		case lease.QuotaPeer:
			return nil, b.refuseLimited(a, peer, limits.ReasonLiveLeases, limits.Limited(quotaRetry,
				"peer %s holds its maxLiveLeases of %d live leases: revoke one (DELETE /v1/leases/{id}) or wait for one to expire", peer, lim.MaxLiveLeases))
		case lease.QuotaTotal:
			return nil, b.refuseLimited(a, peer, limits.ReasonLiveLeasesAll, limits.Limited(quotaRetry,
				"the broker holds its --max-live-leases of %d live leases for all peers together; retry later", b.cfg.MaxLiveLeases))
		}
	}
	if err := b.takeIssuance(identity, peer, lim, a); err != nil {
		if pl != nil {
			pl.Release()
		}
		return nil, err
	}
	return pl, nil
}

// admitIssuance applies the peer's issuance bucket.
func (b *Broker) admitIssuance(p *policy.Policy, identity, peer string, a *audit.Pending) error {
	return b.takeIssuance(identity, peer, p.LimitsFor(p.Peer(identity)), a)
}

// takeIssuance takes a token of the peer's issuance bucket, whose figures
// are lim.
func (b *Broker) takeIssuance(identity, peer string, lim policy.Limits, a *audit.Pending) error {
	if ok, wait := b.limits.Take("issue:"+identity, lim.IssuancesPerMinute, lim.Burst); !ok {
		return b.refuseLimited(a, peer, limits.ReasonIssuanceRate, limits.Limited(wait,
			"peer %s is over its limit of %d issuances a minute (burst %d); retry in %ds", peer, lim.IssuancesPerMinute, lim.Burst, limits.RetrySeconds(wait)))
	}
	return nil
}

// refuseLimited counts and records a refusal by a limit.
func (b *Broker) refuseLimited(a *audit.Pending, peer, reason string, err *problem.Error) error {
	b.cfg.Metrics.ObserveLimited(peer, reason)
	if a != nil {
		a.Denial = reason
	}
	return err
}

// Limits is the peer's limits and usage, for whoami; nil for an identity
// the policy does not know.
func (b *Broker) Limits(c Caller) *apiv1.PeerLimits {
	p := b.cfg.Policy.Load()
	if p == nil {
		return nil
	}
	peer := p.Peer(c.Identity)
	if peer == nil {
		return nil
	}
	live := 0
	if b.cfg.Leases != nil {
		live, _ = b.cfg.Leases.Live(peer.Name)
	}
	return limitsOf(p.LimitsFor(peer), live)
}

type remoteAddrKey struct{}

// WithRemoteAddr returns a context carrying the caller's network address
// (an IP, without the port), which keys the enrollment limits.
func WithRemoteAddr(ctx context.Context, addr string) context.Context {
	return context.WithValue(ctx, remoteAddrKey{}, addr)
}

// RemoteAddr returns the address WithRemoteAddr put in ctx, or "".
func RemoteAddr(ctx context.Context) string {
	a, _ := ctx.Value(remoteAddrKey{}).(string)
	return a
}
