package limits

import (
	"container/list"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"k8s.io/utils/clock"
)

// maxEnrollBuckets bounds the enrollment limiter's buckets (sources and
// join tokens together), about 4 MB. Enrollment is unauthenticated, so
// the keys are the caller's to choose; the bound keeps both the memory
// and the cost of a request independent of how many it invents.
const MaxEnrollBuckets = 16384

// enrollSweepBatch is how many of the oldest buckets one new bucket
// looks at when the limiter is full: a sweep is spread over the requests
// that make buckets, never a walk of the whole map under the lock.
const enrollSweepBatch = 4

// enrollLimiter holds the token buckets of enrollment, keyed by source
// (an IPv4 address or an IPv6 /64) and by join token digest. It is apart
// from the limiter of issuance and renewal, with its own lock, so that
// unauthenticated callers never contend with authenticated ones.
//
// It holds at most maxEnrollBuckets buckets, oldest first. A new bucket
// at the bound first drops full buckets among the enrollSweepBatch
// oldest (a full bucket is the same as none) and, if none was full,
// drops the oldest: that forgets a source or token that was limited at
// most maxEnrollBuckets new keys ago, which costs a caller who can make
// that many keys (one per address) one more burst per eviction, and
// nobody else anything.
type EnrollLimiter struct {
	clock clock.PassiveClock
	mu    sync.Mutex
	byKey map[string]*list.Element // of *enrollBucket
	order *list.List               // oldest first
	// evicted counts buckets dropped before they were full, for tests.
	Evicted int
}

type enrollBucket struct {
	key              string
	perMinute, burst int
	lim              *rate.Limiter
}

func NewEnrollLimiter(c clock.PassiveClock) *EnrollLimiter {
	return &EnrollLimiter{clock: c, byKey: map[string]*list.Element{}, order: list.New()}
}

// take takes one token from the bucket key (perMinute, burst), or reports
// how long until one is there. Its cost does not depend on how many
// buckets there are.
func (l *EnrollLimiter) Take(key string, perMinute, burst int) (ok bool, retryAfter time.Duration) {
	now := l.clock.Now()
	l.mu.Lock()
	defer l.mu.Unlock()
	var b *enrollBucket
	if e := l.byKey[key]; e != nil {
		b = e.Value.(*enrollBucket)
		if b.perMinute != perMinute || b.burst != burst {
			l.order.Remove(e)
			delete(l.byKey, key)
			b = nil
		}
	}
	if b == nil {
		l.makeRoom(now)
		// A new bucket is full.
		b = &enrollBucket{key: key, perMinute: perMinute, burst: burst, lim: rate.NewLimiter(rate.Limit(float64(perMinute)/60), burst)}
		l.byKey[key] = l.order.PushBack(b)
	}
	return takeAt(b.lim, now)
}

// makeRoom keeps the limiter below its bound for one more bucket; l.mu is
// held.
func (l *EnrollLimiter) makeRoom(now time.Time) {
	if len(l.byKey) < MaxEnrollBuckets {
		return
	}
	freed := false
	for e, i := l.order.Front(), 0; e != nil && i < enrollSweepBatch; i++ {
		next := e.Next()
		if b := e.Value.(*enrollBucket); b.lim.TokensAt(now) >= float64(b.burst) {
			l.drop(e)
			freed = true
		}
		e = next
	}
	if !freed {
		l.drop(l.order.Front())
		l.Evicted++
	}
}

func (l *EnrollLimiter) drop(e *list.Element) {
	l.order.Remove(e)
	delete(l.byKey, e.Value.(*enrollBucket).key)
}

// len is how many buckets the limiter holds.
func (l *EnrollLimiter) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.byKey)
}

// enrollSourceKey keys a source address's enrollment bucket: an IPv4
// address (an IPv4-mapped IPv6 one unmapped) as it is, an IPv6 address by
// its /64, the smallest block a site is given, so that one host cannot
// get a fresh bucket per address of its own subnet. An address that does
// not parse is its own key.
func EnrollSourceKey(addr string) string {
	ip, err := netip.ParseAddr(addr)
	if err != nil {
		return "enroll-addr:" + addr
	}
	ip = ip.Unmap().WithZone("")
	if ip.Is6() {
		p, _ := ip.Prefix(64)
		return "enroll-addr:" + p.String()
	}
	return "enroll-addr:" + ip.String()
}
