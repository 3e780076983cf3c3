package broker

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"
)

const leaseReadsPolicy = `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
limits: {leaseReadsPerMinute: 2, leaseReadsInFlight: 1}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
  - name: south
    identity: spiffe://oc.example/cluster/south
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`

const unknownLeaseID = "aaaaaaaaaaaaaaaaaaaaaaaaaa"

func TestLeaseReadsAreLimitedPerIdentity(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	south := Caller{Identity: "spiffe://oc.example/cluster/south"}
	for _, tc := range []struct {
		name string
		read func(e *env, c Caller) error
	}{
		{"A page of GET /v1/leases takes a token of the read bucket.", func(e *env, c Caller) error {
			_, err := e.b.ListLeases(ctx, c, lease.PageRequest{})
			return err
		}},
		{"GET /v1/leases/{id} takes a token of the read bucket.", func(e *env, c Caller) error {
			_, err := e.b.GetLease(ctx, c, unknownLeaseID)
			return err
		}},
		{"DELETE /v1/leases/{id} takes a token of the read bucket.", func(e *env, c Caller) error {
			return e.b.RevokeLease(ctx, c, unknownLeaseID)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e, clk := newLimitsEnv(t, leaseReadsPolicy)
			for range 2 {
				err := tc.read(e, west)
				require.NotEqual(t, problem.KindTooManyRequests, problem.KindOf(err), "the burst")
			}
			err := tc.read(e, west)
			require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err))
			require.Equal(t, 30*time.Second, problem.RetryAfterOf(err), "2 a minute: a token every 30s")
			require.Contains(t, err.Error(), "peer west is over its limit of 2 lease reads a minute; retry in 30s")
			require.NotEqual(t, problem.KindTooManyRequests, problem.KindOf(tc.read(e, south)), "another identity has its own bucket")
			clk.Step(30 * time.Second)
			require.NotEqual(t, problem.KindTooManyRequests, problem.KindOf(tc.read(e, west)), "after Retry-After")
		})
	}
}

func TestLeaseReadsWaitingOnTheAPIServerAreCappedPerIdentity(t *testing.T) {
	t.Parallel()
	e, _ := newLimitsEnv(t, leaseReadsPolicy)
	ctx := context.Background()
	listing, release := make(chan struct{}), make(chan struct{})
	var first sync.Once
	e.client.PrependReactor("list", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		first.Do(func() { // the first list waits, like a slow API server
			listing <- struct{}{}
			<-release
		})
		return false, nil, nil
	})
	done := make(chan error)
	go func() {
		_, err := e.b.ListLeases(ctx, west, lease.PageRequest{})
		done <- err
	}()
	<-listing
	_, err := e.b.GetLease(ctx, west, unknownLeaseID)
	require.Equal(t, problem.KindTooManyRequests, problem.KindOf(err), "one read in flight is west's cap")
	require.Equal(t, time.Second, problem.RetryAfterOf(err))
	require.Contains(t, err.Error(), "peer west has its leaseReadsInFlight of 1 lease reads waiting on the API server")
	close(release)
	require.NoError(t, <-done)
	_, err = e.b.ListLeases(ctx, west, lease.PageRequest{})
	require.NoError(t, err, "the place is free again, and the refused read took no token")
}

func TestAnUnknownLeaseIDIsNotFoundAtOnceWithoutAnAPICallOnceTheCounterIsSynced(t *testing.T) {
	t.Parallel()
	e := newEnv(t) // the wall clock: the old lookup waited a second on it
	e.b.cfg.Leases = lease.NewCounter(nil, clocktesting.NewFakePassiveClock(time.Now()), zap.NewNop())
	require.True(t, e.b.cfg.Leases.Synced(), "no namespace to list: synced")
	calls := len(e.client.Actions())
	start := time.Now()
	_, err := e.b.GetLease(context.Background(), west, unknownLeaseID)
	require.Equal(t, problem.KindNotFound, problem.KindOf(err))
	require.Less(t, time.Since(start), 500*time.Millisecond, "no wait for the counter")
	require.Len(t, e.client.Actions(), calls, "no API call")
}
