package main

// The Vault rows: HashiCorp Vault's Kubernetes secrets engine, driven in
// this process through its logical backend with in-memory storage
// (test/vaultengine) against the same API server as the broker, timed
// with the same measure, in the same rounds. No Vault server is involved
// (no HTTP layer, token store, expiration manager or storage backend), so
// its figures are a lower bound for a Vault server.

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/klog/v2"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
	"github.com/tokenbroker/tokenbroker/test/vaultengine"
)

// The Vault cases, found by name in the report.
const (
	caseVaultUnrevocableShipped = "Vault existing SA, as shipped"
	caseVaultUnrevocableLifted  = "Vault existing SA, limiter lifted"
	caseVaultRevocableShipped   = "Vault SA+RoleBinding, as shipped"
	caseVaultRevocableLifted    = "Vault SA+RoleBinding, limiter lifted"
)

// vaultOptions are bench's flags for the Vault rows.
type vaultOptions struct {
	enabled  *bool
	shippedN *int
	samples  *int
}

// vaultFlags registers the Vault flags; call it before flag.Parse.
func vaultFlags() vaultOptions {
	return vaultOptions{
		enabled: flag.Bool("vault", true, "also time Vault's Kubernetes secrets engine (in process) in each round"),
		shippedN: flag.Int("vault-shipped-n", 50, "requests per as-shipped Vault row: its client-side limiter holds it to "+
			"about 5 requests/s, so -n would take minutes (the lifted rows use -n)"),
		samples: flag.Int("revoke-samples", 3, "revocations timed per side for revoke-to-refusal"),
	}
}

// vaultBench holds an engine per Vault row.
type vaultBench struct {
	rows     []vaultRow
	shippedN int
	samples  int
	// unrevocable and revocable are the lifted engines, used for the
	// revoke-to-refusal measurement.
	unrevocable, revocable *vaultengine.Engine
	host                   string
	caData                 []byte
}

type vaultRow struct {
	name    string
	engine  *vaultengine.Engine
	shipped bool
}

// vaultIdentityNamespace holds the plugin's own ServiceAccount.
const vaultIdentityNamespace = "vault"

// newVaultBench gives the plugin an identity in c (vaultengine.Grant) and
// mounts one engine per row: bench/runner's tokens (unrevocable) and a
// ServiceAccount + RoleBinding to Role bench-view per credential
// (revocable), each as shipped and with the limiter lifted to the
// broker's own --kube-qps/--kube-burst. It returns nil when the rows are
// off.
func newVaultBench(ctx context.Context, c *testcluster.Cluster, o vaultOptions) (*vaultBench, error) {
	if !*o.enabled {
		return nil, nil
	}
	// client-go logs each wait of more than a second in its limiter
	// through klog; the as-shipped rows wait on every request, and the
	// table says so once.
	klog.SetLogger(logr.Discard())
	token, err := vaultengine.Grant(ctx, c.Client, vaultIdentityNamespace, 2*time.Hour)
	if err != nil {
		return nil, err
	}
	v := &vaultBench{shippedN: *o.shippedN, samples: *o.samples, host: c.URL, caData: c.CAData}
	lifted := vaultengine.Limit{QPS: brokerKubeQPS, Burst: brokerKubeBurst}
	for _, r := range []struct {
		name string
		mode vaultengine.Mode
		lift vaultengine.Limit
	}{
		{caseVaultUnrevocableShipped, vaultengine.Unrevocable, vaultengine.Limit{}},
		{caseVaultUnrevocableLifted, vaultengine.Unrevocable, lifted},
		{caseVaultRevocableShipped, vaultengine.Revocable, vaultengine.Limit{}},
		{caseVaultRevocableLifted, vaultengine.Revocable, lifted},
	} {
		e, err := vaultengine.New(ctx, vaultengine.Config{Host: c.URL, CAData: c.CAData, Token: token,
			Namespace: "bench", Mode: r.mode, ServiceAccount: "runner", Role: "bench-view",
			TTL: 10 * time.Minute, LiftLimiter: r.lift})
		if err != nil {
			return nil, fmt.Errorf("vault %s: %w", r.name, err)
		}
		shipped := r.lift.QPS == 0
		if shipped && v.shippedN < 1 {
			continue
		}
		v.rows = append(v.rows, vaultRow{name: r.name, engine: e, shipped: shipped})
		switch r.name {
		case caseVaultUnrevocableLifted:
			v.unrevocable = e
		case caseVaultRevocableLifted:
			v.revocable = e
		}
	}
	return v, nil
}

