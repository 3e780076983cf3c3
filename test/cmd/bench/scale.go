package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/promtext"
)

// scaleOptions configures runScale.
type scaleOptions struct {
	// levels are the comma-separated numbers of live leases, increasing;
	// the empty cluster (0) is measured first whether listed or not, as
	// the baseline of the others.
	levels string
	// n is the number of issuances timed at each level.
	n int
	// out is the results file; runScale sets its key "scale" only.
	out string
	// kubeconfig is the harness's administrator kubeconfig, for
	// "tokenbroker leases".
	kubeconfig string
	// gcInterval is the broker's --gc-interval.
	gcInterval time.Duration
	// heapProfile, if set, gets the broker's heap profile at the largest
	// level.
	heapProfile string
}

const (
	// scaleFillConcurrency is how many issuances fill the cluster at once.
	scaleFillConcurrency = 16
	// scaleWarmUp issuances precede each level's timed sample; with fewer,
	// the empty cluster's sample (the first, on a fresh broker and API
	// server) ran cold and flattered every later level.
	scaleWarmUp = 100
	// parallelLists full paged walks run at once for the memory peak the
	// issue names: one peer listing its leases four times in parallel.
	parallelLists = 4
)

// scaleLevel is what bench -scale measures with one number of live leases
// in the cluster, all of one peer in one namespace (the worst case for a
// listing: one namespace, one API server list to page through).
type scaleLevel struct {
	Leases int `json:"leases"`
	// FillSeconds is the time to issue the leases added for this level.
	FillSeconds float64 `json:"fill_seconds"`
	// Issuance at concurrency 1 with this many live leases, and its p50
	// as a fraction of the empty cluster's (the goal: at most 1.10).
	IssueP50ms      float64 `json:"issue_p50_ms"`
	IssueP99ms      float64 `json:"issue_p99_ms"`
	IssueP50VsEmpty float64 `json:"issue_p50_vs_empty"`
	// RSSSteadyMB is the broker's RSS right after the fill; RSSPeakMB the
	// highest seen at this level: filling, GC passes, issuing, listing.
	RSSSteadyMB float64 `json:"rss_steady_mb"`
	RSSPeakMB   float64 `json:"rss_peak_mb"`
	// FirstPageMs is GET /v1/leases without continue (the default page).
	FirstPageMs    float64 `json:"first_page_ms"`
	FirstPageBytes int     `json:"first_page_bytes"`
	// WalkSeconds is one whole paged walk at the default page size;
	// WalkPages and WalkBytes its size. WalkLeases must equal the live
	// leases: Leases plus the warm-up and sample issuances of this level
	// and the ones before.
	WalkSeconds float64 `json:"walk_seconds"`
	WalkPages   int     `json:"walk_pages"`
	WalkBytes   int64   `json:"walk_bytes"`
	WalkLeases  int     `json:"walk_leases"`
	// ParallelSeconds is the time of parallelLists whole paged walks at
	// once by the same peer, each at the largest page (limit 1000); the
	// broker's RSS when they start and its peak while they run (the goal:
	// under 100 MB at 50,000 leases).
	ParallelSeconds    float64 `json:"parallel_lists_seconds"`
	ParallelRSSStartMB float64 `json:"parallel_lists_rss_start_mb"`
	ParallelRSSPeakMB  float64 `json:"parallel_lists_rss_peak_mb"`
	// "tokenbroker leases" (every namespace, table output) as a process
	// with the administrator's kubeconfig: time from start to its first
	// line of output (the goal: under 1 s at 50,000), to its exit, and what
	// it printed.
	CLIFirstLineMs float64 `json:"cli_first_line_ms"`
	CLISeconds     float64 `json:"cli_seconds"`
	CLIBytes       int64   `json:"cli_bytes"`
	CLILines       int     `json:"cli_lines"`
	// GCPassSeconds is the duration of the broker's first GC pass that
	// started after the fill (tokenbroker_lease_gc_duration_seconds), and
	// GCRSSPeakMB the broker's RSS peak from the end of the fill to the end
	// of that pass. GCOverlap says a later pass ran during the level's
	// measurements (the interval was too short for them).
	GCPassSeconds float64 `json:"gc_pass_seconds"`
	GCRSSPeakMB   float64 `json:"gc_rss_peak_mb"`
	GCOverlap     bool    `json:"gc_overlap,omitempty"`
	// HeapInuseMB is go_memstats_heap_inuse_bytes right after a forced Go
	// garbage collection, with Leases live leases; InformerMB is it less
	// the empty cluster's — what the lease informer (and any other
	// per-lease state) holds — and InformerBytesPerLease that per lease.
	HeapInuseMB           float64 `json:"heap_inuse_mb"`
	InformerMB            float64 `json:"informer_mb"`
	InformerBytesPerLease float64 `json:"informer_bytes_per_lease"`
}

