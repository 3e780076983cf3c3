package lease

import (
	"math"
	"sync"
	"time"

	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/clock"
)

// MaxPendingRetries bounds the retry queue; past it a deletion is not
// queued (a revocation still answers 503, the GC removes expired leases on
// its next round).
const MaxPendingRetries = 4096

// Backoff of the retry queue: first retry after retryFirst, doubling, at
// most retryCap apart.
const (
	retryFirst = 250 * time.Millisecond
	retryCap   = 30 * time.Second
)

// Retries is the queue of lease deletions that failed, each retried with
// capped exponential backoff until its attempt succeeds. It lives in the
// replica's memory: a replica that stops loses it, and then the GC removes
// what is left once it expires. A deletion is queued once per key.
type Retries struct {
	clock      clock.WithTicker
	log        *zap.Logger
	setPending func(int)

	mu      sync.Mutex
	pending map[string]*retry
	running bool
	wake    chan struct{}
}

type retry struct {
	reason  string
	attempt func() error
	backoff wait.Backoff
	next    time.Time
}

// NewRetries returns an empty queue; setPending, if set, is told the
// queue's length at every change (a gauge).
func NewRetries(clk clock.WithTicker, log *zap.Logger, setPending func(int)) *Retries {
	if setPending == nil {
		setPending = func(int) {}
	}
	return &Retries{clock: clk, log: log, setPending: setPending, pending: map[string]*retry{}, wake: make(chan struct{}, 1)}
}

// Queue queues attempt under key (a deletion already queued under key is
// kept, not queued twice), first tried after retryFirst. It reports false
// when the queue is full. A worker runs while the queue is not empty.
func (q *Retries) Queue(key, reason string, attempt func() error) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if _, ok := q.pending[key]; ok {
		return true
	}
	if len(q.pending) >= MaxPendingRetries {
		q.log.Error("too many lease deletions pending; not retrying this one",
			zap.String("deletion", key), zap.String("reason", reason))
		return false
	}
	r := &retry{reason: reason, attempt: attempt, backoff: wait.Backoff{Duration: retryFirst, Factor: 2, Cap: retryCap, Steps: math.MaxInt32}}
	r.next = q.clock.Now().Add(r.backoff.Step())
	q.pending[key] = r
	q.setPending(len(q.pending))
	if !q.running {
		q.running = true
		go q.run()
	}
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return true
}

// Pending is the number of deletions waiting for a retry.
func (q *Retries) Pending() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.pending)
}

// run retries the due deletions until the queue is empty.
func (q *Retries) run() {
	for {
		q.mu.Lock()
		if len(q.pending) == 0 {
			q.running = false
			q.mu.Unlock()
			return
		}
		now := q.clock.Now()
		var next time.Time
		due := map[string]*retry{}
		for k, r := range q.pending {
			if !r.next.After(now) {
				due[k] = r
			} else if next.IsZero() || r.next.Before(next) {
				next = r.next
			}
		}
		q.mu.Unlock()

		if len(due) == 0 {
			select {
			case <-q.clock.After(next.Sub(now)):
			case <-q.wake:
			}
			continue
		}
		for k, r := range due {
			err := r.attempt()
			q.mu.Lock()
			if err == nil {
				delete(q.pending, k)
			} else {
				r.next = q.clock.Now().Add(r.backoff.Step())
			}
			q.setPending(len(q.pending))
			q.mu.Unlock()
		}
	}
}
