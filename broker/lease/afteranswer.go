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

// AfterAnswer makes the writes that follow an answer in the background,
// a bounded number at a time: credential ids (RecordCredentialID) and the
// claims of gateway leases signed for pooled Secrets (broker's pool.go).
type AfterAnswer struct {
	slots chan struct{}
	wg    sync.WaitGroup
	run   func(func())
}

// afterAnswerTimeout bounds one write, which no request waits for.
const afterAnswerTimeout = 10 * time.Second

// NewAfterAnswer returns writes of which at most max are in flight; past
// it a write runs on the request, so that a burst slows down instead of
// queueing without bound. run starts a write in the background (go f());
// a test may run it at once instead.
func NewAfterAnswer(max int, run func(func())) *AfterAnswer {
	return &AfterAnswer{slots: make(chan struct{}, max), run: run}
}

// RecordCredentialID writes apiID on the lease Secret s through st after
// the answer. A failure is logged and loses only the annotation: the lease
// and its credential stand, and the issuance's audit event names the id.
func (w *AfterAnswer) RecordCredentialID(ctx context.Context, st *Store, s *corev1.Secret, apiID string, log *zap.Logger) {
	if apiID == "" {
		return
	}
	w.Go(ctx, afterAnswerTimeout, func(ctx context.Context) {
		if err := st.RecordCredential(ctx, s, apiID, nil); err != nil && !problem.IsNotFound(err) {
			log.Warn("could not record the credential id on the lease Secret; the issuance's audit event has it",
				zap.String("credential_id", apiID), zap.Error(err))
		}
	})
}

// Go runs write in the background with a context of ctx's values that
// ends after timeout, or at once (on the request) when every slot is
// taken.
func (w *AfterAnswer) Go(ctx context.Context, timeout time.Duration, write func(context.Context)) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	select {
	case w.slots <- struct{}{}:
	default:
		defer cancel()
		write(ctx)
		return
	}
	w.wg.Add(1)
	w.run(func() {
		defer func() {
			cancel()
			<-w.slots
			w.wg.Done()
		}()
		write(ctx)
	})
}

// Wait waits for the writes still under way, until ctx ends (then it
// returns ctx.Err() and the writes go on, each within its own timeout).
func (w *AfterAnswer) Wait(ctx context.Context) error {
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