// scaleReport is the key "scale" of bench/results.json.
type scaleReport struct {
	IssuanceSample    int          `json:"issuance_sample"`
	GCInterval        string       `json:"gc_interval"`
	ParallelLists     int          `json:"parallel_lists"`
	ParallelListLimit int          `json:"parallel_list_limit"`
	Levels            []scaleLevel `json:"levels"`
	// Goals are the issue's goals, checked at the largest level.
	Goals []scaleGoal `json:"goals"`
}

// scaleGoal is one goal and what the largest level measured.
type scaleGoal struct {
	Goal   string  `json:"goal"`
	Leases int     `json:"leases"`
	Value  float64 `json:"value"`
	Limit  float64 `json:"limit"`
	Met    bool    `json:"met"`
}

// runScale fills the harness with live leases through the broker, level by
// level, and measures issuance, the broker's memory, its GC pass, the
// paged listing and the CLI's at each; it prints tables and sets the key
// "scale" of the results file.
func runScale(ctx context.Context, br *brokerProcess, o scaleOptions) error {
	levels, err := parseScaleLevels(o.levels)
	if err != nil {
		return err
	}
	body, _ := json.Marshal(apiv1.KubeconfigRequest{Namespace: "bench", ServiceAccount: "runner", TTL: "1h"})
	post := func(ctx context.Context) error { return br.postKubeconfig(ctx, body, http.StatusCreated, nil) }
	rep := scaleReport{IssuanceSample: o.n, GCInterval: o.gcInterval.String(), ParallelLists: parallelLists, ParallelListLimit: 1000}
	live := 0
	for i, target := range levels {
		fmt.Printf("scale: %d live leases\n", target)
		profile := ""
		if i == len(levels)-1 {
			profile = o.heapProfile
		}
		r, err := measureScaleLevel(ctx, br, o.n, o.kubeconfig, o.gcInterval, profile, post, target, &live)
		if err != nil {
			return fmt.Errorf("at %d leases: %w", target, err)
		}
		if len(rep.Levels) > 0 {
			empty := rep.Levels[0]
			r.IssueP50VsEmpty = r.IssueP50ms / empty.IssueP50ms
			r.InformerMB = r.HeapInuseMB - empty.HeapInuseMB
			r.InformerBytesPerLease = r.InformerMB * (1 << 20) / float64(r.Leases)
		} else {
			r.IssueP50VsEmpty = 1
		}
		rep.Levels = append(rep.Levels, r)
	}
	rep.Goals = scaleGoals(rep.Levels[len(rep.Levels)-1])
	rep.print()
	if o.out == "" {
		return nil
	}
	return writeResultsKey(o.out, "scale", rep)
}

// parseScaleLevels parses the comma-separated levels, increasing, with 0
// first.
func parseScaleLevels(s string) ([]int, error) {
	levels := []int{0}
	for _, ls := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(ls))
		if err != nil || n < levels[len(levels)-1] {
			return nil, fmt.Errorf("bad scale level %q (increasing numbers of leases)", ls)
		}
		if n > levels[len(levels)-1] {
			levels = append(levels, n)
		}
	}
	return levels, nil
}

