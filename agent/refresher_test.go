package agent

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/agent/client"
	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

func counter(t *testing.T, f *refresherFixture, name string, labels ...string) float64 {
	t.Helper()
	m := f.r.metrics
	switch name {
	case "refresh":
		return testutil.ToFloat64(m.refresh.WithLabelValues(labels...))
	case "writes":
		return testutil.ToFloat64(m.outputWrites.WithLabelValues(labels...))
	case "revocations":
		return testutil.ToFloat64(m.revocations.WithLabelValues(labels...))
	}
	t.Fatalf("no counter %s", name)
	return 0
}

func TestTheFirstStepFetchesWritesEveryOutputAndSchedulesAtTwoThirds(t *testing.T) {
	t.Parallel()
	a, b := &memOutput{name: "a"}, &memOutput{name: "b"}
	f := newRefresherFixture(t, config.RefreshConfig{}, a, b)
	ctx := context.Background()

	wake := f.r.step(ctx)
	require.Equal(t, t0.Add(40*time.Minute), wake, "2/3 of the 1h granted")
	require.Equal(t, leaseID(1), a.lease())
	require.Equal(t, leaseID(1), b.lease())
	require.Equal(t, 1.0, counter(t, f, "refresh", "east", "success"))
	require.Equal(t, 1.0, counter(t, f, "writes", "east", "mem:a", "written"))
	require.Equal(t, float64(t0.Unix()), testutil.ToFloat64(f.r.metrics.lastSuccess.WithLabelValues("east")))
	require.True(t, f.r.status().ready())

	// Nothing happens before the refresh is due.
	f.clock.SetTime(t0.Add(39 * time.Minute))
	require.Equal(t, t0.Add(40*time.Minute), f.r.step(ctx))
	require.Equal(t, 1, f.broker.issued())

	f.clock.SetTime(t0.Add(40 * time.Minute))
	require.Equal(t, t0.Add(41*time.Minute), f.r.step(ctx), "woken for the revocation of the replaced lease")
	require.Equal(t, leaseID(2), a.lease())
	require.Equal(t, t0.Add(80*time.Minute), f.r.status().nextAttempt, "the next refresh is scheduled from the new grant")
}

func TestAFailingFetchLeavesTheOutputsUntouchedAndBacksOff(t *testing.T) {
	t.Parallel()
	a := &memOutput{name: "a"}
	f := newRefresherFixture(t, config.RefreshConfig{}, a)
	ctx := context.Background()
	f.r.step(ctx)
	require.Equal(t, 1, a.writes)

	f.broker.setFail(errBrokerDown)
	f.clock.SetTime(t0.Add(40 * time.Minute))
	var delays []time.Duration
	for range 5 {
		now := f.clock.Now()
		wake := f.r.step(ctx)
		delays = append(delays, wake.Sub(now))
		f.clock.SetTime(wake)
	}
	require.Equal(t, []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second}, delays)
	require.Equal(t, 1, a.writes, "a failed fetch must never touch an output")
	require.Equal(t, leaseID(1), a.lease(), "the working credential stays")
	require.Equal(t, 5.0, counter(t, f, "refresh", "east", "failure"))
	require.Equal(t, 5, f.r.status().failures)
	require.Empty(t, f.broker.revokedLeases())

	// Recovery: the next success resets the backoff and replaces the credential.
	f.broker.setFail(nil)
	now := f.clock.Now()
	f.r.step(ctx)
	require.Equal(t, leaseID(2), a.lease())
	require.Equal(t, now.Add(40*time.Minute), f.r.status().nextAttempt)
	require.Zero(t, f.r.status().failures)
}

func TestTheBrokersRetryAfterDelaysTheRetry(t *testing.T) {
	t.Parallel()
	f := newRefresherFixture(t, config.RefreshConfig{}, &memOutput{name: "a"})
	f.broker.setFail(&client.ProblemError{Status: http.StatusTooManyRequests, RetryAfter: 20 * time.Second})
	require.Equal(t, t0.Add(20*time.Second), f.r.step(context.Background()))
}

