package broker

import (
	"context"
)

// The credential-id annotation of a lease is written just after the
// answer (lease.CredentialIDs).

// maxCredentialIDWrites bounds the annotation writes in flight; past it an
// issuance writes its own on the request path.
const maxCredentialIDWrites = 64

// inBackground is how writes start. The package's tests run them on the
// request instead (main_test.go): client-go's fake clientsets are not safe
// for a reactor added while a call is under way.
var inBackground = func(f func()) { go f() }

// WaitCredentialIDWrites waits for the credential-id annotations still
// being written in the background, until ctx ends (then it returns
// ctx.Err() and the writes go on, each within its own timeout). The
// server calls it when it shuts down, after the last answer, so that a
// rollout does not lose the annotations of the last issuances.
func (b *Broker) WaitCredentialIDWrites(ctx context.Context) error {
	return b.credIDs.Wait(ctx)
}
