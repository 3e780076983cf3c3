package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

const ownMetrics = `# TYPE tokenbroker_issuance_own_seconds histogram
tokenbroker_issuance_own_seconds_bucket{outcome="granted",le="5e-05"} 10
tokenbroker_issuance_own_seconds_bucket{outcome="granted",le="0.0001"} 30
tokenbroker_issuance_own_seconds_bucket{outcome="granted",le="0.00025"} 40
tokenbroker_issuance_own_seconds_bucket{outcome="granted",le="+Inf"} 40
tokenbroker_issuance_own_seconds_bucket{outcome="denied",le="5e-05"} 99
`

func TestARowsOwnTimeIsWhatTheHistogramCountedDuringIt(t *testing.T) {
	t.Parallel()
	after, err := parseOwnHistogram(ownMetrics)
	require.NoError(t, err)
	require.Len(t, after, 4, "granted requests only")
	before := ownHistogram{{5e-5, 10}, {1e-4, 10}, {2.5e-4, 20}, {after[3].le, 20}}

	// During the row: 0 under 50 µs, 20 between 50 and 100, none above.
	q := after.since(before).quantiles()
	require.InDelta(t, 0.075, q["p50"], 1e-9, "the middle of the 50-100 µs bucket, in ms")
	require.InDelta(t, 0.0995, q["p99"], 1e-9)

	// Over the whole run, the 36th of 40 falls 6 of 10 into the
	// 100-250 µs bucket.
	require.InDelta(t, 0.190, after.quantiles()["p90"], 1e-9)

	require.Nil(t, after.since(after).quantiles(), "a row that issued nothing has no own time")
	_, err = parseOwnHistogram("nothing")
	require.Error(t, err)
}
