package lease

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/broker/problem"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A lease's credential id (AnnotationCredentialID) is written on its
// Secret after the answer, not before it: the id exists only once the
// credential is minted, after the Secret it is bound to, so recording it on
// the request path would add a third API write to every token issuance.
// Written at once after the answer it still competed with the next
// issuances for the API server: back to back, the broker's throughput was
// 0.40 of the direct Secret + TokenRequest pair's at c=32 with it and 0.83
// without it (`make bench`). So while RunDeferred runs the write waits for
// the replica's quiet moments (Activity), as the pool's refill does, at
// most maxDeferred of them; past that, or without RunDeferred, it is made
// at once. The audit event of the issuance carries the id at once; the
// annotation, which only `tokenbroker audit --kubeconfig` reads, follows
// once the replica is quiet, and at its shutdown. When the API server or
// the signer shortened the credential, its expiry must be on the Secret
// before the answer, and the id goes in that same patch.

// AfterAnswer makes the writes that follow an answer in the background,
// a bounded number at a time: credential ids (RecordCredentialID) and the
// claims of gateway leases signed for pooled Secrets (broker's pool.go).
type AfterAnswer struct {
	slots chan struct{}
	wg    sync.WaitGroup
	run   func(func())

	// deferring is set while RunDeferred runs; deferred holds the writes
	// that wait for a quiet moment, queued wakes it.
	deferring atomic.Bool
	mu        sync.Mutex
	deferred  []func(context.Context)
	queued    chan struct{}
}

// maxDeferred bounds the writes waiting for a quiet moment (a credential
// id and its lease's name: well under a kilobyte each).
const maxDeferred = 4096

// afterAnswerTimeout bounds one write, which no request waits for.
const afterAnswerTimeout = 10 * time.Second

// NewAfterAnswer returns writes of which at most max are in flight; past
// it a write runs on the request, so that a burst slows down instead of
// queueing without bound. run starts a write in the background (go f());
// a test may run it at once instead.
func NewAfterAnswer(max int, run func(func())) *AfterAnswer {
	return &AfterAnswer{slots: make(chan struct{}, max), run: run, queued: make(chan struct{}, 1)}
}

// RecordCredentialID writes apiID on the lease Secret s through st after
// the answer, in a quiet moment (RunDeferred). A failure is logged and
// loses only the annotation: the lease and its credential stand, and the
// issuance's audit event names the id.
func (w *AfterAnswer) RecordCredentialID(ctx context.Context, st *Store, s *corev1.Secret, apiID string, log *zap.Logger) {
	if apiID == "" {
		return
	}
	// Only what the patch names: a write may wait in memory a while.
	s = &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name, UID: s.UID}}
	write := func(ctx context.Context) {
		if err := st.RecordCredential(ctx, s, apiID, nil); err != nil && !problem.IsNotFound(err) {
			log.Warn("could not record the credential id on the lease Secret; the issuance's audit event has it",
				zap.String("credential_id", apiID), zap.Error(err))
		}
	}
	if w.deferring.Load() {
		w.mu.Lock()
		if len(w.deferred) < maxDeferred {
			w.deferred = append(w.deferred, write)
			w.mu.Unlock()
			select {
			case w.queued <- struct{}{}:
			default:
			}
			return
		}
		w.mu.Unlock()
	}
	w.Go(ctx, afterAnswerTimeout, write)
}

// RunDeferred makes the deferred writes, one at a time, whenever quietFor
// says the replica is quiet, until ctx ends; Wait makes what is left.
func (w *AfterAnswer) RunDeferred(ctx context.Context, quietFor func() time.Duration, clk clock.Clock) {
	w.deferring.Store(true)
	defer w.deferring.Store(false)
	for {
		if w.pending() == 0 {
			select {
			case <-ctx.Done():
				return
			case <-w.queued:
			}
			continue
		}
		if d := quietFor(); d > 0 {
			select {
			case <-ctx.Done():
				return
			case <-clk.After(d):
			}
			continue
		}
		w.writeDeferred()
	}
}

// pending is how many writes wait for a quiet moment.
func (w *AfterAnswer) pending() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.deferred)
}

// writeDeferred makes the oldest deferred write, if any, within
// afterAnswerTimeout, and reports whether there was one.
func (w *AfterAnswer) writeDeferred() bool {
	w.mu.Lock()
	if len(w.deferred) == 0 {
		w.mu.Unlock()
		return false
	}
	write := w.deferred[0]
	w.deferred[0] = nil
	w.deferred = w.deferred[1:]
	w.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), afterAnswerTimeout)
	defer cancel()
	write(ctx)
	return true
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

// Wait makes the deferred writes now and waits for those still under
// way, until ctx ends (then it returns ctx.Err(): the deferred writes
// left are lost, the others go on, each within its own timeout).
func (w *AfterAnswer) Wait(ctx context.Context) error {
	for ctx.Err() == nil {
		if !w.writeDeferred() {
			break
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
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
