package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// scaleLevel is what bench -scale measures with one number of live leases
// in the cluster, all of one peer in one namespace (the worst case for a
// listing: one namespace, one API server list to page through).
type scaleLevel struct {
	Leases int `json:"leases"`
	// FillSeconds is the time to issue the leases added for this level.
	FillSeconds float64 `json:"fill_seconds"`
	// Issuance at concurrency 1 with this many live leases.
	IssueP50ms float64 `json:"issue_p50_ms"`
	IssueP99ms float64 `json:"issue_p99_ms"`
	// RSSSteadyMB is the broker's RSS after the fill, idle; RSSPeakMB the
	// highest seen while filling, issuing and listing.
	RSSSteadyMB float64 `json:"rss_steady_mb"`
	RSSPeakMB   float64 `json:"rss_peak_mb"`
	// FirstPageMs is GET /v1/leases without continue (the default page).
	FirstPageMs    float64 `json:"first_page_ms"`
	FirstPageBytes int     `json:"first_page_bytes"`
	// WalkSeconds is the whole paged walk; WalkPages and WalkBytes its
	// size. WalkLeases must equal Leases plus the issuance sample.
	WalkSeconds float64 `json:"walk_seconds"`
	WalkPages   int     `json:"walk_pages"`
	WalkBytes   int64   `json:"walk_bytes"`
	WalkLeases  int     `json:"walk_leases"`
}

// runScale fills the harness with live leases through the broker, level by
// level, and measures issuance, the broker's memory and the paged listing
// at each; it prints a table and writes the levels as JSON to out.
func runScale(ctx context.Context, br *brokerProcess, levels string, n int, out string) error {
	body, _ := json.Marshal(apiv1.KubeconfigRequest{Namespace: "bench", ServiceAccount: "runner", TTL: "1h"})
	post := func(ctx context.Context) error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, br.url+"/v1/kubeconfigs", bytes.NewReader(body))
		req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
		resp, err := br.client.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		if resp.StatusCode != http.StatusCreated {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}
	var results []scaleLevel
	live := 0
	for _, ls := range strings.Split(levels, ",") {
		target, err := strconv.Atoi(strings.TrimSpace(ls))
		if err != nil || target < live {
			return fmt.Errorf("bad scale level %q (increasing numbers of leases)", ls)
		}
		peak := watchRSS(ctx, br.cmd.Process.Pid)
		r := scaleLevel{Leases: target}
		t0 := time.Now()
		if f := measure(ctx, post, 16, target-live); f.Errors > 0 {
			return fmt.Errorf("filling to %d leases: %d issuances failed", target, f.Errors)
		}
		r.FillSeconds = time.Since(t0).Seconds()
		r.RSSSteadyMB = rssMB(br.cmd.Process.Pid)
		iss := measure(ctx, post, 1, n)
		if iss.Errors > 0 {
			return fmt.Errorf("%d issuances failed at %d leases", iss.Errors, target)
		}
		live = target + n
		r.IssueP50ms, r.IssueP99ms = iss.P50ms, iss.P99ms
		t0 = time.Now()
		first, err := leasePage(ctx, br, "")
		if err != nil {
			return err
		}
		r.FirstPageMs = float64(time.Since(t0).Microseconds()) / 1000
		r.FirstPageBytes = int(first.bytes)
		t0 = time.Now()
		token := ""
		for {
			p, err := leasePage(ctx, br, token)
			if err != nil {
				return err
			}
			r.WalkPages++
			r.WalkBytes += p.bytes
			r.WalkLeases += p.items
			if p.next == "" {
				break
			}
			token = p.next
		}
		r.WalkSeconds = time.Since(t0).Seconds()
		r.RSSPeakMB = peak()
		if r.WalkLeases != live {
			return fmt.Errorf("the paged walk found %d leases, want %d", r.WalkLeases, live)
		}
		results = append(results, r)
	}
	fmt.Printf("%8s %9s %10s %10s %11s %10s %13s %11s %9s %10s\n", "leases", "fill s", "issue p50", "issue p99", "RSS steady", "RSS peak", "1st page ms", "1st page KB", "walk s", "walk MB")
	for _, r := range results {
		fmt.Printf("%8d %9.1f %10.2f %10.2f %11.1f %10.1f %13.1f %11.1f %9.2f %10.1f\n", r.Leases, r.FillSeconds, r.IssueP50ms, r.IssueP99ms,
			r.RSSSteadyMB, r.RSSPeakMB, r.FirstPageMs, float64(r.FirstPageBytes)/1024, r.WalkSeconds, float64(r.WalkBytes)/(1<<20))
	}
	if out == "" {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return err
	}
	b, _ := json.MarshalIndent(map[string]any{"levels": results, "issuance_sample": n}, "", "  ")
	return os.WriteFile(out, append(b, '\n'), 0o644)
}

type pageResult struct {
	items int
	bytes int64
	next  string
}

// leasePage fetches one page of GET /v1/leases and counts it without
// keeping the leases.
func leasePage(ctx context.Context, br *brokerProcess, token string) (pageResult, error) {
	u := br.url + "/v1/leases"
	if token != "" {
		u += "?continue=" + url.QueryEscape(token)
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	resp, err := br.client.Do(req)
	if err != nil {
		return pageResult{}, err
	}
	defer resp.Body.Close()
	var counted atomic.Int64
	var list apiv1.LeaseList
	if resp.StatusCode != http.StatusOK {
		return pageResult{}, fmt.Errorf("GET /v1/leases: status %d", resp.StatusCode)
	}
	if err := json.NewDecoder(io.TeeReader(resp.Body, countWriter{&counted})).Decode(&list); err != nil {
		return pageResult{}, fmt.Errorf("GET /v1/leases: %w", err)
	}
	return pageResult{items: len(list.Items), bytes: counted.Load(), next: list.Continue}, nil
}

type countWriter struct{ n *atomic.Int64 }

func (w countWriter) Write(p []byte) (int, error) { w.n.Add(int64(len(p))); return len(p), nil }
