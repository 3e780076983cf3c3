package agent

import (
	"context"

	"math/rand/v2"
	"time"

	"k8s.io/utils/clock"
)

// runSteps calls step and sleeps until the time it returns, over and
// over, until ctx is done: the loop of the refreshers and the renewer.
func runSteps(ctx context.Context, c clock.Clock, step func(context.Context) time.Time) {
	for {
		wake := step(ctx)
		if ctx.Err() != nil || sleepUntil(ctx, c, wake) != nil {
			return
		}
	}
}

// sleepUntil waits until c reaches wake or ctx is done, and returns
// ctx.Err(). A wake time already passed returns at once, without a timer.
// Every wait of the agent goes through it, so that a fake clock
// (k8s.io/utils/clock/testing) drives them all in tests.
func sleepUntil(ctx context.Context, c clock.Clock, wake time.Time) error {
	d := wake.Sub(c.Now())
	if d <= 0 {
		return ctx.Err()
	}
	t := c.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C():
		return nil
	}
}

// Rand is the agent's source of jitter: Float64 returns a number in
// [0, 1). It must be safe for concurrent use (targets refresh in
// parallel); *rand.Rand of math/rand/v2 is not, so wrap it in a mutex.
type Rand interface {
	Float64() float64
}

// systemRand is math/rand/v2's top-level source: randomly seeded and safe
// for concurrent use. Jitter needs no cryptographic randomness.
type systemRand struct{}

func (systemRand) Float64() float64 { return rand.Float64() }
