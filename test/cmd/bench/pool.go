package main

import (
	"context"
	"slices"
	"time"

	"github.com/tokenbroker/tokenbroker/test/promtext"
)

// poolPaths reads the broker's tokenbroker_lease_pool_issuances_total:
// issuances on a claimed pooled Secret and on the sequential path.
func poolPaths(ctx context.Context, opsURL string) (pool, sequential float64, err error) {
	fams, err := promtext.Get(ctx, opsURL+"/metrics")
	if err != nil {
		return 0, 0, err
	}
	for _, m := range fams["tokenbroker_lease_pool_issuances_total"] {
		switch m.Labels["path"] {
		case "pool":
			pool = m.Value
		case "sequential":
			sequential = m.Value
		}
	}
	return pool, sequential, nil
}

// pooledFraction measures op and returns the fraction of the issuances it
// made that took the pool path.
func pooledFraction(ctx context.Context, opsURL string, op func() result) (result, float64) {
	p0, s0, err0 := poolPaths(ctx, opsURL)
	r := op()
	p1, s1, err1 := poolPaths(ctx, opsURL)
	if err0 != nil || err1 != nil || p1+s1-p0-s0 == 0 {
		return r, 0
	}
	return r, (p1 - p0) / (p1 + s1 - p0 - s0)
}

// pacedEvery is the interval of the paced rows: one request at a time, each
// this long after the one before started, as agents refreshing now and
// then and kubectl through the exec plugin ask; long enough for the
// broker's pool to refill between them (it waits 5 ms of quiet).
const pacedEvery = 20 * time.Millisecond

// pacedPrefix names the paced rows: pacedPrefix + the case's name.
const pacedPrefix = "paced: "

// measurePaced times n calls of op, one at a time, starting one every
// `every`; the wait between them is not timed. PerSecond is what the pace
// allows, not a throughput.
func measurePaced(ctx context.Context, op func(context.Context) error, n int, every time.Duration) result {
	lat := make([]time.Duration, n)
	var errs int64
	start := time.Now()
	for i := range n {
		time.Sleep(time.Until(start.Add(time.Duration(i) * every)))
		t0 := time.Now()
		if err := op(ctx); err != nil {
			errs++
		}
		lat[i] = time.Since(t0)
	}
	elapsed := time.Since(start)
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(n-1))].Microseconds()) / 1000 }
	return result{Concurrency: 1, Requests: n, Errors: errs,
		P50ms: pct(.50), P90ms: pct(.90), P99ms: pct(.99), PerSecond: float64(n) / elapsed.Seconds()}
}
