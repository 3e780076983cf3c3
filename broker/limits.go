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
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// Built-in limits, in force when the policy says nothing. Every issuance
// writes a Secret to etcd, so they are on by default: an agent asks a few
// times an hour per target, a person's kubectl plugin once per refresh
// point; 60 a minute with a burst of 30 is far above either and still
// caps a peer in a loop at 3,600 Secrets an hour, of which at most
// DefaultMaxLiveLeases live at once.
const (
	DefaultIssuancesPerMinute   = 60
	DefaultIssuanceBurst        = 30
	DefaultRenewalsPerMinute    = 6
	DefaultMaxLiveLeases        = 1000
	DefaultEnrollmentsPerMinute = 10
	// DefaultLeaseReadsPerMinute bounds GET /v1/leases (a page), GET and
	// DELETE /v1/leases/{id} of one identity, each an API server list at
	// most: an agent revokes once per refresh, a person pages a listing;
	// 120 a minute (burst the same) is far above either.
	DefaultLeaseReadsPerMinute = 120
	// DefaultLeaseReadsInFlight is how many of those one identity may have
	// waiting on the API server at once.
	DefaultLeaseReadsInFlight = 4
	// DefaultMaxLiveLeasesTotal bounds the leases of all peers together
	// (serve --max-live-leases): 20,000 lease Secrets are about 20 MB of
	// etcd's default 2 GiB quota.
	DefaultMaxLiveLeasesTotal = 20000
)

// LimitsSpec bounds what one peer can make the broker do. In the policy's
// top level it sets the defaults of every peer (enrollmentsPerMinute only
// there); in peers[].limits it overrides them for one peer. A field left
// out inherits; every value given must be at least 1.
type LimitsSpec struct {
	// IssuancesPerMinute and Burst are the token bucket of POST
	// /v1/kubeconfigs (with or without format=exec): a peer may ask Burst
	// times at once, then IssuancesPerMinute a minute.
	IssuancesPerMinute *int `json:"issuancesPerMinute,omitempty"`
	Burst              *int `json:"burst,omitempty"`
	// RenewalsPerMinute is the bucket (burst: the same figure) of
	// certificate renewals.
	RenewalsPerMinute *int `json:"renewalsPerMinute,omitempty"`
	// MaxLiveLeases is how many unexpired leases the peer may hold.
	MaxLiveLeases *int `json:"maxLiveLeases,omitempty"`
	// EnrollmentsPerMinute is the bucket (burst: the same figure) of
	// enrollments per source address and per join token; top level only.
	EnrollmentsPerMinute *int `json:"enrollmentsPerMinute,omitempty"`
	// LeaseReadsPerMinute is the bucket (burst: the same figure) of GET
	// /v1/leases, GET and DELETE /v1/leases/{id} per identity, and
	// LeaseReadsInFlight how many of them may wait on the API server at
	// once.
	LeaseReadsPerMinute *int `json:"leaseReadsPerMinute,omitempty"`
	LeaseReadsInFlight  *int `json:"leaseReadsInFlight,omitempty"`
}

// Limits are the limits in force for one peer, all filled in.
type Limits struct {
	IssuancesPerMinute int
	Burst              int
	RenewalsPerMinute  int
	MaxLiveLeases      int
	// LeaseReadsPerMinute and LeaseReadsInFlight bound lease reads.
	LeaseReadsPerMinute int
	LeaseReadsInFlight  int
}

func pick(vals ...*int) int {
	for _, v := range vals {
		if v != nil {
			return *v
		}
	}
	return 0
}

func ptr(v int) *int { return &v }

// limitsFor is what applies to peer: its own limits, else the policy's,
// else the built-in ones.
func (p *Policy) limitsFor(peer *PeerSpec) Limits {
	var own, top LimitsSpec
	if peer != nil && peer.Limits != nil {
		own = *peer.Limits
	}
	if p.Limits != nil {
		top = *p.Limits
	}
	return Limits{
		IssuancesPerMinute:  pick(own.IssuancesPerMinute, top.IssuancesPerMinute, ptr(DefaultIssuancesPerMinute)),
		Burst:               pick(own.Burst, top.Burst, ptr(DefaultIssuanceBurst)),
		RenewalsPerMinute:   pick(own.RenewalsPerMinute, top.RenewalsPerMinute, ptr(DefaultRenewalsPerMinute)),
		MaxLiveLeases:       pick(own.MaxLiveLeases, top.MaxLiveLeases, ptr(DefaultMaxLiveLeases)),
		LeaseReadsPerMinute: pick(own.LeaseReadsPerMinute, top.LeaseReadsPerMinute, ptr(DefaultLeaseReadsPerMinute)),
		LeaseReadsInFlight:  pick(own.LeaseReadsInFlight, top.LeaseReadsInFlight, ptr(DefaultLeaseReadsInFlight)),
	}
}

