package limits

import (
	"crypto/sha256"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/problem"
	"golang.org/x/time/rate"
	"k8s.io/utils/clock"
)

// limiter holds the token buckets of issuance and renewal, keyed by
// verified identity, so bounded by the identities the CA has certified;
// sweeping full buckets (the same as new ones) past maxSweptBuckets keeps
// those of peers gone. Enrollment, unauthenticated, has its own
// (enrollLimiter).
type Limiter struct {
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

func NewLimiter(c clock.PassiveClock) *Limiter {
	return &Limiter{clock: c, buckets: map[string]*bucket{}}
}

// take takes one token from the bucket key (perMinute, burst), or reports
// how long until one is there.
func (l *Limiter) Take(key string, perMinute, burst int) (ok bool, retryAfter time.Duration) {
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
func (l *Limiter) sweep(now time.Time) {
	for k, b := range l.buckets {
		if b.lim.TokensAt(now) >= float64(b.burst) {
			delete(l.buckets, k)
		}
	}
}

// limited is an *Error of KindTooManyRequests naming the limit and when to
// come back.
func Limited(retryAfter time.Duration, format string, args ...any) *problem.Error {
	e := problem.Errorf(problem.KindTooManyRequests, format, args...)
	e.RetryAfter = retryAfter
	return e
}

// retrySeconds rounds a wait up to whole seconds, at least 1.
func RetrySeconds(d time.Duration) int {
	return max(1, int(math.Ceil(d.Seconds())))
}

// joinTokenKey keys a join token's bucket by its digest, so that the
// token itself is never held.
func JoinTokenKey(token string) string {
	sum := sha256.Sum256([]byte(token))
	return fmt.Sprintf("enroll-token:%x", sum[:16])
}

// inFlight counts, per identity, the lease reads waiting on the API
// server; its map holds only identities with one in flight.
type InFlight struct {
	mu sync.Mutex
	n  map[string]int
}

func NewInFlight() *InFlight { return &InFlight{n: map[string]int{}} }

// acquire takes one of max places of key, or reports false.
func (f *InFlight) Acquire(key string, max int) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.n[key] >= max {
		return false
	}
	f.n[key]++
	return true
}

func (f *InFlight) Release(key string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.n[key]--; f.n[key] <= 0 {
		delete(f.n, key)
	}
}
