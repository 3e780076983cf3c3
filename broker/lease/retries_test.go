package lease

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	clocktesting "k8s.io/utils/clock/testing"
)

// A failed attempt is retried with a doubling backoff until it succeeds,
// once per key, and the gauge follows the queue.
func TestRetriesBackOffUntilTheAttemptSucceeds(t *testing.T) {
	t.Parallel()
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	var gauge atomic.Int64
	q := NewRetries(clk, zap.NewNop(), func(n int) { gauge.Store(int64(n)) })
	var tries atomic.Int32
	attempt := func() error {
		if tries.Add(1) < 3 {
			return errors.New("503")
		}
		return nil
	}
	require.True(t, q.Queue("secret/argo/a", "expired", attempt))
	require.True(t, q.Queue("secret/argo/a", "expired", attempt), "queued once")
	require.Equal(t, 1, q.Pending())
	require.EqualValues(t, 1, gauge.Load())

	require.Eventually(t, func() bool {
		if q.Pending() == 0 {
			return true
		}
		clk.Step(retryCap)
		return false
	}, 10*time.Second, time.Millisecond)
	require.EqualValues(t, 3, tries.Load(), "two failures, then success")
	require.Zero(t, gauge.Load())
}

// The queue is bounded: past MaxPendingRetries a deletion is refused.
func TestRetriesAreBounded(t *testing.T) {
	t.Parallel()
	clk := clocktesting.NewFakeClock(time.Now())
	q := NewRetries(clk, zap.NewNop(), nil)
	for i := range MaxPendingRetries {
		require.True(t, q.Queue("k"+time.Duration(i).String(), "failed_request", func() error { return errors.New("down") }))
	}
	require.False(t, q.Queue("one-more", "failed_request", func() error { return nil }))
	require.Equal(t, MaxPendingRetries, q.Pending())
}

// Timers fire in order of their time, each once, and refuse past their
// bound.
func TestTimersFireInTimeOrderAndAreBounded(t *testing.T) {
	t.Parallel()
	start := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	clk := clocktesting.NewFakeClock(start)
	tm := NewTimers(clk, 2)
	fired := make(chan string, 3)
	require.True(t, tm.At(start.Add(2*time.Minute), func() { fired <- "later" }))
	require.True(t, tm.At(start.Add(time.Minute), func() { fired <- "sooner" }))
	require.False(t, tm.At(start.Add(time.Second), func() { fired <- "over the bound" }))

	require.Eventually(t, clk.HasWaiters, 5*time.Second, time.Millisecond)
	clk.Step(time.Minute)
	require.Equal(t, "sooner", <-fired)
	require.Eventually(t, clk.HasWaiters, 5*time.Second, time.Millisecond)
	clk.Step(time.Minute)
	require.Equal(t, "later", <-fired)
	require.Empty(t, fired)
	require.True(t, tm.At(start, func() { fired <- "past" }), "room again once fired")
	require.Equal(t, "past", <-fired, "a time already past fires at once")
}