// enrollmentsPerMinute is the enrollment bucket of the policy.
func (p *Policy) enrollmentsPerMinute() int {
	if p.Limits != nil && p.Limits.EnrollmentsPerMinute != nil {
		return *p.Limits.EnrollmentsPerMinute
	}
	return DefaultEnrollmentsPerMinute
}

// maxLimit bounds every figure: a million a minute is no limit at all,
// and keeps the arithmetic far from overflow.
const maxLimit = 1_000_000

// validateLimits adds the problems of one limits section at path.
func validateLimits(add func(field, format string, args ...any), path string, l *LimitsSpec, top bool) {
	if l == nil {
		return
	}
	for _, f := range []struct {
		name string
		v    *int
	}{
		{"issuancesPerMinute", l.IssuancesPerMinute}, {"burst", l.Burst}, {"renewalsPerMinute", l.RenewalsPerMinute},
		{"maxLiveLeases", l.MaxLiveLeases}, {"enrollmentsPerMinute", l.EnrollmentsPerMinute},
		{"leaseReadsPerMinute", l.LeaseReadsPerMinute}, {"leaseReadsInFlight", l.LeaseReadsInFlight},
	} {
		if f.v != nil && (*f.v < 1 || *f.v > maxLimit) {
			add(path+"."+f.name, "must be between 1 and %d", maxLimit)
		}
	}
	if !top && l.EnrollmentsPerMinute != nil {
		add(path+".enrollmentsPerMinute", "is a top-level limit: an enrolling cluster is no peer yet")
	}
}

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
func limitsOf(l Limits, live int) *apiv1.PeerLimits {
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
func (b *Broker) admitLease(p *Policy, identity, peer string, a *pendingAudit) (*place, error) {
	lim := p.limitsFor(p.peer(identity))
	var pl *place
	if b.cfg.Leases != nil {
		// The quota first: a request it refuses takes no token of the
		// rate bucket, so the peer can issue as soon as a place is free.
		var full string
		pl, full = b.cfg.Leases.reserve(peer, lim.MaxLiveLeases, b.cfg.MaxLiveLeases)
		switch full {
		case quotaPeer:
			return nil, b.refuseLimited(a, peer, limitLiveLeases, limited(quotaRetry,
				"peer %s holds its maxLiveLeases of %d live leases: revoke one (DELETE /v1/leases/{id}) or wait for one to expire", peer, lim.MaxLiveLeases))
		case quotaTotal:
			return nil, b.refuseLimited(a, peer, limitLiveLeasesAll, limited(quotaRetry,
				"the broker holds its --max-live-leases of %d live leases for all peers together; retry later", b.cfg.MaxLiveLeases))
		}
	}
	if err := b.takeIssuance(identity, peer, lim, a); err != nil {
		if pl != nil {
			pl.release()
		}
		return nil, err
	}
	return pl, nil
}

// admitIssuance applies the peer's issuance bucket.
func (b *Broker) admitIssuance(p *Policy, identity, peer string, a *pendingAudit) error {
	return b.takeIssuance(identity, peer, p.limitsFor(p.peer(identity)), a)
}

// takeIssuance takes a token of the peer's issuance bucket, whose figures
// are lim.
func (b *Broker) takeIssuance(identity, peer string, lim Limits, a *pendingAudit) error {
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
	peer := p.peer(c.Identity)
	if peer == nil {
		return nil
	}
	live := 0
	if b.cfg.Leases != nil {
		live, _ = b.cfg.Leases.Live(peer.Name)
	}
	return limitsOf(p.limitsFor(peer), live)
}

// admitRenewal applies the peer's renewal bucket.
func (b *Broker) admitRenewal(identity string, a *pendingAudit) error {
	p, err := b.policy()
	if err != nil {
		return err
	}
	peer := p.peer(identity)
	name := ""
	if peer != nil {
		name = peer.Name
	}
	lim := p.limitsFor(peer)
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
	n := p.enrollmentsPerMinute()
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