// measureScaleLevel fills the cluster to target live leases (live is how
// many there are; it is updated) and measures. The measurements after the
// fill run just after a GC pass, so that the next pass (gcInterval later)
// does not fall among them.
// The heap profile taken after the pass goes to heapProfile if it is set.
func measureScaleLevel(ctx context.Context, br *brokerProcess, n int, kubeconfig string, gcInterval time.Duration, heapProfile string,
	post func(context.Context) error, target int, live *int) (scaleLevel, error) {
	pid := br.cmd.Process.Pid
	r := scaleLevel{Leases: target}
	levelPeak := sync.OnceValue(watchRSS(ctx, pid))
	defer levelPeak() // on an early return

	t0 := time.Now()
	if add := target - *live; add > 0 {
		if f := measure(ctx, post, scaleFillConcurrency, add); f.Errors > 0 {
			return r, fmt.Errorf("filling: %d issuances failed", f.Errors)
		}
	}
	*live = target
	filled := time.Now()
	r.FillSeconds = filled.Sub(t0).Seconds()
	r.RSSSteadyMB = rssMB(pid)

	gcPeak := watchRSS(ctx, pid)
	pass, err := waitGCPass(ctx, br.opsURL, filled, 3*gcInterval+time.Minute)
	r.GCRSSPeakMB = gcPeak()
	if err != nil {
		return r, err
	}
	r.GCPassSeconds = pass.seconds

	heap, err := heapInuseAfterGC(ctx, br.opsURL, heapProfile)
	if err != nil {
		return r, err
	}
	r.HeapInuseMB = float64(heap) / (1 << 20)

	_ = measure(ctx, post, 1, scaleWarmUp)
	iss := measure(ctx, post, 1, n)
	if iss.Errors > 0 {
		return r, fmt.Errorf("%d issuances failed", iss.Errors)
	}
	*live += scaleWarmUp + n
	r.IssueP50ms, r.IssueP99ms = iss.P50ms, iss.P99ms

	t0 = time.Now()
	first, err := leasePage(ctx, br, 0, "")
	if err != nil {
		return r, err
	}
	r.FirstPageMs = float64(time.Since(t0).Microseconds()) / 1000
	r.FirstPageBytes = int(first.bytes)

	t0 = time.Now()
	walk, err := walkLeases(ctx, br, 0)
	if err != nil {
		return r, err
	}
	r.WalkSeconds = time.Since(t0).Seconds()
	r.WalkPages, r.WalkBytes, r.WalkLeases = walk.pages, walk.bytes, walk.items
	if r.WalkLeases != *live {
		return r, fmt.Errorf("the paged walk found %d leases, want %d", r.WalkLeases, *live)
	}

	r.ParallelRSSStartMB = rssMB(pid)
	listPeak := watchRSS(ctx, pid)
	t0 = time.Now()
	walks := make([]walkResult, parallelLists)
	errs := make([]error, parallelLists)
	var wg sync.WaitGroup
	for i := range walks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			walks[i], errs[i] = walkLeases(ctx, br, 1000)
		}()
	}
	wg.Wait()
	r.ParallelSeconds = time.Since(t0).Seconds()
	r.ParallelRSSPeakMB = listPeak()
	if err := errors.Join(errs...); err != nil {
		return r, fmt.Errorf("parallel lists: %w", err)
	}
	for _, w := range walks {
		if w.items != *live {
			return r, fmt.Errorf("a parallel walk found %d leases, want %d", w.items, *live)
		}
	}

	cli, err := runLeasesCLI(ctx, br.bin, kubeconfig)
	if err != nil {
		return r, err
	}
	r.CLIFirstLineMs = float64(cli.firstLine.Microseconds()) / 1000
	r.CLISeconds, r.CLIBytes, r.CLILines = cli.total.Seconds(), cli.bytes, cli.lines
	if r.CLILines != *live+1 { // the header
		return r, fmt.Errorf("tokenbroker leases printed %d lines, want %d leases and a header", r.CLILines, *live)
	}

	after, err := scrapeGC(ctx, br.opsURL)
	if err != nil {
		return r, err
	}
	r.GCOverlap = after.runs != pass.runs
	r.RSSPeakMB = levelPeak()
	return r, nil
}

type pageResult struct {
	items int
	bytes int64
	next  string
}

