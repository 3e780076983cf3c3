package main

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// poolPaths reads the broker's tokenbroker_lease_pool_issuances_total:
// issuances on a claimed pooled Secret and on the sequential path.
func poolPaths(ctx context.Context, opsURL string) (pool, sequential float64, err error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, opsURL+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, 0, err
	}
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		v, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case `tokenbroker_lease_pool_issuances_total{path="pool"}`:
			pool = v
		case `tokenbroker_lease_pool_issuances_total{path="sequential"}`:
			sequential = v
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
