package agent

import (
	"context"
	"time"
)

// maxConcurrentSteps is how many targets do their work at once. At start
// every target reads its outputs, fetches and writes at the same moment;
// unbounded, an agent with 100 targets had 100 TLS handshakes, answers and
// Kubernetes requests in flight together, and kept the heap the garbage
// collector grew for that burst (8 slots save about 2 MB of its RSS
// between refreshes and 6 MB while refreshing; docs/agent.md, "Measured").
// The Kubernetes client's own limit (20 requests/s) paces the writes
// anyway, so the slots cost no time, and the first Secrets come sooner
// (0.1 s instead of 7.6 s with 100 targets): targets no longer queue
// behind every other target's first read.
//
// A step that waits on an unresponsive broker holds its slot until the
// client's timeout (30 s); other targets then wait their turn, never
// longer than that per step ahead of them, and failing targets back off.
const maxConcurrentSteps = 8

// stepSlots bounds how many steps run at once: a step runs once it holds a
// slot. A nil stepSlots does not bound.
type stepSlots chan struct{}

func newStepSlots(n int) stepSlots { return make(stepSlots, n) }

// do runs step once a slot is free and returns what it returns. If ctx is
// done first, step does not run and do returns the zero time (runSteps
// then stops).
func (s stepSlots) do(ctx context.Context, step func(context.Context) time.Time) time.Time {
	if s == nil {
		return step(ctx)
	}
	select {
	case s <- struct{}{}:
	case <-ctx.Done():
		return time.Time{}
	}
	defer func() { <-s }()
	return step(ctx)
}