// leasePage fetches one page of GET /v1/leases (limit 0: the default) and
// counts it without keeping the leases.
func leasePage(ctx context.Context, br *brokerProcess, limit int, token string) (pageResult, error) {
	q := url.Values{}
	if limit > 0 {
		q.Set("limit", strconv.Itoa(limit))
	}
	if token != "" {
		q.Set("continue", token)
	}
	u := br.url + "/v1/leases"
	if len(q) > 0 {
		u += "?" + q.Encode()
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

type walkResult struct {
	pages, items int
	bytes        int64
}

// walkLeases follows GET /v1/leases from the first page to the last.
func walkLeases(ctx context.Context, br *brokerProcess, limit int) (walkResult, error) {
	var w walkResult
	token := ""
	for {
		p, err := leasePage(ctx, br, limit, token)
		if err != nil {
			return w, err
		}
		w.pages++
		w.bytes += p.bytes
		w.items += p.items
		if p.next == "" {
			return w, nil
		}
		token = p.next
	}
}

type countWriter struct{ n *atomic.Int64 }

func (w countWriter) Write(p []byte) (int, error) { w.n.Add(int64(len(p))); return len(p), nil }

// cliResult is one run of "tokenbroker leases".
type cliResult struct {
	firstLine, total time.Duration
	bytes            int64
	lines            int
}

// runLeasesCLI runs "tokenbroker leases" over every namespace with the
// administrator's kubeconfig and times its output as it comes.
func runLeasesCLI(ctx context.Context, bin, kubeconfig string) (cliResult, error) {
	var r cliResult
	cmd := exec.CommandContext(ctx, bin, "leases", "--kubeconfig", kubeconfig)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return r, err
	}
	t0 := time.Now()
	if err := cmd.Start(); err != nil {
		return r, err
	}
	br := bufio.NewReaderSize(stdout, 64<<10)
	buf := make([]byte, 64<<10)
	for {
		n, err := br.Read(buf)
		if n > 0 {
			nl := bytes.Count(buf[:n], []byte{'\n'})
			if r.lines == 0 && nl > 0 {
				r.firstLine = time.Since(t0)
			}
			r.lines += nl
			r.bytes += int64(n)
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			return r, err
		}
	}
	if err := cmd.Wait(); err != nil {
		return r, fmt.Errorf("tokenbroker leases: %w: %s", err, stderr.String())
	}
	r.total = time.Since(t0)
	return r, nil
}

// gcState is what the broker's /metrics says about its GC passes.
type gcState struct {
	runs, failures, seconds, lastSuccess float64
}

// gcPass is one GC pass: its duration and the pass count after it.
type gcPass struct {
	seconds, runs float64
}

// waitGCPass waits for a successful GC pass of the broker that started
// after after, and returns its duration: a pass's end is
// tokenbroker_lease_gc_last_success_timestamp_seconds, and its duration the
// growth of tokenbroker_lease_gc_duration_seconds' sum while its count grew
// by one.
func waitGCPass(ctx context.Context, opsURL string, after time.Time, timeout time.Duration) (gcPass, error) {
	prev, err := scrapeGC(ctx, opsURL)
	if err != nil {
		return gcPass{}, err
	}
	since := float64(after.UnixNano()) / 1e9
	deadline := time.Now().Add(timeout)
	for {
		select {
		case <-ctx.Done():
			return gcPass{}, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		cur, err := scrapeGC(ctx, opsURL)
		if err != nil {
			return gcPass{}, err
		}
		if cur.runs > prev.runs {
			d := cur.seconds - prev.seconds
			if cur.runs-prev.runs == 1 && cur.failures == prev.failures && cur.lastSuccess-d >= since {
				return gcPass{seconds: d, runs: cur.runs}, nil
			}
			prev = cur // a pass that began before after, or several at once: the next
		}
		if time.Now().After(deadline) {
			return gcPass{}, fmt.Errorf("no successful GC pass within %s (%.0f failed so far); broker log in its bench- directory", timeout, cur.failures)
		}
	}
}

// scrapeGC reads the GC metrics.
func scrapeGC(ctx context.Context, opsURL string) (gcState, error) {
	fams, err := promtext.Get(ctx, opsURL+"/metrics")
	if err != nil {
		return gcState{}, err
	}
	var s gcState
	for _, m := range fams["tokenbroker_lease_gc_runs_total"] {
		s.runs += m.Value
		if m.Labels["result"] == "failure" {
			s.failures += m.Value
		}
	}
	for _, m := range fams["tokenbroker_lease_gc_duration_seconds"] {
		s.seconds += m.Value
	}
	for _, m := range fams["tokenbroker_lease_gc_last_success_timestamp_seconds"] {
		s.lastSuccess = m.Value
	}
	return s, nil
}

// heapInuseAfterGC has the broker collect its garbage (pprof's heap
// profile with gc=1 runs runtime.GC first) and then reads
// go_memstats_heap_inuse_bytes: what the broker's live objects take,
// without the garbage of the last list or GC pass. The profile goes to
// profileFile if it is set (go tool pprof reads it).
func heapInuseAfterGC(ctx context.Context, opsURL, profileFile string) (int64, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, opsURL+"/debug/pprof/heap?gc=1", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	profile, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	switch {
	case err != nil:
		return 0, err
	case resp.StatusCode != http.StatusOK:
		return 0, fmt.Errorf("forcing the broker's garbage collection: status %d (is --pprof on?)", resp.StatusCode)
	case profileFile != "":
		if err := os.WriteFile(profileFile, profile, 0o644); err != nil {
			return 0, err
		}
	}
	fams, err := promtext.Get(ctx, opsURL+"/metrics")
	if err != nil {
		return 0, err
	}
	for _, m := range fams["go_memstats_heap_inuse_bytes"] {
		return int64(m.Value), nil
	}
	return 0, errors.New("no go_memstats_heap_inuse_bytes in the broker's /metrics")
}

// scaleGoals checks the issue's goals at level r.
func scaleGoals(r scaleLevel) []scaleGoal {
	g := []scaleGoal{
		{Goal: "issuance p50 ÷ the empty cluster's", Value: r.IssueP50VsEmpty, Limit: 1.10},
		{Goal: "broker RSS peak MB during 4 parallel lists", Value: r.ParallelRSSPeakMB, Limit: 100},
		{Goal: "broker RSS peak MB at the level (fill, GC, lists)", Value: r.RSSPeakMB, Limit: 100},
		{Goal: "GET /v1/leases first page ms", Value: r.FirstPageMs, Limit: 50},
		{Goal: "tokenbroker leases first line ms", Value: r.CLIFirstLineMs, Limit: 1000},
	}
	for i := range g {
		g[i].Leases = r.Leases
		g[i].Met = g[i].Value < g[i].Limit || (i == 0 && g[i].Value <= g[i].Limit)
	}
	return g
}

func (rep scaleReport) print() {
	fmt.Printf("\nissuance at concurrency 1 (%d after %d warm-up), broker RSS, GET /v1/leases:\n", rep.IssuanceSample, scaleWarmUp)
	fmt.Printf("%8s %7s %9s %9s %9s %10s %9s %11s %11s %7s %8s\n", "leases", "fill s", "issue p50", "issue p99", "p50/empty", "RSS steady", "RSS peak", "1st page ms", "1st page KB", "walk s", "walk MB")
	for _, r := range rep.Levels {
		fmt.Printf("%8d %7.1f %9.2f %9.2f %9.2f %10.1f %9.1f %11.1f %11.1f %7.2f %8.1f\n", r.Leases, r.FillSeconds, r.IssueP50ms, r.IssueP99ms, r.IssueP50VsEmpty,
			r.RSSSteadyMB, r.RSSPeakMB, r.FirstPageMs, float64(r.FirstPageBytes)/1024, r.WalkSeconds, float64(r.WalkBytes)/(1<<20))
	}
	fmt.Printf("\n%d parallel paged lists (limit %d), tokenbroker leases, GC pass (--gc-interval %s), heap after a forced Go GC:\n", rep.ParallelLists, rep.ParallelListLimit, rep.GCInterval)
	fmt.Printf("%8s %8s %14s %12s %8s %7s %8s %11s %9s %8s %11s %7s\n", "leases", "lists s", "RSS start/peak", "CLI 1st ms", "CLI s", "CLI MB", "GC s", "GC RSS peak", "heap MB", "leases MB", "B per lease", "GC hit")
	for _, r := range rep.Levels {
		perLease := "-"
		if r.Leases > 0 {
			perLease = fmt.Sprintf("%.0f", r.InformerBytesPerLease)
		}
		fmt.Printf("%8d %8.2f %6.1f / %5.1f %12.1f %8.2f %7.1f %8.3f %11.1f %9.1f %8.1f %11s %7t\n", r.Leases, r.ParallelSeconds, r.ParallelRSSStartMB, r.ParallelRSSPeakMB,
			r.CLIFirstLineMs, r.CLISeconds, float64(r.CLIBytes)/(1<<20), r.GCPassSeconds, r.GCRSSPeakMB, r.HeapInuseMB, r.InformerMB, perLease, r.GCOverlap)
	}
	fmt.Println()
	for _, g := range rep.Goals {
		verdict := "met"
		if !g.Met {
			verdict = "MISSED"
		}
		fmt.Printf("goal at %d leases: %s %.2f, limit %.2f: %s\n", g.Leases, g.Goal, g.Value, g.Limit, verdict)
	}
}
