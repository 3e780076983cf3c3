package agent

import (
	"math/rand/v2"
	"time"
)

// Clock is the agent's source of time. Tests inject a fake one to drive
// the refresh and renewal schedules without waiting.
type Clock interface {
	Now() time.Time
	// NewTimer returns a timer that fires once, d from now.
	NewTimer(d time.Duration) Timer
}

// Timer is a one-shot timer made by a Clock.
type Timer interface {
	// C delivers the time once the timer fires.
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it stopped
	// it.
	Stop() bool
}

// Rand is the agent's source of jitter: Float64 returns a number in
// [0, 1). It must be safe for concurrent use (targets refresh in
// parallel); *rand.Rand of math/rand/v2 is not, so wrap it in a mutex.
type Rand interface {
	Float64() float64
}

// RealClock is the wall clock.
type RealClock struct{}

var _ Clock = RealClock{}

// Now returns time.Now().
func (RealClock) Now() time.Time { return time.Now() }

// NewTimer returns a time.Timer.
func (RealClock) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time { return t.t.C }
func (t realTimer) Stop() bool          { return t.t.Stop() }

// systemRand is math/rand/v2's top-level source: randomly seeded and safe
// for concurrent use. Jitter needs no cryptographic randomness.
type systemRand struct{}

func (systemRand) Float64() float64 { return rand.Float64() }
