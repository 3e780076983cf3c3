package policy

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/issuers"
)

func TestFitIssuer(t *testing.T) {
	t.Parallel()
	lim := issuers.Limits{MinTTL: 10 * time.Minute, MinClampedBy: "issuer.minimum", MaxTTL: 2 * time.Hour, MaxClampedBy: "issuer.maximum"}
	for _, tc := range []struct {
		name              string
		ttl, minTTL       time.Duration
		wantLease, wantCr time.Duration
		wantBy            string
		refused           bool
	}{
		{"A short lease is raised to the lease minimum; its credential to the issuer's.", time.Second, 0, time.Minute, 10 * time.Minute, ClampedByLeaseMinimum, false},
		{"Within the issuer's bounds nothing changes.", time.Hour, 0, time.Hour, time.Hour, "", false},
		{"The issuer's maximum shortens the lease too.", 3 * time.Hour, 0, 2 * time.Hour, 2 * time.Hour, "issuer.maximum", false},
		{"A minTTL over the issuer's maximum is refused.", 3 * time.Hour, 150 * time.Minute, 0, 0, "", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := Decision{TTL: tc.ttl}
			credTTL, err := FitIssuer(&d, lim, time.Minute, tc.minTTL)
			if tc.refused {
				require.Equal(t, problem.KindUnprocessable, problem.KindOf(err))
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.wantLease, d.TTL)
			require.Equal(t, tc.wantCr, credTTL)
			require.Equal(t, tc.wantBy, d.ClampedBy)
		})
	}
}

func TestGranted(t *testing.T) {
	t.Parallel()
	start := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	lease := start.Add(2 * time.Hour)
	d := Decision{TTL: 2 * time.Hour, ClampedBy: ClampedByGrant}

	granted, by, exp := Granted(d, start.Add(10*time.Minute), start.Add(time.Minute), start, false)
	require.Equal(t, []any{2 * time.Hour, ClampedByGrant, start.Add(time.Minute)}, []any{granted, by, exp},
		"a credential that outlives its lease grants what the lease does, until the lease's expiry")

	granted, by, exp = Granted(d, start.Add(time.Hour-300*time.Millisecond), lease, start.Add(300*time.Millisecond), false)
	require.Equal(t, []any{time.Hour, ClampedByAPIServer, start.Add(time.Hour - 300*time.Millisecond)}, []any{granted, by, exp},
		"a token the API server shortened grants what it did, rounded up to whole seconds")

	_, by, _ = Granted(d, start.Add(time.Hour), lease, start, true)
	require.Equal(t, ClampedBySigner, by)

	granted, by, _ = Granted(d, lease.Add(-3*time.Second), lease, start, false)
	require.Equal(t, []any{2 * time.Hour, ClampedByGrant}, []any{granted, by}, "a few seconds short is the lease's own TTL")
}
