package broker

import (
	"context"
	"sync"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/problem"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
)

// A lease's credential id (AnnotationCredentialID) is written on its
// Secret just after the answer, not before it: the id exists only once the
// credential is minted, after the Secret it is bound to, so recording it on
// the request path would add a third API write to every token issuance (in
// `make bench`, about a third of the broker's throughput). The audit event
// of the issuance carries the id at once; the annotation, which only
// `tokenbroker audit --kubeconfig` reads, follows within a round trip.
// When the API server or the signer shortened the credential, its expiry
// must be on the Secret before the answer, and the id goes in that same
// patch.

// maxCredentialIDWrites bounds the annotation writes in flight; past it an
// issuance writes its own on the request path, so that a burst slows down
// instead of queueing without bound.
const maxCredentialIDWrites = 64

// credentialIDWriteTimeout bounds one write, which no request waits for.
const credentialIDWriteTimeout = 10 * time.Second

type credentialIDWrites struct {
	slots chan struct{}
	wg    sync.WaitGroup
	// run starts a write; inBackground unless a test says otherwise.
	run func(func())
}

// inBackground is how writes start. The package's tests run them on the
// request instead (main_test.go): client-go's fake clientsets are not safe
// for a reactor added while a call is under way.
var inBackground = func(f func()) { go f() }

func newCredentialIDWrites() *credentialIDWrites {
	return &credentialIDWrites{slots: make(chan struct{}, maxCredentialIDWrites), run: inBackground}
}

// recordCredentialIDLater writes apiID on the lease Secret s in the
// background, or at once when every slot is taken. A failure is logged and
// loses only the annotation: the lease and its credential stand, and the
// broker's audit event names the id.
func (b *Broker) recordCredentialIDLater(ctx context.Context, s *corev1.Secret, apiID string, log *zap.Logger) {
	if apiID == "" {
		return
	}
	w := b.credIDs
	write := func(ctx context.Context) {
		if err := b.store().RecordCredential(ctx, s, apiID, nil); err != nil && !problem.IsNotFound(err) {
			log.Warn("could not record the credential id on the lease Secret; the issuance's audit event has it",
				zap.String("credential_id", apiID), zap.Error(err))
		}
	}
	select {
	case w.slots <- struct{}{}:
	default:
		write(ctx)
		return
	}
	w.wg.Add(1)
	w.run(func() {
		defer func() {
			<-w.slots
			w.wg.Done()
		}()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), credentialIDWriteTimeout)
		defer cancel()
		write(ctx)
	})
}

// WaitCredentialIDWrites waits for the credential-id annotations still
// being written in the background, until ctx ends (then it returns
// ctx.Err() and the writes go on, each within its own timeout). The
// server calls it when it shuts down, after the last answer, so that a
// rollout does not lose the annotations of the last issuances.
func (b *Broker) WaitCredentialIDWrites(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		b.credIDs.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