func TestTheReplacedLeaseIsRevokedOnlyAfterEveryOutputHoldsItsSuccessorAndTheGrace(t *testing.T) {
	t.Parallel()
	a, b := &memOutput{name: "a"}, &memOutput{name: "b"}
	f := newRefresherFixture(t, config.RefreshConfig{RevokeGrace: brokerDuration(time.Minute)}, a, b)
	ctx := context.Background()
	f.r.step(ctx)

	// The refresh obtains lease 2 but output b cannot take it.
	b.setFail(errors.New("volume full"))
	f.clock.SetTime(t0.Add(40 * time.Minute))
	wake := f.r.step(ctx)
	require.Equal(t, leaseID(2), a.lease())
	require.Equal(t, leaseID(1), b.lease(), "b keeps its working credential")
	require.Equal(t, 1.0, counter(t, f, "refresh", "east", "failure"))
	require.Equal(t, 1.0, counter(t, f, "writes", "east", "mem:b", "failed"))
	exp, _ := f.r.status().expiry()
	require.Equal(t, t0.Add(time.Hour), exp, "the expiry that counts is b's older one")

	// Well past the grace, lease 1 is still in b: no revocation.
	f.clock.SetTime(wake.Add(5 * time.Minute))
	b.setFail(errors.New("still full"))
	wake = f.r.step(ctx)
	require.Empty(t, f.broker.revokedLeases())
	require.Equal(t, 2, f.broker.issued(), "the retry writes the credential it has; it does not fetch another")

	// b recovers: lease 2 everywhere; lease 1 is revoked a grace later.
	b.setFail(nil)
	f.clock.SetTime(wake)
	written := f.clock.Now()
	next := f.r.step(ctx)
	require.Equal(t, leaseID(2), b.lease())
	require.Equal(t, written.Add(time.Minute), next, "woken for the revocation")
	require.Empty(t, f.broker.revokedLeases(), "not before the grace")
	f.clock.SetTime(written.Add(time.Minute - time.Second))
	f.r.step(ctx)
	require.Empty(t, f.broker.revokedLeases())
	f.clock.SetTime(written.Add(time.Minute))
	f.r.step(ctx)
	require.Equal(t, []string{leaseID(1)}, f.broker.revokedLeases())
	require.Equal(t, 1.0, counter(t, f, "revocations", "east", "success"))
	require.Equal(t, []string{"kubeconfig", "kubeconfig", "revoke " + leaseID(1)}, f.broker.calls,
		"the revocation comes after the fetch of its successor")
}

func TestAFailedRevocationIsCountedAndNotRetried(t *testing.T) {
	t.Parallel()
	a := &memOutput{name: "a"}
	f := newRefresherFixture(t, config.RefreshConfig{}, a)
	ctx := context.Background()
	f.r.step(ctx)
	f.clock.SetTime(t0.Add(40 * time.Minute))
	f.r.step(ctx)
	f.broker.revErr = errBrokerDown
	f.clock.SetTime(t0.Add(41 * time.Minute))
	wake := f.r.step(ctx)
	require.Equal(t, 1.0, counter(t, f, "revocations", "east", "failure"))
	require.Equal(t, t0.Add(80*time.Minute), wake, "nothing more to revoke")

	// A lease already gone counts as revoked.
	f.broker.revErr = &client.ProblemError{Status: http.StatusNotFound}
	f.clock.SetTime(t0.Add(80 * time.Minute))
	f.r.step(ctx)
	f.clock.SetTime(t0.Add(81 * time.Minute))
	f.r.step(ctx)
	require.Equal(t, 1.0, counter(t, f, "revocations", "east", "success"))
}

func TestARestartAdoptsAStillValidCredentialInsteadOfFetching(t *testing.T) {
	t.Parallel()
	a, b := &memOutput{name: "a"}, &memOutput{name: "b"}
	first := newRefresherFixture(t, config.RefreshConfig{}, a, b)
	first.r.step(context.Background())

	// A new process, 10 minutes later, with the same outputs.
	f := newRefresherFixture(t, config.RefreshConfig{}, a, b)
	f.clock.SetTime(t0.Add(10 * time.Minute))
	wake := f.r.step(context.Background())
	require.Zero(t, f.broker.issued(), "no fetch on restart")
	require.Equal(t, t0.Add(40*time.Minute), wake, "scheduled from when the credential was obtained")
	require.True(t, f.r.status().ready())
	require.Equal(t, 1, a.writes)

	// At the refresh the adopted lease is replaced and revoked after the grace.
	f.clock.SetTime(t0.Add(40 * time.Minute))
	f.r.step(context.Background())
	f.clock.SetTime(t0.Add(41 * time.Minute))
	f.r.step(context.Background())
	require.Equal(t, []string{leaseID(1)}, f.broker.revokedLeases())
}

