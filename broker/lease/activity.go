package lease

import (
	"sync/atomic"
	"time"
)

// Activity tracks a replica's issuances in flight, so that the writes
// that can wait (the pool's refill, credential ids after their answer)
// are made in its quiet moments and never compete with an issuance for
// the API server.
type Activity struct {
	// inflight counts the issuances in progress; lastDone is when the last
	// one ended (Unix nanoseconds on the broker's clock).
	inflight atomic.Int32
	lastDone atomic.Int64
}

// Start and Done bracket an issuance.
func (a *Activity) Start() { a.inflight.Add(1) }

func (a *Activity) Done(now time.Time) {
	a.lastDone.Store(now.UnixNano())
	a.inflight.Add(-1)
}

// QuietFor is how much longer the replica must stay without an issuance
// in flight to be quiet: 0 when it is, PoolQuiet while one is in flight.
func (a *Activity) QuietFor(now time.Time) time.Duration {
	if a.inflight.Load() > 0 {
		return PoolQuiet
	}
	return max(0, PoolQuiet-now.Sub(time.Unix(0, a.lastDone.Load())))
}