// measureRound times each Vault row at conc: n requests for a lifted row,
// the -vault-shipped-n for an as-shipped one, after a warm-up like the
// other rows' (for an as-shipped row 10 requests, which empty the
// limiter's bucket of 10 that refilled while other rows ran, so that what
// is timed is its steady rate).
func (v *vaultBench) measureRound(ctx context.Context, conc, n int) []result {
	if v == nil {
		return nil
	}
	var out []result
	for _, row := range v.rows {
		op := func(ctx context.Context) error {
			_, err := row.engine.Issue(ctx)
			return err
		}
		warm, count := 20, n
		if row.shipped {
			warm, count = 10, v.shippedN
		}
		_ = measure(ctx, op, conc, warm)
		r := measure(ctx, op, conc, count)
		r.Name = row.name
		out = append(out, r)
	}
	return out
}

// vaultReport is the Vault side by side in bench/results.json.
type vaultReport struct {
	// Plugin is module@version as built into bench.
	Plugin string `json:"plugin"`
	Driven string `json:"driven"`
	// Identity is what the plugin authenticates as.
	Identity string `json:"identity"`
	// AsShipped and Lifted say what the two kinds of row run with.
	AsShipped string `json:"as_shipped"`
	Lifted    string `json:"limiter_lifted"`
	// AsShippedRequests is the requests per as-shipped row.
	AsShippedRequests int `json:"as_shipped_requests"`
	// Ratios are broker ÷ Vault for every Vault row at every concurrency.
	Ratios []vaultRatio `json:"ratios"`
	// RevokeToRefusal is, per side, the time from the revoke call to the
	// API server's first 401 for the revoked token.
	RevokeToRefusal []refusal `json:"revoke_to_refusal"`
}

type vaultRatio struct {
	Concurrency int    `json:"concurrency"`
	Vault       string `json:"vault_case"`
	// P50 is the broker's p50 ÷ this Vault row's: below 1, the broker
	// answers faster.
	P50 float64 `json:"broker_over_vault_p50"`
	// PerSecond is the broker's throughput ÷ this Vault row's: above 1,
	// the broker serves more.
	PerSecond float64 `json:"broker_over_vault_per_second"`
}

// refusal is one side's revoke-to-refusal.
type refusal struct {
	Side string `json:"side"`
	// MedianMs is the median time from the start of the revoke call to
	// the first 401; null when the token was never refused within
	// PatienceMs.
	MedianMs  *float64  `json:"median_ms"`
	SamplesMs []float64 `json:"samples_ms,omitempty"`
	// RevokeCallMs is the median time of the revoke call itself.
	RevokeCallMs float64 `json:"revoke_call_ms"`
	PatienceMs   float64 `json:"patience_ms"`
	Note         string  `json:"note,omitempty"`
}

// refusalPatience is how long a revoked token is probed before it counts
// as never refused: twice the API server's 10 s cache of a token's
// authentication, so that a refusal the cache delays is still seen.
const refusalPatience = 20 * time.Second