func TestARestartWritesAnAdoptedCredentialToANewOutput(t *testing.T) {
	t.Parallel()
	a := &memOutput{name: "a"}
	first := newRefresherFixture(t, config.RefreshConfig{}, a)
	first.r.step(context.Background())

	added := &memOutput{name: "added"}
	f := newRefresherFixture(t, config.RefreshConfig{}, a, added)
	f.clock.SetTime(t0.Add(5 * time.Minute))
	wake := f.r.step(context.Background())
	require.Zero(t, f.broker.issued())
	require.Equal(t, leaseID(1), added.lease())
	require.Equal(t, t0.Add(40*time.Minute), wake)
}

func TestARestartFetchesWhenTheHeldCredentialExpiredAndRevokesItsLease(t *testing.T) {
	t.Parallel()
	a := &memOutput{name: "a"}
	newRefresherFixture(t, config.RefreshConfig{}, a).r.step(context.Background())

	f := newRefresherFixture(t, config.RefreshConfig{}, a)
	f.broker.n = 10 // another process of the broker: other lease ids
	f.clock.SetTime(t0.Add(2 * time.Hour))
	f.r.step(context.Background())
	require.Equal(t, leaseID(11), a.lease())
	f.clock.SetTime(t0.Add(2*time.Hour + time.Minute))
	f.r.step(context.Background())
	require.Equal(t, []string{leaseID(1)}, f.broker.revokedLeases())
}

func TestARestartDoesNotAdoptACredentialForAnotherRequest(t *testing.T) {
	t.Parallel()
	a := &memOutput{name: "a"}
	newRefresherFixture(t, config.RefreshConfig{}, a).r.step(context.Background())

	f := newRefresherFixture(t, config.RefreshConfig{}, a)
	f.broker.n = 10
	f.r.req.ServiceAccount = "other"
	f.r.meta.request = requestDigest("https://east.example.com:8443", f.r.req)
	f.clock.SetTime(t0.Add(time.Minute))
	f.r.step(context.Background())
	require.Equal(t, 11, f.broker.issued(), "the stored credential is for another ServiceAccount: one fetch")
	require.Equal(t, leaseID(11), a.lease())
}

func TestShutdownDuringAFetchCountsNoFailure(t *testing.T) {
	t.Parallel()
	a := &memOutput{name: "a"}
	f := newRefresherFixture(t, config.RefreshConfig{}, a)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	f.broker.setFail(context.Canceled)
	f.r.step(ctx)
	require.Zero(t, counter(t, f, "refresh", "east", "failure"))
	require.Zero(t, a.writes)
}

func TestAnAnswerWithoutAUsableCredentialIsAFailure(t *testing.T) {
	t.Parallel()
	for name, resp := range map[string]apiv1.KubeconfigResponse{
		"no lease id":       {Kubeconfig: testKubeconfig("https://e", "s3cr3t"), ExpiresAt: t0.Add(time.Hour)},
		"no kubeconfig":     {LeaseID: leaseID(1), ExpiresAt: t0.Add(time.Hour)},
		"expired already":   {LeaseID: leaseID(1), Kubeconfig: testKubeconfig("https://e", "s3cr3t"), ExpiresAt: t0},
		"token mismatch":    {LeaseID: leaseID(1), Kubeconfig: testKubeconfig("https://e", "s3cr3t"), Token: "0th3r", ExpiresAt: t0.Add(time.Hour)},
		"garbage":           {LeaseID: leaseID(1), Kubeconfig: "{{{", ExpiresAt: t0.Add(time.Hour)},
		"no current server": {LeaseID: leaseID(1), Kubeconfig: "apiVersion: v1\nkind: Config\n", ExpiresAt: t0.Add(time.Hour)},
	} {
		_, err := credentialFromResponse(&resp, t0)
		require.ErrorIs(t, err, ErrBadAnswer, name)
		require.NotContains(t, err.Error(), "s3cr3t", name)
		require.NotContains(t, err.Error(), "0th3r", name)
	}
}

