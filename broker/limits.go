package broker

import (
	"context"
	"crypto/sha256"
	"fmt"
	"math"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"k8s.io/utils/clock"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// DefaultMaxLiveLeasesTotal bounds the leases of all peers together
// (serve --max-live-leases): 20,000 lease Secrets are about 20 MB of etcd's
// default 2 GiB quota.
const DefaultMaxLiveLeasesTotal = 20000

// limiter holds the token buckets of issuance and renewal, keyed by
// verified identity, so bounded by the identities the CA has certified;
// sweeping full buckets (the same as new ones) past maxSweptBuckets keeps
// those of peers gone. Enrollment, unauthenticated, has its own
// (enrollLimiter).
type limiter struct {
	clock clock.PassiveClock
	mu    sync.Mutex
	// buckets by key; a bucket is remade when its figures change.
	buckets map[string]*bucket
}

type bucket struct {
	perMinute, burst int
	lim              *rate.Limiter
}

// maxSweptBuckets is the size above which full buckets are dropped.
const maxSweptBuckets = 4096

func newLimiter(c clock.PassiveClock) *limiter {
	return &limiter{clock: c, buckets: map[string]*bucket{}}
}

// take takes one token from the bucket key (perMinute, burst), or reports
// how long until one is there.
func (l *limiter) take(key string, perMinute, burst int) (ok bool, retryAfter time.Duration) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.buckets[key]
	if b == nil || b.perMinute != perMinute || b.burst != burst {
		if len(l.buckets) >= maxSweptBuckets {
			l.sweep(now)
		}
		// A new bucket is full.
		b = &bucket{perMinute: perMinute, burst: burst, lim: rate.NewLimiter(rate.Limit(float64(perMinute)/60), burst)}
		l.buckets[key] = b
	}
	return takeAt(b.lim, now)
}

// takeAt takes one token from lim at now, or reports how long until one is
// there (a minute if it never will be); a refusal takes nothing.
func takeAt(lim *rate.Limiter, now time.Time) (ok bool, retryAfter time.Duration) {
	r := lim.ReserveN(now, 1)
	if !r.OK() {
		return false, time.Minute
	}
	if d := r.DelayFrom(now); d > 0 {
		r.CancelAt(now)
		return false, d
	}
	return true, 0
}

// sweep drops the buckets that are full: remade, they are the same.
func (l *limiter) sweep(now time.Time) {
	for k, b := range l.buckets {
		if b.lim.TokensAt(now) >= float64(b.burst) {
			delete(l.buckets, k)
		}
	}
}

// limited is an *Error of KindTooManyRequests naming the limit and when to
// come back.
func limited(retryAfter time.Duration, format string, args ...any) *problem.Error {
	e := problem.Errorf(problem.KindTooManyRequests, format, args...)
	e.RetryAfter = retryAfter
	return e
}

// retrySeconds rounds a wait up to whole seconds, at least 1.
func retrySeconds(d time.Duration) int {
	return max(1, int(math.Ceil(d.Seconds())))
}

// joinTokenKey keys a join token's bucket by its digest, so that the
// token itself is never held.
func joinTokenKey(token string) string {
	sum := sha256.Sum256([]byte(token))
	return fmt.Sprintf("enroll-token:%x", sum[:16])
}

// limitsOf is the wire form of a peer's limits and usage for whoami.
func limitsOf(l policy.Limits, live int) *apiv1.PeerLimits {
	return &apiv1.PeerLimits{
		IssuancesPerMinute: l.IssuancesPerMinute, Burst: l.Burst, RenewalsPerMinute: l.RenewalsPerMinute,
		MaxLiveLeases: l.MaxLiveLeases, LiveLeases: live,
	}
}

// Reason codes of tokenbroker_limited_total and of the audit.
const (
	limitIssuanceRate  = "issuance_rate"
	limitRenewalRate   = "renewal_rate"
	limitEnrollRate    = "enrollment_rate"
	limitLiveLeases    = "max_live_leases"
	limitLiveLeasesAll = "global_max_live_leases"
	limitLeaseReadRate = "lease_read_rate"
	limitLeaseReads    = "lease_reads_in_flight"
)