// report computes the ratios from the measured rows and times revoke to
// refusal: the broker's DELETE /v1/leases/{id} and the revocable and
// unrevocable engines' lease revoke, each followed by a SelfSubjectReview
// with the revoked token every 100 ms until the API server answers 401.
// Every token is used once just before its revoke, as a user would have,
// so the API server's token cache holds it on every side alike.
func (v *vaultBench) report(ctx context.Context, rs []result, br *brokerProcess, body []byte) (*vaultReport, error) {
	if v == nil {
		return nil, nil
	}
	rep := &vaultReport{
		Plugin:   vaultengine.PluginModule + "@" + vaultengine.PluginVersion(),
		Driven:   "in process: the plugin's logical.Factory and backend.HandleRequest with logical.InmemStorage, no Vault server (a lower bound for one)",
		Identity: "ServiceAccount vault/vault bound to a ClusterRole of the plugin's integration-test rules plus bind on roles (vaultengine.GrantRules), by a bound token",
		AsShipped: "the client the plugin builds itself: client-go's defaults QPS 5, burst 10, per API group (core and rbac each), JSON; " +
			fmt.Sprintf("%d requests per row (-vault-shipped-n), after 10 that empty the limiter's bucket; ", v.shippedN) +
			"where the concurrency is near the row's requests the queue behind the limiter is still filling, so p50 there is below the steady c÷5 s",
		Lifted:            fmt.Sprintf("QPS %d, burst %d (the broker's --kube-qps/--kube-burst); how: %s", brokerKubeQPS, brokerKubeBurst, vaultengine.LiftedLimiter),
		AsShippedRequests: v.shippedN,
	}
	byConc := map[int]map[string]result{}
	var concs []int
	for _, r := range rs {
		if byConc[r.Concurrency] == nil {
			byConc[r.Concurrency] = map[string]result{}
			concs = append(concs, r.Concurrency)
		}
		byConc[r.Concurrency][r.Name] = r
	}
	for _, c := range concs {
		m := byConc[c]
		b, ok := m[caseBroker]
		if !ok {
			continue
		}
		for _, row := range v.rows {
			if r, ok := m[row.name]; ok && r.P50ms > 0 && r.PerSecond > 0 {
				rep.Ratios = append(rep.Ratios, vaultRatio{Concurrency: c, Vault: row.name, P50: b.P50ms / r.P50ms, PerSecond: b.PerSecond / r.PerSecond})
			}
		}
	}

	brokerIssue := func(ctx context.Context) (string, func(context.Context) error, error) {
		var kr apiv1.KubeconfigResponse
		if err := br.postKubeconfig(ctx, body, http.StatusCreated, &kr); err != nil {
			return "", nil, err
		}
		return kr.Token, func(ctx context.Context) error {
			req, _ := http.NewRequestWithContext(ctx, http.MethodDelete, br.url+"/v1/leases/"+kr.LeaseID, nil)
			return brokerDo(br, req, http.StatusNoContent, nil)
		}, nil
	}
	engineIssue := func(e *vaultengine.Engine) func(context.Context) (string, func(context.Context) error, error) {
		return func(ctx context.Context) (string, func(context.Context) error, error) {
			cred, err := e.Issue(ctx)
			if err != nil {
				return "", nil, err
			}
			return cred.Token, func(ctx context.Context) error { return e.Revoke(ctx, cred) }, nil
		}
	}
	sides := []struct {
		name  string
		issue func(context.Context) (string, func(context.Context) error, error)
		note  string
	}{
		{"broker DELETE /v1/leases/{id}", brokerIssue, "deletes the lease Secret the token is bound to"},
		{"Vault SA+RoleBinding, lease revoke", engineIssue(v.revocable), "the engine deletes the RoleBinding and the ServiceAccount"},
		{"Vault existing SA, lease revoke", engineIssue(v.unrevocable),
			"never refused until the token expires (10m): the revoke deletes nothing and a TokenRequest token of an existing ServiceAccount cannot be revoked alone"},
	}
	results := make([][]sample, len(sides))
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	for i, s := range sides {
		results[i] = make([]sample, v.samples)
		for j := range v.samples {
			wg.Add(1)
			go func() {
				defer wg.Done()
				sm, err := v.revokeToRefusal(ctx, s.issue)
				if err != nil {
					mu.Lock()
					firstErr = cmpErr(firstErr, fmt.Errorf("%s: %w", s.name, err))
					mu.Unlock()
				}
				results[i][j] = sm
			}()
		}
	}
	wg.Wait()
	if firstErr != nil {
		return nil, fmt.Errorf("revoke to refusal: %w", firstErr)
	}
	for i, s := range sides {
		rf := refusal{Side: s.name, PatienceMs: ms(refusalPatience)}
		var calls []float64
		never := 0
		for _, sm := range results[i] {
			calls = append(calls, ms(sm.call))
			if sm.refused {
				rf.SamplesMs = append(rf.SamplesMs, ms(sm.total))
			} else {
				never++
			}
		}
		rf.RevokeCallMs = median(calls)
		switch {
		case never == 0 && len(rf.SamplesMs) > 0:
			m := median(rf.SamplesMs)
			rf.MedianMs = &m
			rf.Note = s.note
		case never == len(results[i]):
			rf.Note = fmt.Sprintf("still accepted %s after every revoke: %s", refusalPatience, s.note)
		default:
			rf.Note = fmt.Sprintf("%d of %d still accepted %s after revoke; %s", never, len(results[i]), refusalPatience, s.note)
		}
		rep.RevokeToRefusal = append(rep.RevokeToRefusal, rf)
	}
	return rep, nil
}

type sample struct {
	call, total time.Duration
	refused     bool
}