func TestTheRunLoopFollowsTheFakeClock(t *testing.T) {
	t.Parallel()
	a := &memOutput{name: "a"}
	f := newRefresherFixture(t, config.RefreshConfig{RevokeGrace: brokerDuration(time.Minute)}, a)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { f.r.run(ctx); close(done) }()
	waitFor := func(cond func() bool) {
		t.Helper()
		require.Eventually(t, cond, 5*time.Second, time.Millisecond)
	}
	waitFor(func() bool { return f.clock.Waiters() == 1 && a.lease() == leaseID(1) })
	f.clock.SetTime(t0.Add(40 * time.Minute))
	waitFor(func() bool { return f.clock.Waiters() == 1 && a.lease() == leaseID(2) })
	f.clock.SetTime(t0.Add(41 * time.Minute))
	waitFor(func() bool { return len(f.broker.revokedLeases()) == 1 && f.clock.Waiters() == 1 })
	cancel()
	<-done
	require.Equal(t, 0, f.clock.Waiters(), "the timer is stopped")
}

func TestHealthFailsWhenACredentialExpiredOrWillBeforeTheNextAttempt(t *testing.T) {
	t.Parallel()
	g := &grant{leaseID: leaseID(1), obtainedAt: t0, expiresAt: t0.Add(time.Hour)}
	for _, tc := range []struct {
		name string
		st   targetStatus
		now  time.Time
		want string
	}{
		{"a fresh credential is healthy", targetStatus{held: []*grant{g}, nextAttempt: t0.Add(40 * time.Minute)}, t0, ""},
		{"no credential yet is not unhealthy, only not ready", targetStatus{held: []*grant{nil}}, t0, ""},
		{"an expired credential is unhealthy", targetStatus{held: []*grant{g}, nextAttempt: t0.Add(2 * time.Hour), failures: 9, lastErr: "broker down"},
			t0.Add(time.Hour), "credential expired at 2030-01-02T04:04:05Z (9 failures in a row: broker down)"},
		{"a retry after the expiry is unhealthy", targetStatus{held: []*grant{g}, nextAttempt: t0.Add(61 * time.Minute), failures: 3},
			t0.Add(58 * time.Minute), "before the next attempt at 2030-01-02T04:05:05Z"},
		{"a retry before the expiry is healthy", targetStatus{held: []*grant{g}, nextAttempt: t0.Add(59 * time.Minute), failures: 3},
			t0.Add(58 * time.Minute), ""},
		{"the output worst off decides", targetStatus{held: []*grant{{expiresAt: t0.Add(3 * time.Hour)}, g}, nextAttempt: t0.Add(90 * time.Minute)},
			t0, "credential expires at 2030-01-02T04:04:05Z"},
	} {
		err := targetHealth("east", tc.st, tc.now)
		if tc.want == "" {
			require.NoError(t, err, tc.name)
			continue
		}
		require.ErrorContains(t, err, tc.want, tc.name)
		require.True(t, strings.HasPrefix(err.Error(), "target east: "), tc.name)
	}
}

func TestAGrantedLifetimeTooShortForTheGraceIsWarnedAbout(t *testing.T) {
	t.Parallel()
	const warning = "revokeGrace is longer than what is left of this credential when it is replaced: consumers will see it expire before the grace ends; shorten refresh.revokeGrace or lower refresh.fraction"
	// The fake broker grants 1h; refreshed at 2/3, 20 minutes are left.
	short := newRefresherFixture(t, config.RefreshConfig{RevokeGrace: brokerDuration(30 * time.Minute)}, &memOutput{name: "a"})
	short.r.step(context.Background())
	require.Len(t, short.logs.FilterMessage(warning).All(), 1)

	fits := newRefresherFixture(t, config.RefreshConfig{RevokeGrace: brokerDuration(10 * time.Minute)}, &memOutput{name: "a"})
	fits.r.step(context.Background())
	require.Empty(t, fits.logs.FilterMessage(warning).All())
}
