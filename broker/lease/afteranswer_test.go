package lease

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// A credential id waits for a quiet moment while RunDeferred runs, and is
// written at the replica's shutdown (Wait) whether or not it is quiet.
func TestACredentialIDWaitsForAQuietMomentOrTheShutdown(t *testing.T) {
	t.Parallel()
	lease := func(name string) *corev1.Secret {
		return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: name, UID: types.UID("uid-" + name)}}
	}
	a, b := lease("tokenbroker-lease-a"), lease("tokenbroker-lease-b")
	st, client := storeWith(t, a, b)
	clk := st.Clock.(*clocktesting.FakeClock)
	idOf := func(name string) string {
		s, err := client.CoreV1().Secrets("argo").Get(context.Background(), name, metav1.GetOptions{})
		require.NoError(t, err)
		return s.Annotations[objects.AnnotationCredentialID]
	}
	w := NewAfterAnswer(4, func(f func()) { go f() })
	var busy atomic.Bool
	busy.Store(true)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		w.RunDeferred(ctx, func() time.Duration {
			if busy.Load() {
				return PoolQuiet
			}
			return 0
		}, clk)
	}()
	require.Eventually(t, w.deferring.Load, 10*time.Second, time.Millisecond)

	w.RecordCredentialID(ctx, st, a, "JTI=a", zap.NewNop())
	require.Eventually(t, clk.HasWaiters, 10*time.Second, time.Millisecond, "waiting for quiet")
	require.Empty(t, idOf(a.Name), "not while issuances are in flight")
	busy.Store(false)
	clk.Step(PoolQuiet)
	require.Eventually(t, func() bool { return idOf(a.Name) == "JTI=a" }, 10*time.Second, time.Millisecond, "written once quiet")

	busy.Store(true)
	w.RecordCredentialID(ctx, st, b, "JTI=b", zap.NewNop())
	require.NoError(t, w.Wait(context.Background()))
	require.Equal(t, "JTI=b", idOf(b.Name), "the shutdown writes what waits")
	cancel()
	<-done
}