// revokeToRefusal issues a token, uses it once, revokes it and probes it
// until it is refused or refusalPatience has passed.
func (v *vaultBench) revokeToRefusal(ctx context.Context, issue func(context.Context) (string, func(context.Context) error, error)) (sample, error) {
	token, revoke, err := issue(ctx)
	if err != nil {
		return sample{}, fmt.Errorf("issue: %w", err)
	}
	probe, err := vaultengine.NewProbe(v.host, v.caData, token)
	if err != nil {
		return sample{}, err
	}
	if ok, err := probe.Accepted(ctx); err != nil || !ok {
		return sample{}, fmt.Errorf("a fresh token is not accepted (%v)", err)
	}
	start := time.Now()
	if err := revoke(ctx); err != nil {
		return sample{}, fmt.Errorf("revoke: %w", err)
	}
	call := time.Since(start)
	pctx, cancel := context.WithTimeout(ctx, refusalPatience)
	defer cancel()
	d, refused, err := probe.WaitRefused(pctx, start, 100*time.Millisecond)
	if err != nil {
		return sample{}, err
	}
	return sample{call: call, total: d, refused: refused}, nil
}

// brokerDo sends req with the broker's mTLS client, wants status and
// decodes the answer into out when it is not nil.
// postKubeconfig sends body to the broker's POST /v1/kubeconfigs, with a
// workload token if bearer names one, and wants status; out, if not nil,
// gets the decoded answer.
func (b *brokerProcess) postKubeconfig(ctx context.Context, body []byte, status int, out any, bearer ...string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, b.url+"/v1/kubeconfigs", bytes.NewReader(body))
	req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
	for _, t := range bearer {
		req.Header.Set("Authorization", "Bearer "+t)
	}
	return brokerDo(b, req, status, out)
}

func brokerDo(br *brokerProcess, req *http.Request, status int, out any) error {
	resp, err := br.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != status {
		_, _ = io.Copy(io.Discard, resp.Body)
		return fmt.Errorf("%s %s: status %d, want %d", req.Method, req.URL.Path, resp.StatusCode, status)
	}
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// print writes the Vault side by side: how it was driven, the ratios per
// concurrency and revoke to refusal.
func (r *vaultReport) print() {
	if r == nil {
		return
	}
	fmt.Println()
	fmt.Printf("Vault: %s, driven %s\n", r.Plugin, r.Driven)
	fmt.Printf("  identity: %s\n", r.Identity)
	fmt.Printf("  as shipped: %s\n", r.AsShipped)
	fmt.Printf("  limiter lifted: %s\n", r.Lifted)
	if len(r.Ratios) > 0 {
		var names []string
		var concs []int
		seenName, seenConc := map[string]bool{}, map[int]bool{}
		byCase := map[string]map[int]vaultRatio{}
		for _, x := range r.Ratios {
			if !seenName[x.Vault] {
				seenName[x.Vault] = true
				names = append(names, x.Vault)
				byCase[x.Vault] = map[int]vaultRatio{}
			}
			if !seenConc[x.Concurrency] {
				seenConc[x.Concurrency] = true
				concs = append(concs, x.Concurrency)
			}
			byCase[x.Vault][x.Concurrency] = x
		}
		fmt.Println("\nbroker ÷ Vault, p50 ratio · throughput ratio (p50 below 1 and throughput above 1: the broker is ahead)")
		fmt.Printf("%-38s", "Vault case")
		for _, c := range concs {
			fmt.Printf(" %16s", fmt.Sprintf("c=%d", c))
		}
		fmt.Println()
		for _, n := range names {
			fmt.Printf("%-38s", n)
			for _, c := range concs {
				x := byCase[n][c]
				fmt.Printf(" %16s", fmt.Sprintf("%.2f · %.2f", x.P50, x.PerSecond))
			}
			fmt.Println()
		}
	}
	if len(r.RevokeToRefusal) > 0 {
		fmt.Println("\nrevoke to refusal (revoke call start → first 401 on a SelfSubjectReview with the token, polled every 100 ms):")
		for _, f := range r.RevokeToRefusal {
			got := "never within " + fmt.Sprintf("%.0f s", f.PatienceMs/1000)
			if f.MedianMs != nil {
				parts := make([]string, len(f.SamplesMs))
				for i, s := range f.SamplesMs {
					parts[i] = fmt.Sprintf("%.0f", s)
				}
				got = fmt.Sprintf("median %.0f ms (samples %s ms)", *f.MedianMs, strings.Join(parts, ", "))
			}
			fmt.Printf("  %-36s %s; revoke call %.1f ms — %s\n", f.Side, got, f.RevokeCallMs, f.Note)
		}
	}
}
