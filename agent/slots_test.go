package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestNoMoreStepsRunAtOnceThanThereAreSlotsAndEveryStepRuns(t *testing.T) {
	t.Parallel()
	const slots, targets = 3, 20
	s := newStepSlots(slots)
	var running, ran atomic.Int32
	var mu sync.Mutex
	most := int32(0)
	release := make(chan struct{})
	step := func(context.Context) time.Time {
		n := running.Add(1)
		mu.Lock()
		most = max(most, n)
		mu.Unlock()
		<-release
		running.Add(-1)
		ran.Add(1)
		return t0
	}
	var wg sync.WaitGroup
	for range targets {
		wg.Go(func() { require.Equal(t, t0, s.do(context.Background(), step)) })
	}
	require.Eventually(t, func() bool { return running.Load() == slots }, 10*time.Second, time.Millisecond,
		"the first steps take every slot")
	// The others wait: none starts while the slots are held.
	time.Sleep(50 * time.Millisecond)
	require.EqualValues(t, slots, running.Load())
	close(release)
	wg.Wait()
	require.EqualValues(t, targets, ran.Load(), "every step ran once a slot was free")
	mu.Lock()
	defer mu.Unlock()
	require.EqualValues(t, slots, most, "never more at once than there are slots")
}

func TestAStepWaitingForASlotGivesUpWithoutRunningWhenTheAgentStops(t *testing.T) {
	t.Parallel()
	s := newStepSlots(1)
	held := make(chan struct{})
	release := make(chan struct{})
	go s.do(context.Background(), func(context.Context) time.Time {
		close(held)
		<-release
		return t0
	})
	<-held
	defer close(release)

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	ran := false
	got := s.do(ctx, func(context.Context) time.Time { ran = true; return t0 })
	require.False(t, ran, "no slot was free and the agent is stopping")
	require.Zero(t, got)
}

func TestWithoutSlotsAStepRunsAtOnce(t *testing.T) {
	t.Parallel()
	var s stepSlots
	require.Equal(t, t0, s.do(context.Background(), func(context.Context) time.Time { return t0 }))
}
