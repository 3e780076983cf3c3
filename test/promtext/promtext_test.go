package promtext

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseReadsEachKindOfSeries(t *testing.T) {
	fams, err := Parse(strings.NewReader(`# TYPE requests_total counter
requests_total{verb="POST",resource="secrets"} 3
requests_total{verb="PATCH",resource="secrets"} 1
# TYPE open gauge
open 2
# TYPE took_seconds histogram
took_seconds_bucket{le="1"} 2
took_seconds_bucket{le="+Inf"} 2
took_seconds_sum 0.5
took_seconds_count 2
`))
	require.NoError(t, err)
	require.Equal(t, []Series{
		{Labels: map[string]string{"verb": "POST", "resource": "secrets"}, Value: 3},
		{Labels: map[string]string{"verb": "PATCH", "resource": "secrets"}, Value: 1},
	}, fams["requests_total"])
	require.Equal(t, 2.0, fams["open"][0].Value)
	require.Equal(t, 0.5, fams["took_seconds"][0].Value, "a histogram's value is its sum")

	_, err = Parse(strings.NewReader("requests_total{verb=\"POST\" 3\n"))
	require.Error(t, err)
}
