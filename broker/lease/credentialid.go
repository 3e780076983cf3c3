package lease

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

// CredentialIDs writes credential ids on lease Secrets in the background,
// a bounded number at a time.
type CredentialIDs struct {
	slots chan struct{}
	wg    sync.WaitGroup
	run   func(func())
}

// credentialIDWriteTimeout bounds one write, which no request waits for.
const credentialIDWriteTimeout = 10 * time.Second

// NewCredentialIDs returns writes of which at most max are in flight;
// past it a write runs on the request, so that a burst slows down instead
// of queueing without bound. run starts a write in the background (go
// f()); a test may run it at once instead.
func NewCredentialIDs(max int, run func(func())) *CredentialIDs {
	return &CredentialIDs{slots: make(chan struct{}, max), run: run}
}

// Later writes apiID on the lease Secret s through st in the background,
// or at once when every slot is taken. A failure is logged and loses only
// the annotation: the lease and its credential stand, and the issuance's
// audit event names the id.
func (w *CredentialIDs) Later(ctx context.Context, st *Store, s *corev1.Secret, apiID string, log *zap.Logger) {
	if apiID == "" {
		return
	}
	write := func(ctx context.Context) {
		if err := st.RecordCredential(ctx, s, apiID, nil); err != nil && !problem.IsNotFound(err) {
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

// Wait waits for the writes still under way, until ctx ends (then it
// returns ctx.Err() and the writes go on, each within its own timeout).
func (w *CredentialIDs) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() {
		w.wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
