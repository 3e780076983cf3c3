package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/tokenbroker/tokenbroker/test/promtext"
)

// apiCounts is what the API server has served so far, from its own
// /metrics: requests by "VERB resource[/subresource]" (resource requests
// only: /metrics itself is not one) and the watch events it has sent.
type apiCounts struct {
	calls       map[string]float64
	watchEvents float64
}

func (a apiCounts) total() float64 {
	t := 0.0
	for _, v := range a.calls {
		t += v
	}
	return t
}

// readAPICounts reads apiserver_request_total and
// apiserver_watch_events_total from the API server's /metrics.
func readAPICounts(ctx context.Context, c kubernetes.Interface) (apiCounts, error) {
	raw, err := c.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return apiCounts{}, fmt.Errorf("the API server's /metrics: %w", err)
	}
	fams, err := promtext.Parse(bytes.NewReader(raw))
	if err != nil {
		return apiCounts{}, fmt.Errorf("the API server's /metrics: %w", err)
	}
	a := apiCounts{calls: map[string]float64{}}
	for _, s := range fams["apiserver_request_total"] {
		res := s.Labels["resource"]
		if res == "" {
			continue
		}
		if sub := s.Labels["subresource"]; sub != "" {
			res += "/" + sub
		}
		a.calls[s.Labels["verb"]+" "+res] += s.Value
	}
	for _, s := range fams["apiserver_watch_events_total"] {
		a.watchEvents += s.Value
	}
	return a, nil
}

// settledAPICounts reads the API server's counts once they have stopped
// moving: the same total twice, settleQuiet apart (what a broker defers to
// its quiet moments, such as credential-id writes, lands before it), or
// the last read after settleMax.
func settledAPICounts(ctx context.Context, c kubernetes.Interface) (apiCounts, error) {
	const settleQuiet, settleMax = 300 * time.Millisecond, 10 * time.Second
	deadline := time.Now().Add(settleMax)
	last, err := readAPICounts(ctx, c)
	for err == nil && time.Now().Before(deadline) {
		time.Sleep(settleQuiet)
		var next apiCounts
		if next, err = readAPICounts(ctx, c); err != nil {
			break
		}
		// Each read of /metrics is itself no resource request, so a
		// settled API server reads the same total twice.
		if next.total() == last.total() {
			return next, nil
		}
		last = next
	}
	return last, err
}

// apiCallsPerOp is what op cost the API server per request, all clients
// counted (during a broker row only the brokers, and the controller
// manager's few lease renewals, call it): the counts settled before and
// after it, divided by the requests it made.
type apiCallsPerOp struct {
	Calls       float64            `json:"calls"`
	By          map[string]float64 `json:"by"`
	WatchEvents float64            `json:"watch_events"`
	// CPUMicros is the CPU time per request of each process named in
	// countAPICalls's pids (the kube-apiserver, the brokers), between
	// the same two settled reads.
	CPUMicros map[string]float64 `json:"cpu_us,omitempty"`
}

// countAPICalls runs op between two settled reads of the API server's
// counts and returns its result with the calls per request it made and
// the CPU time per request of each process of pids. If either read of the
// counts fails, the result has no count; a process whose CPU cannot be
// read is left out.
func countAPICalls(ctx context.Context, c kubernetes.Interface, pids map[string]int, op func() result) (result, *apiCallsPerOp) {
	before, err0 := settledAPICounts(ctx, c)
	cpu0 := map[string]cpuSample{}
	for name, pid := range pids {
		if s, err := readCPU(pid); err == nil {
			cpu0[name] = s
		}
	}
	r := op()
	after, err1 := settledAPICounts(ctx, c)
	if err0 != nil || err1 != nil || r.Requests == 0 {
		return r, nil
	}
	per := perOp(before, after, r.Requests)
	for name, s0 := range cpu0 {
		if s1, err := readCPU(pids[name]); err == nil {
			per.CPUMicros[name] = microsPer(cpuBetween(s0, s1), r.Requests)
		}
	}
	return r, per
}

// perOp is what the API server served between before and after, per
// one of n requests; a call kind that did not grow is left out.
func perOp(before, after apiCounts, n int) *apiCallsPerOp {
	per := &apiCallsPerOp{By: map[string]float64{}, WatchEvents: (after.watchEvents - before.watchEvents) / float64(n), CPUMicros: map[string]float64{}}
	for k, v := range after.calls {
		if d := v - before.calls[k]; d > 0 {
			per.By[k] = d / float64(n)
			per.Calls += d / float64(n)
		}
	}
	return per
}

// String is the count and its largest parts, e.g.
// "3.01: POST secrets 1.00, POST serviceaccounts/token 1.00, PATCH secrets 1.00; watch events 2.0".
func (p *apiCallsPerOp) String() string {
	if p == nil {
		return "-"
	}
	keys := make([]string, 0, len(p.By))
	for k, v := range p.By {
		if v >= 0.01 {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool { return p.By[keys[i]] > p.By[keys[j]] })
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %.2f", k, p.By[k]))
	}
	names := make([]string, 0, len(p.CPUMicros))
	for name := range p.CPUMicros {
		names = append(names, name)
	}
	sort.Strings(names)
	cpu := make([]string, 0, len(names))
	for _, name := range names {
		cpu = append(cpu, fmt.Sprintf("%s %.0f µs", name, p.CPUMicros[name]))
	}
	return fmt.Sprintf("%.2f: %s; watch events %.1f; CPU %s", p.Calls, strings.Join(parts, ", "), p.WatchEvents, strings.Join(cpu, ", "))
}

// printAPICalls prints the API server calls per request of each row that
// has them.
func printAPICalls(rs []result) {
	printed := false
	for _, r := range rs {
		if r.APICalls == nil {
			continue
		}
		if !printed {
			fmt.Println("API server calls per request (apiserver_request_total, every client, read settled before and after each row; the pair makes 2):")
			printed = true
		}
		fmt.Printf("  %-44s c=%-3d %s\n", r.Name, r.Concurrency, r.APICalls)
	}
	if printed {
		fmt.Println()
	}
}

// fetchAPIServerProfile writes a 5-second CPU profile of the
// kube-apiserver (its /debug/pprof, on by default) to file.
func fetchAPIServerProfile(ctx context.Context, c kubernetes.Interface, file string) error {
	raw, err := c.CoreV1().RESTClient().Get().AbsPath("/debug/pprof/profile").Param("seconds", "5").DoRaw(ctx)
	if err != nil {
		return fmt.Errorf("the kube-apiserver's CPU profile: %w", err)
	}
	return os.WriteFile(file, raw, 0o644)
}
