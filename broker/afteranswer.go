package broker

import (
	"context"
	"time"
)

// Some writes of an issuance follow its answer (lease.AfterAnswer): the
// credential-id annotation of a lease, and the claim of a gateway lease
// signed for a pooled Secret (pool.go).

// maxWritesAfterAnswers bounds those writes in flight; past it an
// issuance makes its own on the request path.
const maxWritesAfterAnswers = 64

// inBackground is how writes start. The package's tests run them on the
// request instead (main_test.go): client-go's fake clientsets are not safe
// for a reactor added while a call is under way.
var inBackground = func(f func()) { go f() }

// WaitWritesAfterAnswers waits for the writes still under way after their
// answers, until ctx ends (then it returns ctx.Err() and the writes go on,
// each within its own timeout). The server calls it when it shuts down,
// after the last answer, so that a rollout loses neither the annotations
// nor the claims of the last issuances.
func (b *Broker) WaitWritesAfterAnswers(ctx context.Context) error {
	return b.after.Wait(ctx)
}

// RunWritesAfterAnswers makes the credential-id writes that wait for the
// replica's quiet moments (lease.AfterAnswer.RunDeferred) until ctx ends.
// Without it each is made just after its answer.
func (b *Broker) RunWritesAfterAnswers(ctx context.Context) {
	b.after.RunDeferred(ctx, func() time.Duration { return b.activity.QuietFor(b.cfg.Clock.Now()) }, b.cfg.Clock)
}