// quotaRetry is the Retry-After of a full lease quota: a place frees up
// when a lease is revoked or collected, and GC runs every minute.
const quotaRetry = time.Minute

// admitLease applies the limits of a request that will create a lease:
// its quota and the global one, then the peer's issuance bucket. On
// success it holds a place in the quota (nil without a LeaseCounter),
// which the caller commits once the lease Secret exists or releases.
// Refusals are counted and set a's denial.
func (b *Broker) admitLease(p *policy.Policy, identity, peer string, a *pendingAudit) (*lease.Place, error) {
	lim := p.LimitsFor(p.Peer(identity))
	var pl *lease.Place
	if b.cfg.Leases != nil {
		// The quota first: a request it refuses takes no token of the
		// rate bucket, so the peer can issue as soon as a place is free.
		var full string
		pl, full = b.cfg.Leases.Reserve(peer, lim.MaxLiveLeases, b.cfg.MaxLiveLeases)
		switch full {
		case lease.QuotaPeer:
			return nil, b.refuseLimited(a, peer, limitLiveLeases, limited(quotaRetry,
				"peer %s holds its maxLiveLeases of %d live leases: revoke one (DELETE /v1/leases/{id}) or wait for one to expire", peer, lim.MaxLiveLeases))
		case lease.QuotaTotal:
			return nil, b.refuseLimited(a, peer, limitLiveLeasesAll, limited(quotaRetry,
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
func (b *Broker) admitIssuance(p *policy.Policy, identity, peer string, a *pendingAudit) error {
	return b.takeIssuance(identity, peer, p.LimitsFor(p.Peer(identity)), a)
}

// takeIssuance takes a token of the peer's issuance bucket, whose figures
// are lim.
func (b *Broker) takeIssuance(identity, peer string, lim policy.Limits, a *pendingAudit) error {
	if ok, wait := b.limits.take("issue:"+identity, lim.IssuancesPerMinute, lim.Burst); !ok {
		return b.refuseLimited(a, peer, limitIssuanceRate, limited(wait,
			"peer %s is over its limit of %d issuances a minute (burst %d); retry in %ds", peer, lim.IssuancesPerMinute, lim.Burst, retrySeconds(wait)))
	}
	return nil
}

// refuseLimited counts and records a refusal by a limit.
func (b *Broker) refuseLimited(a *pendingAudit, peer, reason string, err *problem.Error) error {
	b.cfg.Metrics.ObserveLimited(peer, reason)
	if a != nil {
		a.denial = reason
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

// admitRenewal applies the peer's renewal bucket.
func (b *Broker) admitRenewal(identity string, a *pendingAudit) error {
	p, err := b.policy()
	if err != nil {
		return err
	}
	peer := p.Peer(identity)
	name := ""
	if peer != nil {
		name = peer.Name
	}
	lim := p.LimitsFor(peer)
	if ok, wait := b.limits.take("renew:"+identity, lim.RenewalsPerMinute, lim.RenewalsPerMinute); !ok {
		return b.refuseLimited(a, name, limitRenewalRate, limited(wait,
			"over the limit of %d renewals a minute; retry in %ds", lim.RenewalsPerMinute, retrySeconds(wait)))
	}
	return nil
}

// admitEnrollment applies the enrollment buckets of the source (when the
// transport gave one) and then of the join token, before the token is
// even verified, so that guessing costs the guesser. The source comes
// first: a source over its limit is refused before a bucket is made for
// its token, so one address cannot fill the limiter with junk tokens.
func (b *Broker) admitEnrollment(addr, token string, a *pendingAudit) error {
	p, err := b.policy()
	if err != nil {
		return err
	}
	n := p.EnrollmentsPerMinute()
	keys := make([]string, 0, 2)
	if addr != "" {
		keys = append(keys, enrollSourceKey(addr))
	}
	keys = append(keys, joinTokenKey(token))
	for _, k := range keys {
		if ok, wait := b.enrollLim.take(k, n, n); !ok {
			return b.refuseLimited(a, "", limitEnrollRate, limited(wait,
				"over the limit of %d enrollments a minute from one address or with one join token; retry in %ds", n, retrySeconds(wait)))
		}
	}
	return nil
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
