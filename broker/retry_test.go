package broker

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/limits"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// outage makes the fake API server refuse the given verbs on the Secrets
// of a namespace until it is ended.
type outage struct {
	mu   sync.Mutex
	down bool
	// attempts counts the refused calls.
	attempts int
}

func (o *outage) set(down bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.down = down
}

func (o *outage) count() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.attempts
}

func (o *outage) on(e *env, verbs ...string) {
	for _, verb := range verbs {
		e.client.PrependReactor(verb, "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
			o.mu.Lock()
			defer o.mu.Unlock()
			// The broker lists one namespace at a time; the test's own
			// cluster-wide count (leaseCount) still gets through.
			if o.down && a.GetNamespace() != "" {
				o.attempts++
				return true, nil, errors.New("dial tcp 127.0.0.1:6443: connect: connection refused")
			}
			return false, nil, nil
		})
	}
}

// retryEnv is an env on a fake clock with metrics and an audit recorder.
func retryEnv(t *testing.T) (*env, *clocktesting.FakeClock, *prometheus.Registry, *auditRecorder) {
	t.Helper()
	e := newEnv(t)
	clock := clocktesting.NewFakeClock(time.Now())
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	rec := newAuditRecorder()
	e.b.cfg.Clock, e.b.cfg.Metrics, e.b.cfg.Auditor = clock, m, rec
	e.b.limits, e.b.enrollLim = limits.NewLimiter(clock), limits.NewEnrollLimiter(clock)
	e.b.retries = lease.NewRetries(clock, e.b.cfg.Logger, m.SetPendingDeletions)
	e.b.expiries = lease.NewTimers(clock, maxTimedExpiries)
	return e, clock, reg, rec
}

// stepUntil advances the clock by the backoff cap until cond holds; the
// retry worker runs on that clock.
func stepUntil(t *testing.T, clock *clocktesting.FakeClock, cond func() bool) {
	t.Helper()
	require.Eventually(t, func() bool {
		if cond() {
			return true
		}
		clock.Step(30 * time.Second) // the backoff cap of lease.Retries
		return false
	}, 10*time.Second, time.Millisecond)
}

func TestARevocationDuringAnOutageIsA503ThatClaimsNothingAndIsCarriedOutWhenTheAPIServerIsBack(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		verbs []string
	}{
		{"The lease cannot even be looked up.", []string{"list", "delete"}},
		{"The lease is found but cannot be deleted.", []string{"delete"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e, clock, reg, rec := retryEnv(t)
			resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
			require.NoError(t, err)
			var o outage
			o.on(e, tc.verbs...)
			o.set(true)

			err = e.b.RevokeLease(context.Background(), west, resp.LeaseID)
			require.Equal(t, problem.KindUnavailable, problem.KindOf(err))
			require.True(t, problem.Retryable(err))
			require.Equal(t, 1, e.leaseCount(t), "nothing is deleted")
			require.Equal(t, 0.0, metricValue(t, reg, "tokenbroker_leases_deleted_total", "reason", "revoked"), "nothing is claimed")
			events := rec.all()
			require.Equal(t, audit.DecisionError, events[len(events)-1].Decision)
			require.Equal(t, 1, e.b.PendingDeletions())
			require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_lease_deletions_pending"))

			// Retried with backoff while the outage lasts.
			stepUntil(t, clock, func() bool { return o.count() >= 4 })
			require.Equal(t, 1, e.leaseCount(t))

			o.set(false)
			stepUntil(t, clock, func() bool { return e.b.PendingDeletions() == 0 })
			require.Zero(t, e.leaseCount(t), "the lease is gone once the API server answers")
			require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_leases_deleted_total", "reason", "revoked"))
			require.Zero(t, metricValue(t, reg, "tokenbroker_lease_deletions_pending"))
			last := rec.all()[len(rec.all())-1]
			require.Equal(t, audit.ActionRevoke, last.Action)
			require.Equal(t, audit.DecisionAllow, last.Decision)
			require.Equal(t, resp.LeaseID, last.LeaseID)
			require.Equal(t, "revoked after the API server was unavailable", last.Reason)

			// A DELETE the caller retries now finds nothing.
			require.Equal(t, problem.KindNotFound, problem.KindOf(e.b.RevokeLease(context.Background(), west, resp.LeaseID)))
		})
	}
}

func TestARevocationIsQueuedOnceAndNeverForAnotherPeersLease(t *testing.T) {
	t.Parallel()
	e, clock, _, _ := retryEnv(t)
	resp, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source"})
	require.NoError(t, err)
	var o outage
	o.on(e, "list", "delete")
	o.set(true)
	other := Caller{Identity: "spiffe://oc.example/cluster/north"}
	for range 3 {
		require.Equal(t, problem.KindUnavailable, problem.KindOf(e.b.RevokeLease(context.Background(), west, resp.LeaseID)))
	}
	require.Equal(t, problem.KindUnavailable, problem.KindOf(e.b.RevokeLease(context.Background(), other, resp.LeaseID)))
	require.Equal(t, 2, e.b.PendingDeletions(), "one per caller and lease")

	o.set(false)
	stepUntil(t, clock, func() bool { return e.b.PendingDeletions() == 0 })
	require.Zero(t, e.leaseCount(t), "west's revocation deleted it")
}

func TestAnExpiredLeaseTheGCCannotDeleteIsRetriedUntilGone(t *testing.T) {
	t.Parallel()
	e, clock, reg, _ := retryEnv(t)
	_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "1h"})
	require.NoError(t, err)
	clock.Step(2 * time.Hour)
	var o outage
	o.on(e, "delete")
	o.set(true)
	_, err = e.b.CollectGarbage(context.Background())
	require.Error(t, err)
	require.Equal(t, 1, e.b.PendingDeletions())
	_, err = e.b.CollectGarbage(context.Background())
	require.Error(t, err)
	require.Equal(t, 1, e.b.PendingDeletions(), "the next round does not queue it twice")

	o.set(false)
	stepUntil(t, clock, func() bool { return e.b.PendingDeletions() == 0 })
	require.Zero(t, e.leaseCount(t))
	require.Equal(t, 1.0, metricValue(t, reg, "tokenbroker_leases_deleted_total", "reason", "expired"))
}
