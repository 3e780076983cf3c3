package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPerOpDividesWhatGrewByTheRequests(t *testing.T) {
	before := apiCounts{calls: map[string]float64{"POST secrets": 10, "GET namespaces": 4}, watchEvents: 20}
	after := apiCounts{calls: map[string]float64{"POST secrets": 30, "GET namespaces": 4, "PATCH secrets": 10}, watchEvents: 100}
	per := perOp(before, after, 20)
	require.Equal(t, map[string]float64{"POST secrets": 1, "PATCH secrets": 0.5}, per.By)
	require.Equal(t, 1.5, per.Calls)
	require.Equal(t, 4.0, per.WatchEvents)

	per.CPUMicros["kube-apiserver"] = 1234
	require.Equal(t, "1.50: POST secrets 1.00, PATCH secrets 0.50; watch events 4.0; CPU kube-apiserver 1234 µs", per.String())
	require.Equal(t, "-", (*apiCallsPerOp)(nil).String())
}
