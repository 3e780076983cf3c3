package agent

import (
	"crypto/x509"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/agent/config"
	"github.com/tokenbroker/tokenbroker/pki"
)

func testSchedule(jitter float64, rnd Rand) schedule {
	return schedule{fraction: config.DefaultFraction, jitter: jitter, minBackoff: time.Second, maxBackoff: 5 * time.Minute, rand: rnd}
}

func TestARefreshIsDueAtTwoThirdsOfTheGrantedLifetime(t *testing.T) {
	t.Parallel()
	s := testSchedule(0.1, fixedRand(0))
	g := grant{obtainedAt: t0, expiresAt: t0.Add(90 * time.Minute)}
	require.Equal(t, t0.Add(60*time.Minute), s.refreshAt(g))
	// Measured from when the credential was obtained, not from now.
	require.Equal(t, 45*time.Minute, s.next(t0.Add(15*time.Minute), &g, 0, 0))
	// The granted lifetime counts, whatever was asked for: a 10-minute
	// grant is refreshed after 6m40s.
	short := grant{obtainedAt: t0, expiresAt: t0.Add(10 * time.Minute)}
	require.Equal(t, t0.Add(400*time.Second), s.refreshAt(short))
}

func TestARefreshWhoseTimeHasPassedIsDueAtOnce(t *testing.T) {
	t.Parallel()
	s := testSchedule(0.1, fixedRand(0.5))
	g := grant{obtainedAt: t0, expiresAt: t0.Add(time.Hour)}
	require.Zero(t, s.next(t0.Add(59*time.Minute), &g, 0, 0))
	require.Zero(t, s.next(t0, nil, 0, 0), "nothing held: fetch at once")
}

func TestJitterOnlyEverBringsARefreshForwardAndByAtMostItsShare(t *testing.T) {
	t.Parallel()
	g := grant{obtainedAt: t0, expiresAt: t0.Add(12 * time.Hour)}
	base := 8 * time.Hour // 2/3 of 12h
	for _, jitter := range []float64{0.01, 0.1, 0.5, 0.9} {
		var earliest, latest time.Duration = base, 0
		for seed := range uint64(2000) {
			s := testSchedule(jitter, rand.New(rand.NewPCG(seed, seed*7+1)))
			d := s.refreshAt(g).Sub(t0)
			require.LessOrEqual(t, d, base, "seed %d: jitter must never delay a refresh", seed)
			require.GreaterOrEqual(t, d, base-time.Duration(jitter*float64(base)), "seed %d: jitter %g took off too much", seed, jitter)
			earliest, latest = min(earliest, d), max(latest, d)
		}
		// The jitter is used: refreshes of many agents spread out.
		require.Greater(t, latest-earliest, time.Duration(0.8*jitter*float64(base)), "jitter %g", jitter)
	}
}

func TestWithoutJitterTheDelayIsExact(t *testing.T) {
	t.Parallel()
	s := testSchedule(0, fixedRand(0.99))
	g := grant{obtainedAt: t0, expiresAt: t0.Add(3 * time.Hour)}
	require.Equal(t, t0.Add(2*time.Hour), s.refreshAt(g))
}

func TestBackoffDoublesFromTheMinimumAndStopsAtTheMaximum(t *testing.T) {
	t.Parallel()
	s := testSchedule(0.1, fixedRand(0))
	var got []time.Duration
	for n := 1; n <= 12; n++ {
		got = append(got, s.next(t0, nil, n, 0))
	}
	sec := time.Second
	require.Equal(t, []time.Duration{1 * sec, 2 * sec, 4 * sec, 8 * sec, 16 * sec, 32 * sec, 64 * sec, 128 * sec, 256 * sec, 300 * sec, 300 * sec, 300 * sec}, got)
	// A credential held does not change the backoff.
	g := grant{obtainedAt: t0, expiresAt: t0.Add(time.Hour)}
	require.Equal(t, 4*time.Second, s.next(t0, &g, 3, 0))
	// Far past any reasonable count it stays capped (no overflow).
	require.Equal(t, 5*time.Minute, s.backoff(10_000))
}

func TestBackoffJitterTakesOffAtMostItsShare(t *testing.T) {
	t.Parallel()
	for seed := range uint64(500) {
		s := testSchedule(0.2, rand.New(rand.NewPCG(seed, 3)))
		for n := 1; n <= 10; n++ {
			full := testSchedule(0, nil).backoff(n)
			d := s.backoff(n)
			require.LessOrEqual(t, d, full)
			require.GreaterOrEqual(t, d, full-time.Duration(0.2*float64(full)))
		}
	}
	// With the largest draw the delay is (1 - jitter) of the full one.
	require.Equal(t, 1600*time.Millisecond, testSchedule(0.2, fixedRand(1)).backoff(2))
}

func TestTheBrokersRetryAfterIsHonouredWithinTheMaximum(t *testing.T) {
	t.Parallel()
	s := testSchedule(0, nil)
	require.Equal(t, 30*time.Second, s.next(t0, nil, 1, 30*time.Second), "longer than the backoff: wait as told")
	require.Equal(t, 4*time.Second, s.next(t0, nil, 3, 2*time.Second), "shorter than the backoff: back off")
	require.Equal(t, 5*time.Minute, s.next(t0, nil, 1, time.Hour), "never beyond maxBackoff")
}

func TestAnAbsurdlyShortGrantIsNotRefreshedInALoop(t *testing.T) {
	t.Parallel()
	s := testSchedule(0.1, fixedRand(0))
	g := grant{obtainedAt: t0, expiresAt: t0.Add(300 * time.Millisecond)}
	require.Equal(t, t0.Add(time.Second), s.refreshAt(g))
}

func TestCertificateRenewalIsMeasuredFromIssuanceNotTheBackdatedNotBefore(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	// A 10-minute certificate issued now, NotBefore backdated by the CA.
	cert := &x509.Certificate{NotBefore: now.Add(-pki.Backdate), NotAfter: now.Add(10 * time.Minute)}
	g := certGrant(cert, now)
	require.Equal(t, now, g.obtainedAt)
	s := &schedule{fraction: 0.02, minBackoff: time.Second, maxBackoff: time.Minute, rand: fixedRand(0)}
	require.True(t, s.refreshAt(g).After(now), "a renewal at 2%% of the lifetime is not due at issuance")

	// A certificate loaded long after it was issued keeps its real issuance.
	old := &x509.Certificate{NotBefore: now.Add(-2 * time.Hour), NotAfter: now.Add(22 * time.Hour)}
	require.Equal(t, now.Add(-2*time.Hour+pki.Backdate), certGrant(old, now).obtainedAt)
}
