package lease

import (
	"container/heap"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// Timers runs functions at given times, soonest first, on one goroutine
// that waits for the soonest while any is queued: the revocation of leases
// at their own expiry. It holds at most max; past it At refuses, and the
// GC is the only revoker of what it could not take.
type Timers struct {
	clock clock.WithTicker
	max   int

	mu      sync.Mutex
	heap    timerHeap
	running bool
	wake    chan struct{}
}

type timer struct {
	at   time.Time
	fire func()
}

// NewTimers returns an empty set of timers holding at most max.
func NewTimers(clk clock.WithTicker, max int) *Timers {
	return &Timers{clock: clk, max: max, wake: make(chan struct{}, 1)}
}

// At runs fire at at (at once if it is past), or reports false if max
// timers are waiting.
func (t *Timers) At(at time.Time, fire func()) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.heap) >= t.max {
		return false
	}
	heap.Push(&t.heap, &timer{at: at, fire: fire})
	if !t.running {
		t.running = true
		go t.run()
		return true
	}
	select {
	case t.wake <- struct{}{}: // it may now have a sooner one
	default:
	}
	return true
}

// run fires each timer at its time, and returns when none is left.
func (t *Timers) run() {
	for {
		t.mu.Lock()
		now := t.clock.Now()
		var due []*timer
		for len(t.heap) > 0 && !now.Before(t.heap[0].at) {
			due = append(due, heap.Pop(&t.heap).(*timer))
		}
		if len(due) == 0 && len(t.heap) == 0 {
			t.running = false
			t.mu.Unlock()
			return
		}
		var next time.Duration
		if len(t.heap) > 0 {
			next = t.heap[0].at.Sub(now)
		}
		t.mu.Unlock()
		for _, e := range due {
			e.fire()
		}
		if len(due) > 0 {
			continue // time passed while firing
		}
		tm := t.clock.NewTimer(next)
		select {
		case <-tm.C():
		case <-t.wake:
			tm.Stop()
		}
	}
}

// timerHeap is a min-heap of timers by time.
type timerHeap []*timer

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h timerHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *timerHeap) Push(x any)        { *h = append(*h, x.(*timer)) }
func (h *timerHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return x
}

// MinTTL is the shortest lease the broker grants: a shorter ttl is
// raised to it (clampedBy policy.ClampedByLeaseMinimum). A lease shorter than
// the credential bound to it (the TokenRequest and CSR APIs grant 10m at
// least) is revoked at its own expiry, so the minimum is the broker's,
// not the API server's: one minute leaves a client time to use what it
// was given, and the API server's ~10 s token cache is small beside it.
const MinTTL = time.Minute
