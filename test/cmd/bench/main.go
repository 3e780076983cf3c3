// Command bench measures what the broker adds on top of the API server. It
// starts a harness cluster on 127.0.0.1, then, in one run, times
//
//   - direct TokenRequest calls with client-go (the floor),
//   - the pair of calls the broker makes — create a lease Secret, then a
//     TokenRequest bound to it — made directly, and
//   - POST /v1/kubeconfigs through the broker over mutual TLS with a
//     kept-alive client,
//   - the same for a client certificate (RoleBinding, CSR, approval and
//     kube-controller-manager's signer), and
//   - HashiCorp Vault's Kubernetes secrets engine driven in process, in
//     its unrevocable and revocable modes, as shipped and with its
//     client-side limiter lifted (vault.go),
//
// at each concurrency, and prints latency percentiles, throughput and the
// ratios broker ÷ direct pair, broker ÷ direct TokenRequest and client
// certificate ÷ token through the broker.
//
// The direct calls use a client configured like the broker's own (see
// directClient): the same kubeconfig, client-side limit, content type and
// transport, so that a ratio measures what the broker adds, not a slower
// client on the other side. The pair's throughput at each concurrency is
// the API server's own ceiling for that work ("API server saturation"),
// against which the broker's throughput is read.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type result struct {
	Name        string  `json:"name"`
	Concurrency int     `json:"concurrency"`
	Requests    int     `json:"requests"`
	Errors      int64   `json:"errors"`
	P50ms       float64 `json:"p50_ms"`
	P90ms       float64 `json:"p90_ms"`
	P99ms       float64 `json:"p99_ms"`
	PerSecond   float64 `json:"per_second"`
	// PoolFraction is, for the broker's token row, the fraction of its
	// issuances that claimed a pooled Secret (the rest were sequential).
	PoolFraction *float64 `json:"pool_fraction,omitempty"`
	// APICalls is what each request of the row cost the API server
	// (apicalls.go); absent for Vault's rows.
	APICalls *apiCallsPerOp `json:"api_calls_per_op,omitempty"`
	// OwnMillis is, for a broker row, the percentiles of the issuing
	// broker's own time per issuance over that row's requests alone
	// (tokenbroker_issuance_own_seconds read before and after it).
	OwnMillis map[string]float64 `json:"own_ms,omitempty"`
}

func run() error {
	n := flag.Int("n", 300, "requests per measurement")
	cpuProfile := flag.String("cpuprofile", "", "write a 5 s CPU profile of the broker, taken under the first broker load at concurrency 8 or more, to this file")
	gatewayProfile := flag.String("gateway-cpuprofile", "", "write a 5 s CPU profile of the broker, taken while GETs go through its lease gateway at concurrency 32 (after the gateway's GET rows), to this file")
	apiProfile := flag.String("apiserver-cpuprofile", "", "write 5 s CPU profiles of the kube-apiserver, taken under the first direct pair and broker loads at concurrency 8 or more, to this file with the suffixes .pair and .broker")
	binDir := flag.String("bin-dir", "", "directory holding the tokenbroker binary (default $TOKENBROKER_BIN_DIR, else bin/ at the repository root)")
	concs := flag.String("c", "1,8,32", "comma-separated concurrency levels")
	out := flag.String("out", "", "also write the results as JSON to this file")
	tenantNamespaces := flag.Int("namespaces", 5000, "namespaces a selector grant matches in the tenant measurement (0 skips it)")
	scale := flag.String("scale", "", "instead of the comparison: fill the cluster to each of these comma-separated numbers of live leases and measure at each (make bench-scale); -out then gets the key \"scale\" only")
	heapProfile := flag.String("heapprofile", "", "with -scale: write the broker's heap profile at the largest level (after a forced Go GC) to this file")
	gcInterval := flag.Duration("gc-interval", 30*time.Second, "with -scale: the broker's --gc-interval; a level's measurements run between two GC passes, so it must exceed them")
	vaultOpts := vaultFlags()
	fsync := flag.Bool("etcd-fsync", false, "run the harness's etcd with fsync on every write, as a production etcd (default off: writes cost CPU only)")
	agentTargets := flag.Int("agent-targets", 0, "instead of the comparison: measure one agent with this many targets and write its figures under \"agent\" in -out, keeping the file's other keys (make bench-agent)")
	agentBrokers := flag.Int("agent-brokers", 4, "broker processes serving the agent's targets (with -agent-targets)")
	agentEnv := flag.String("agent-env", "", "comma-separated NAME=VALUE added to the agent's environment, e.g. GOGC=50 (with -agent-targets)")
	gatewayOnly := flag.Bool("gateway-only", false, "measure the lease gateway's rows only (with the bare TokenRequest at c=1 they are compared with); -out then gets the key \"gateway\" only")
	flag.Parse()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	if *agentTargets > 0 {
		return runAgentBench(ctx, *binDir, *agentTargets, *agentBrokers, splitList(*agentEnv), *out)
	}
	// kube-controller-manager signs the client certificates.
	opts := []testcluster.Option{testcluster.WithControllerManager()}
	if *fsync {
		opts = append(opts, testcluster.WithEtcdFsync())
	}
	if *apiProfile != "" {
		opts = append(opts, testcluster.WithProfiling())
	}
	c, err := testcluster.Run(ctx, opts...)
	if err != nil {
		return err
	}
	defer c.Stop()
	if err := setUp(ctx, c.Client); err != nil {
		return err
	}
	if err := setUpGateway(ctx, c.Client); err != nil {
		return err
	}
	pprof, extraArgs := *cpuProfile != "" || *gatewayProfile != "", []string(nil)
	if *scale != "" {
		// The scale run forces the broker's garbage collection through
		// pprof before reading its heap, and times its GC passes.
		pprof, extraArgs = true, []string{"--gc-interval=" + gcInterval.String()}
	}
	br, err := startBroker(ctx, c, *binDir, pprof, extraArgs...)
	if err != nil {
		return err
	}
	defer br.stop()
	if *scale != "" {
		return runScale(ctx, br, scaleOptions{levels: *scale, n: *n, out: *out, kubeconfig: c.KubeconfigPath, gcInterval: *gcInterval, heapProfile: *heapProfile})
	}
	if *gatewayOnly {
		direct, err := directClient(c.KubeconfigPath)
		if err != nil {
			return err
		}
		seconds := int64(600)
		tr := func(ctx context.Context) error {
			_, err := direct.CoreV1().ServiceAccounts("bench").CreateToken(ctx, "runner",
				&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &seconds}}, metav1.CreateOptions{})
			return err
		}
		_ = measure(ctx, tr, 1, 20)
		g, err := measureGateway(ctx, c, br, direct, *n, measure(ctx, tr, 1, *n), *gatewayProfile)
		if err != nil {
			return fmt.Errorf("gateway: %w", err)
		}
		g.print()
		if *out != "" {
			return writeResultsKey(*out, "gateway", g)
		}
		return nil
	}
	// The same broker without its lease pool: the sequential pair it
	// replaces, measured in the same run.
	seq, err := startBroker(ctx, c, *binDir, false, "--lease-pool=0")
	if err != nil {
		return err
	}
	defer seq.stop()
	// The baseline of the issuance rows: the pair's two calls behind the
	// broker's mutual TLS, and nothing else (test/cmd/bareissuer).
	bare, err := startBareIssuer(ctx, c, br)
	if err != nil {
		return err
	}
	defer bare.stop()
	bareClient := &brokerProcess{url: bare.url, client: br.client}
	time.Sleep(time.Second)
	report := &report{ReadyMillis: float64(br.ready.Microseconds()) / 1000, IdleRSSMB: rssMB(br.cmd.Process.Pid), DirectClient: directClientDescription()}

	body, _ := json.Marshal(apiv1.KubeconfigRequest{Namespace: "bench", ServiceAccount: "runner", TTL: "10m"})
	certBody, _ := json.Marshal(apiv1.KubeconfigRequest{Namespace: "bench", Credential: apiv1.CredentialClientCertificate, TTL: "10m"})
	// A workload token of bench/runner for the workload row: the bench
	// cluster is its own peer, and the policy pins its key set.
	wlSeconds := int64(3600)
	wl, err := c.Client.CoreV1().ServiceAccounts("bench").CreateToken(ctx, "runner",
		&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{Audiences: []string{benchAudience}, ExpirationSeconds: &wlSeconds}}, metav1.CreateOptions{})
	if err != nil {
		return err
	}
	workloadToken := wl.Status.Token
	direct, err := directClient(c.KubeconfigPath)
	if err != nil {
		return err
	}
	vault, err := newVaultBench(ctx, c, vaultOpts)
	if err != nil {
		return err
	}
	postTo := func(ctx context.Context, br *brokerProcess, body []byte, bearer ...string) error {
		return br.postKubeconfig(ctx, body, http.StatusCreated, nil, bearer...)
	}
	post := func(ctx context.Context, body []byte, bearer ...string) error {
		return postTo(ctx, br, body, bearer...)
	}
	seconds := int64(600)
	cases := []struct {
		name string
		op   func(context.Context) error
	}{
		{caseTokenRequest, func(ctx context.Context) error {
			_, err := direct.CoreV1().ServiceAccounts("bench").CreateToken(ctx, "runner",
				&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &seconds}}, metav1.CreateOptions{})
			return err
		}},
		{casePair, func(ctx context.Context) error {
			s, err := direct.CoreV1().Secrets("bench").Create(ctx, &corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{GenerateName: "pair-", Labels: map[string]string{"bench": "pair"}},
			}, metav1.CreateOptions{})
			if err != nil {
				return err
			}
			_, err = direct.CoreV1().ServiceAccounts("bench").CreateToken(ctx, "runner", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
				ExpirationSeconds: &seconds,
				BoundObjectRef:    &authnv1.BoundObjectReference{Kind: "Secret", APIVersion: "v1", Name: s.Name, UID: s.UID},
			}}, metav1.CreateOptions{})
			return err
		}},
		{caseBareIssuer, func(ctx context.Context) error { return postTo(ctx, bareClient, body) }},
		{caseBroker, func(ctx context.Context) error { return post(ctx, body) }},
		{caseBrokerSequential, func(ctx context.Context) error { return postTo(ctx, seq, body) }},
		{caseBrokerCert, func(ctx context.Context) error { return post(ctx, certBody) }},
		{caseBrokerWorkload, func(ctx context.Context) error { return post(ctx, body, workloadToken) }},
	}

	pids := map[string]int{"kube-apiserver": c.APIServerPID(), "broker": br.cmd.Process.Pid, "broker, pool off": seq.cmd.Process.Pid,
		"bare issuer": bare.cmd.Process.Pid}
	// row measures run as a row of the case name: with what each request
	// cost the API server, and for the broker's token case its pooled
	// share.
	row := func(name string, run func() result) result {
		var pooled *float64
		var own map[string]float64
		r, calls := countAPICalls(ctx, direct, pids, func() result {
			if name != caseBroker {
				return ownTimeOf(ctx, name, br.opsURL, seq.opsURL, &own, run)
			}
			r, f := pooledFraction(ctx, br.opsURL, func() result { return ownTimeOf(ctx, name, br.opsURL, seq.opsURL, &own, run) })
			pooled = &f
			return r
		})
		r.PoolFraction, r.APICalls, r.OwnMillis = pooled, calls, own
		return r
	}
	var results []result
	apiProfiled := map[string]bool{}
	peak := watchRSS(ctx, br.cmd.Process.Pid)
	for _, cs := range strings.Split(*concs, ",") {
		conc, err := strconv.Atoi(strings.TrimSpace(cs))
		if err != nil || conc < 1 {
			return fmt.Errorf("bad concurrency %q", cs)
		}
		for _, tc := range cases {
			_ = measure(ctx, tc.op, conc, 20) // warm up connections and caches
			var profiled []chan error
			if *cpuProfile != "" && conc >= 8 && strings.HasPrefix(tc.name, "broker") {
				done := make(chan error, 1)
				file := *cpuProfile
				*cpuProfile = "" // one profile
				go func() { done <- fetchProfile(ctx, br.opsURL, file) }()
				profiled = append(profiled, done)
			}
			if *apiProfile != "" && conc >= 8 && (tc.name == casePair || tc.name == caseBroker) && !apiProfiled[tc.name] {
				apiProfiled[tc.name] = true // one profile of each
				suffix := ".pair"
				if tc.name == caseBroker {
					suffix = ".broker"
				}
				done := make(chan error, 1)
				go func() { done <- fetchAPIServerProfile(ctx, c.Client, *apiProfile+suffix) }()
				profiled = append(profiled, done)
			}
			r := row(tc.name, func() result { return measure(ctx, tc.op, conc, *n) })
			for _, done := range profiled {
				if err := <-done; err != nil {
					fmt.Fprintln(os.Stderr, "bench: CPU profile:", err)
				}
			}
			r.Name = tc.name
			results = append(results, r)
		}
		results = append(results, vault.measureRound(ctx, conc, *n)...)
	}
	// Paced: the pool's case, one request now and then.
	for _, tc := range cases {
		switch tc.name {
		case caseTokenRequest, casePair, caseBareIssuer, caseBroker, caseBrokerSequential:
		default:
			continue
		}
		pacedN := min(*n, 300)
		r := row(tc.name, func() result { return measurePaced(ctx, tc.op, pacedN, pacedEvery) })
		r.Name = pacedPrefix + tc.name
		results = append(results, r)
	}
	report.LoadRSSMB = peak()
	if *tenantNamespaces > 0 {
		t, err := measureTenants(ctx, c.Client, br, *tenantNamespaces, *n)
		if err != nil {
			return fmt.Errorf("tenant measurement: %w", err)
		}
		report.Tenants = t
	}
	report.Results = results
	report.Saturation = saturationOf(results)
	if report.Vault, err = vault.report(ctx, results, br, body); err != nil {
		return fmt.Errorf("vault: %w", err)
	}
	var trC1 result
	for _, r := range results {
		if r.Name == caseTokenRequest && r.Concurrency == 1 {
			trC1 = r
		}
	}
	if report.Gateway, err = measureGateway(ctx, c, br, direct, *n, trC1, *gatewayProfile); err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	report.OwnMillis, err = ownTime(ctx, br.opsURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench: broker own time:", err)
	}
	report.print()
	if *out != "" {
		if *fsync {
			// A second view of the same rows, beside the main one.
			return writeResultsKey(*out, "etcd_fsync", struct {
				Results    []result     `json:"results"`
				Saturation []saturation `json:"apiserver_saturation"`
			}{report.Results, report.Saturation})
		}
		// Its own keys only: make bench-scale's "scale" and others stay.
		return writeResultsKeys(*out, report)
	}
	return nil
}

// The cases that printResults finds by name.
const (
	caseTokenRequest = "direct TokenRequest"
	casePair         = "direct Secret + bound TokenRequest"
	// caseBareIssuer is the pair's calls made by test/cmd/bareissuer
	// behind the broker's mutual TLS: a service hop and nothing else.
	caseBareIssuer = "bare issuer: mTLS + the pair"
	caseBroker     = "broker POST /v1/kubeconfigs (mTLS)"
	// caseBrokerSequential is caseBroker on a broker without its lease
	// pool (--lease-pool=0): Secret, then TokenRequest.
	caseBrokerSequential = "broker, pool off (--lease-pool=0)"
	caseBrokerCert       = "broker client certificate (mTLS)"
	// caseBrokerWorkload is caseBroker with a workload token to verify.
	caseBrokerWorkload = "broker + workload token (mTLS)"
	benchAudience      = "tokenbroker.bench"
)

// brokerKubeQPS and brokerKubeBurst are serve's defaults for --kube-qps and
// --kube-burst (cmd/tokenbroker/serve.go). bench passes them to the broker
// and gives them to the direct client.
const (
	brokerKubeQPS   = 2000
	brokerKubeBurst = 4000
)

// directClientDescription is what the report says about the direct client.
func directClientDescription() string {
	return fmt.Sprintf("like the broker's: the same kubeconfig loaded with kubectl's rules, QPS %d, burst %d, "+
		"protobuf (application/vnd.kubernetes.protobuf), no gzip, client-go's default transport (HTTP/2, one connection to the API server)",
		brokerKubeQPS, brokerKubeBurst)
}

// directClient is the client of the direct rows, built as the broker builds
// its own (server.TuneKubeClient, which serve's kubeRESTConfig calls, from the kubeconfig serve gets
// with --kube-qps/--kube-burst at their defaults): the client-side limit
// lifted the same way, protobuf, which costs both ends less CPU than
// JSON, and no gzip. It shares no rate limiter with the harness's admin client.
func directClient(kubeconfig string) (kubernetes.Interface, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("load the direct client's kubeconfig: %w", err)
	}
	rc = rest.CopyConfig(rc)
	server.TuneKubeClient(rc, brokerKubeQPS, brokerKubeBurst)
	rc.UserAgent = "tokenbroker-bench/direct"
	return kubernetes.NewForConfig(rc)
}

func measure(ctx context.Context, op func(context.Context) error, conc, n int) result {
	lat := make([]time.Duration, n)
	var next, errs atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				t0 := time.Now()
				if err := op(ctx); err != nil {
					errs.Add(1)
				}
				lat[i] = time.Since(t0)
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) float64 {
		return float64(lat[int(p*float64(n-1))].Microseconds()) / 1000
	}
	return result{Concurrency: conc, Requests: n, Errors: errs.Load(),
		P50ms: pct(.50), P90ms: pct(.90), P99ms: pct(.99), PerSecond: float64(n) / elapsed.Seconds()}
}

// report is what bench prints and writes as JSON.
type report struct {
	Results []result `json:"results"`
	// ReadyMillis is the time from starting the broker process to its
	// first /readyz 200.
	ReadyMillis float64 `json:"ready_ms"`
	IdleRSSMB   float64 `json:"idle_rss_mb"`
	LoadRSSMB   float64 `json:"load_rss_mb"`
	// OwnMillis are percentiles of the broker's own time per issuance
	// (not spent waiting on the API server), from its histogram.
	OwnMillis map[string]float64 `json:"own_ms,omitempty"`
	// Tenants compares a grant by namespaceSelector with few and with
	// many matching namespaces.
	Tenants *tenantReport `json:"tenants,omitempty"`
	// DirectClient says how the direct rows' client is configured.
	DirectClient string `json:"direct_client"`
	// Saturation is the direct pair's throughput at each concurrency:
	// what the API server itself sustains for the work of an issuance.
	Saturation []saturation `json:"apiserver_saturation"`
	// Vault is Vault's Kubernetes secrets engine side by side (vault.go).
	Vault *vaultReport `json:"vault,omitempty"`
	// Gateway is the lease gateway against direct access (gateway.go).
	Gateway *gatewayReport `json:"gateway,omitempty"`
}

// saturation is the direct pair's throughput at one concurrency and the
// broker's as a fraction of it.
type saturation struct {
	Concurrency     int     `json:"concurrency"`
	PairPerSecond   float64 `json:"pair_per_second"`
	BrokerPerSecond float64 `json:"broker_per_second"`
	BrokerFraction  float64 `json:"broker_fraction"`
	// Sequential* are the broker without its lease pool.
	SequentialPerSecond float64 `json:"sequential_per_second"`
	SequentialFraction  float64 `json:"sequential_fraction"`
	// Bare* are the bare issuer: BareFraction its throughput over the
	// pair's, BrokerOverBare the broker's over its.
	BarePerSecond  float64 `json:"bare_issuer_per_second"`
	BareFraction   float64 `json:"bare_issuer_fraction"`
	BrokerOverBare float64 `json:"broker_over_bare_issuer"`
}

// saturationOf picks the pair's and the broker's throughput per
// concurrency out of rs.
func saturationOf(rs []result) []saturation {
	var out []saturation
	idx := map[int]int{}
	for _, r := range rs {
		if r.Name != casePair && r.Name != caseBroker && r.Name != caseBrokerSequential && r.Name != caseBareIssuer {
			continue
		}
		i, ok := idx[r.Concurrency]
		if !ok {
			i = len(out)
			idx[r.Concurrency] = i
			out = append(out, saturation{Concurrency: r.Concurrency})
		}
		switch r.Name {
		case casePair:
			out[i].PairPerSecond = r.PerSecond
		case caseBroker:
			out[i].BrokerPerSecond = r.PerSecond
		case caseBareIssuer:
			out[i].BarePerSecond = r.PerSecond
		default:
			out[i].SequentialPerSecond = r.PerSecond
		}
	}
	for i := range out {
		if out[i].PairPerSecond > 0 {
			out[i].BrokerFraction = out[i].BrokerPerSecond / out[i].PairPerSecond
			out[i].SequentialFraction = out[i].SequentialPerSecond / out[i].PairPerSecond
			out[i].BareFraction = out[i].BarePerSecond / out[i].PairPerSecond
		}
		if out[i].BarePerSecond > 0 {
			out[i].BrokerOverBare = out[i].BrokerPerSecond / out[i].BarePerSecond
		}
	}
	return out
}

func (r *report) print() {
	fmt.Printf("direct client: %s\n\n", r.DirectClient)
	printResults(r.Results)
	fmt.Println()
	printAPICalls(r.Results)
	printOwnTimes(r.Results)
	if len(r.Saturation) > 0 {
		var parts []string
		ceiling := 0.0
		for _, s := range r.Saturation {
			parts = append(parts, fmt.Sprintf("c=%d %.0f/s", s.Concurrency, s.PairPerSecond))
			ceiling = max(ceiling, s.PairPerSecond)
		}
		fmt.Printf("API server saturation (direct pair, the broker's work without the broker): %s; ceiling %.0f/s\n",
			strings.Join(parts, ", "), ceiling)
		parts = parts[:0]
		for _, s := range r.Saturation {
			parts = append(parts, fmt.Sprintf("c=%d %.2f (pool off %.2f)", s.Concurrency, s.BrokerFraction, s.SequentialFraction))
		}
		fmt.Printf("broker throughput ÷ pair throughput: %s\n", strings.Join(parts, ", "))
		parts = parts[:0]
		for _, s := range r.Saturation {
			parts = append(parts, fmt.Sprintf("c=%d %.2f (broker ÷ it %.2f)", s.Concurrency, s.BareFraction, s.BrokerOverBare))
		}
		fmt.Printf("bare issuer throughput ÷ pair throughput: %s\n\n", strings.Join(parts, ", "))
	}
	fmt.Printf("broker ready after start: %.0f ms; RSS idle %.1f MB, under load (peak) %.1f MB\n", r.ReadyMillis, r.IdleRSSMB, r.LoadRSSMB)
	if len(r.OwnMillis) > 0 {
		fmt.Printf("broker own time per issuance (histogram estimate): p50 %.3f ms, p90 %.3f ms, p99 %.3f ms\n",
			r.OwnMillis["p50"], r.OwnMillis["p90"], r.OwnMillis["p99"])
	}
	if t := r.Tenants; t != nil {
		fmt.Println()
		fmt.Printf("selector grant, %d matching namespaces vs %d:\n", t.Namespaces, t.FewNamespaces)
		fmt.Printf("  decision (refused, no API call) p50 %.3f ms vs %.3f ms: ratio %.2f\n", t.ManyDecisionP50ms, t.FewDecisionP50ms, t.ManyDecisionP50ms/t.FewDecisionP50ms)
		fmt.Printf("  issuance p50 %.2f ms vs %.2f ms: ratio %.2f\n", t.ManyIssueP50ms, t.FewIssueP50ms, t.ManyIssueP50ms/t.FewIssueP50ms)
		fmt.Printf("  broker RSS %.1f MB before the namespaces, %.1f MB with them (+%.1f MB); cache synced %.1f s after the last create\n",
			t.RSSBeforeMB, t.RSSAfterMB, t.RSSAfterMB-t.RSSBeforeMB, t.SyncSeconds)
	}
	r.Vault.print()
	if r.Gateway != nil {
		r.Gateway.print()
	}
}

func printResults(rs []result) {
	fmt.Printf("%-38s %5s %6s %9s %9s %9s %9s %6s\n", "case", "conc", "n", "p50 ms", "p90 ms", "p99 ms", "req/s", "errors")
	for _, r := range rs {
		fmt.Printf("%-38s %5d %6d %9.2f %9.2f %9.2f %9.0f %6d\n", r.Name, r.Concurrency, r.Requests, r.P50ms, r.P90ms, r.P99ms, r.PerSecond, r.Errors)
	}
	fmt.Println()
	p50 := map[int]map[string]float64{}
	var concs []int
	for _, r := range rs {
		if p50[r.Concurrency] == nil {
			p50[r.Concurrency] = map[string]float64{}
			concs = append(concs, r.Concurrency)
		}
		p50[r.Concurrency][r.Name] = r.P50ms
	}
	pooled := map[int]float64{}
	for _, r := range rs {
		if r.PoolFraction != nil && r.Name == caseBroker {
			pooled[r.Concurrency] = *r.PoolFraction
		}
	}
	fmt.Printf("%-6s %16s %16s %16s %24s %14s %16s %22s %28s\n", "conc", "broker/pair p50", "bare/pair p50", "broker/bare p50",
		"broker/TokenRequest p50", "pooled share", "pool off/pair", "certificate/token p50", "workload token added p50 ms")
	for _, c := range concs {
		m := p50[c]
		fmt.Printf("%-6d %16.2f %16.2f %16.2f %24.2f %14.2f %16.2f %22.2f %28.2f\n", c, m[caseBroker]/m[casePair],
			m[caseBareIssuer]/m[casePair], m[caseBroker]/m[caseBareIssuer], m[caseBroker]/m[caseTokenRequest],
			pooled[c], m[caseBrokerSequential]/m[casePair], m[caseBrokerCert]/m[caseBroker], m[caseBrokerWorkload]-m[caseBroker])
	}
	if m := p50[1]; m[pacedPrefix+caseBroker] > 0 {
		var share float64
		for _, r := range rs {
			if r.Name == pacedPrefix+caseBroker && r.PoolFraction != nil {
				share = *r.PoolFraction
			}
		}
		fmt.Printf("\npaced, one request every %s: broker/TokenRequest p50 %.2f (pool off %.2f), broker/pair p50 %.2f (pool off %.2f), bare issuer/pair p50 %.2f, pooled share %.2f\n",
			pacedEvery, m[pacedPrefix+caseBroker]/m[pacedPrefix+caseTokenRequest], m[pacedPrefix+caseBrokerSequential]/m[pacedPrefix+caseTokenRequest],
			m[pacedPrefix+caseBroker]/m[pacedPrefix+casePair], m[pacedPrefix+caseBrokerSequential]/m[pacedPrefix+casePair],
			m[pacedPrefix+caseBareIssuer]/m[pacedPrefix+casePair], share)
	}
}

func setUp(ctx context.Context, c kubernetes.Interface) error {
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench", Labels: map[string]string{tenantLabel: "bench"}}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	for _, sa := range []string{"runner", "tenant-runner"} {
		if _, err := c.CoreV1().ServiceAccounts("bench").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	// The namespace of the tenant measurement's refused requests: it
	// exists, without the tenant label.
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench-plain"}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	// The Role the client certificates are bound to.
	_, err := c.RbacV1().Roles("bench").Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "bench-view"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list"}}},
	}, metav1.CreateOptions{})
	return err
}

// brokerProcess is "tokenbroker serve" started by bench.
type brokerProcess struct {
	cmd    *exec.Cmd
	url    string
	opsURL string
	client *http.Client
	ready  time.Duration
	dir    string
	// bin is the tokenbroker binary, for running its commands too.
	bin string
}

func (b *brokerProcess) stop() {
	_ = b.cmd.Process.Signal(syscall.SIGTERM)
	_ = b.cmd.Wait()
	os.RemoveAll(b.dir)
}

// startBroker writes a PKI and a policy, starts the broker binary as its
// own process (so that its memory and start time are its own) and returns
// it with a kept-alive mTLS client using the production TLS profile.
// extraArgs are added to its serve command line.
func startBroker(ctx context.Context, c *testcluster.Cluster, binDir string, pprof bool, extraArgs ...string) (*brokerProcess, error) {
	bin, err := tokenbrokerBinary(binDir)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "bench-")
	if err != nil {
		return nil, err
	}
	b := &brokerProcess{dir: dir, bin: bin}
	fail := func(err error) (*brokerProcess, error) {
		if b.cmd != nil && b.cmd.Process != nil {
			_ = b.cmd.Process.Kill()
			_ = b.cmd.Wait()
		}
		os.RemoveAll(dir)
		return nil, err
	}
	f := func(n string) string { return filepath.Join(dir, n) }
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "bench CA"})
	if err != nil {
		return fail(err)
	}
	if err := ca.WriteFiles(f("ca.crt"), f("ca.key")); err != nil {
		return fail(err)
	}
	srvKP, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		return fail(err)
	}
	id, _ := pki.ClusterIdentity("bench.example", "west")
	cliKP, err := ca.IssueClient(pki.ClientOptions{Identity: id})
	if err != nil {
		return fail(err)
	}
	if err := srvKP.WriteFiles(f("server.crt"), f("server.key")); err != nil {
		return fail(err)
	}
	if err := cliKP.WriteFiles(f("west.crt"), f("west.key")); err != nil {
		return fail(err)
	}
	if err := os.WriteFile(f("cluster-ca.crt"), c.CAData, 0o644); err != nil {
		return fail(err)
	}
	jwks, err := c.Client.Discovery().RESTClient().Get().AbsPath("/openid/v1/jwks").DoRaw(ctx)
	if err != nil {
		return fail(err)
	}
	if err := os.WriteFile(f("jwks.json"), jwks, 0o644); err != nil {
		return fail(err)
	}
	// The limits out of the way: the bench measures issuance, and makes
	// more leases than the defaults allow a peer.
	pol := fmt.Sprintf(`cluster: {name: bench, server: %q, caFile: cluster-ca.crt}
limits: {issuancesPerMinute: 1000000, burst: 1000000, maxLiveLeases: 1000000, leaseReadsPerMinute: 1000000, leaseReadsInFlight: 1000000}
peers:
  - name: west
    identity: %s
    workloadIdentity: {issuer: %q, audiences: [%s], jwksFile: jwks.json}
    grants:
      - {namespaces: [bench], serviceAccounts: [runner]}
      - {namespaces: [bench], serviceAccounts: [runner], workloads: [{namespace: bench, serviceAccount: runner}]}
      - {namespaces: [bench], credential: clientCertificate, role: bench-view}
      - {namespaces: [bench], serviceAccounts: [%s], access: gateway}
      - {name: tenant, namespaceSelector: {matchLabels: {%s: bench}}, serviceAccounts: [tenant-runner]}
`, c.URL, id, c.ServiceAccountIssuer, benchAudience, gatewaySA, tenantLabel)
	if err := os.WriteFile(f("policy.yaml"), []byte(pol), 0o644); err != nil {
		return fail(err)
	}
	api, ops, gateway := freeAddr(), freeAddr(), freeAddr()
	b.cmd = exec.Command(bin, "serve", "--listen-address", api, "--ops-address", ops,
		"--ca-cert-file", f("ca.crt"), "--ca-key-file", f("ca.key"), "--gateway-address", gateway, "--gateway-url", "https://"+gateway,
		"--tls-cert-file", f("server.crt"), "--tls-key-file", f("server.key"),
		"--client-ca-file", f("ca.crt"), "--policy-file", f("policy.yaml"),
		"--kubeconfig", c.KubeconfigPath, "--log-level", "warn", fmt.Sprintf("--pprof=%t", pprof),
		"--credentials", apiv1.CredentialToken+","+apiv1.CredentialClientCertificate, "--max-live-leases", "1000000",
		// Stated, not left to the defaults, so that the direct client's
		// limit is the broker's by construction.
		fmt.Sprintf("--kube-qps=%d", brokerKubeQPS), fmt.Sprintf("--kube-burst=%d", brokerKubeBurst))
	b.cmd.Args = append(b.cmd.Args, extraArgs...)
	logFile, err := os.Create(f("broker.log"))
	if err != nil {
		return fail(err)
	}
	defer logFile.Close()
	b.cmd.Stdout, b.cmd.Stderr = logFile, logFile
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	start := time.Now()
	if err := b.cmd.Start(); err != nil {
		return fail(err)
	}
	b.opsURL = "http://" + ops
	for {
		resp, err := http.Get(b.opsURL + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Since(start) > 30*time.Second || ctx.Err() != nil {
			return fail(fmt.Errorf("broker not ready after 30s; log in %s", f("broker.log")))
		}
		time.Sleep(2 * time.Millisecond)
	}
	b.ready = time.Since(start)
	cliCerts, err := pki.NewCertReloader(f("west.crt"), f("west.key"))
	if err != nil {
		return fail(err)
	}
	b.url = "https://" + api
	b.client = &http.Client{Transport: &http.Transport{
		TLSClientConfig:     pki.ClientTLSConfig(ca.CertPool(), cliCerts),
		ForceAttemptHTTP2:   true,
		MaxIdleConnsPerHost: 64,
	}}
	return b, nil
}

func tokenbrokerBinary(dir string) (string, error) {
	if dir == "" {
		dir = os.Getenv(testcluster.BinDirEnv)
	}
	if dir == "" {
		wd, _ := os.Getwd()
		for d := wd; d != filepath.Dir(d); d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "test", "go.mod")); err == nil {
				dir = filepath.Join(d, "bin")
				break
			}
		}
	}
	p := filepath.Join(dir, "tokenbroker")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("%s not found: run make build first", p)
	}
	return p, nil
}

func freeAddr() string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// rssMB reads a process's resident set size from /proc.
func rssMB(pid int) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "VmRSS:") {
			kb, _ := strconv.ParseFloat(strings.Fields(line)[1], 64)
			return kb / 1024
		}
	}
	return 0
}

// watchRSS samples pid's RSS every 50 ms until the returned function is
// called, which returns the peak.
func watchRSS(ctx context.Context, pid int) func() float64 {
	var mu sync.Mutex
	peak := 0.0
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(50 * time.Millisecond)
		defer t.Stop()
		for {
			if v := rssMB(pid); v > 0 {
				mu.Lock()
				peak = max(peak, v)
				mu.Unlock()
			}
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return func() float64 {
		close(done)
		mu.Lock()
		defer mu.Unlock()
		return peak
	}
}

// ownTime estimates percentiles of the broker's own-time histogram from
// its /metrics, interpolating linearly inside buckets.
func ownTime(ctx context.Context, opsURL string) (map[string]float64, error) {
	h, err := readOwnHistogram(ctx, opsURL)
	if err != nil {
		return nil, err
	}
	return h.quantiles(), nil
}

// ownHistogram is the broker's tokenbroker_issuance_own_seconds of
// granted requests: each bucket's upper bound and cumulative count, in
// order.
type ownHistogram []ownBucket

type ownBucket struct{ le, count float64 }

const ownHistogramName = "tokenbroker_issuance_own_seconds_bucket"

func readOwnHistogram(ctx context.Context, opsURL string) (ownHistogram, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, opsURL+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return parseOwnHistogram(string(raw))
}

func parseOwnHistogram(metrics string) (ownHistogram, error) {
	var h ownHistogram
	for _, line := range strings.Split(metrics, "\n") {
		if !strings.HasPrefix(line, ownHistogramName+"{") || !strings.Contains(line, `outcome="granted"`) {
			continue
		}
		i := strings.Index(line, `le="`)
		j := strings.Index(line[i+4:], `"`)
		leS := line[i+4 : i+4+j]
		le, err := strconv.ParseFloat(leS, 64)
		if leS == "+Inf" {
			le, err = math.Inf(1), nil
		}
		if err != nil {
			continue
		}
		f := strings.Fields(line)
		cnt, _ := strconv.ParseFloat(f[len(f)-1], 64)
		h = append(h, ownBucket{le, cnt})
	}
	if len(h) == 0 {
		return nil, fmt.Errorf("no %s in /metrics", ownHistogramName)
	}
	sort.Slice(h, func(i, j int) bool { return h[i].le < h[j].le })
	return h, nil
}

// since is what h counted after before (an earlier read of the same
// broker): the observations of the requests in between.
func (h ownHistogram) since(before ownHistogram) ownHistogram {
	out := make(ownHistogram, len(h))
	for i, b := range h {
		out[i] = b
		if i < len(before) && before[i].le == b.le {
			out[i].count -= before[i].count
		}
	}
	return out
}

// quantiles are h's p50, p90 and p99 in milliseconds, interpolated
// linearly inside each bucket; nil if h counted nothing.
func (h ownHistogram) quantiles() map[string]float64 {
	if len(h) == 0 || h[len(h)-1].count == 0 {
		return nil
	}
	total := h[len(h)-1].count
	q := func(p float64) float64 {
		rank := p * total
		lo, prev := 0.0, 0.0
		for _, b := range h {
			if b.count >= rank {
				if math.IsInf(b.le, 1) {
					return lo * 1000
				}
				if b.count == prev {
					return b.le * 1000
				}
				return (lo + (b.le-lo)*(rank-prev)/(b.count-prev)) * 1000
			}
			lo, prev = b.le, b.count
		}
		return lo * 1000
	}
	return map[string]float64{"p50": q(.5), "p90": q(.9), "p99": q(.99)}
}

// fetchProfile writes a 5-second CPU profile of the broker to file.
func fetchProfile(ctx context.Context, opsURL, file string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, opsURL+"/debug/pprof/profile?seconds=5", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %d", resp.StatusCode)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// tenantReport is the tenant measurement: one selector grant, decided and
// issued with few matching namespaces and again with many.
type tenantReport struct {
	FewNamespaces     int     `json:"few_namespaces"`
	Namespaces        int     `json:"namespaces"`
	FewDecisionP50ms  float64 `json:"few_decision_p50_ms"`
	ManyDecisionP50ms float64 `json:"many_decision_p50_ms"`
	FewIssueP50ms     float64 `json:"few_issue_p50_ms"`
	ManyIssueP50ms    float64 `json:"many_issue_p50_ms"`
	RSSBeforeMB       float64 `json:"rss_before_mb"`
	RSSAfterMB        float64 `json:"rss_after_mb"`
	SyncSeconds       float64 `json:"sync_seconds"`
}

// tenantLabel selects the namespaces of the bench tenant.
const tenantLabel = "bench.tokenbroker.io/tenant"

// measureTenants times decisions and issuances under the policy's
// selector grant "tenant" (ServiceAccount tenant-runner) with the one
// matching namespace "bench", then creates many more matching namespaces,
// waits until the broker's cache has them all, and times again. The
// decision is timed on a refused request (an unlabelled namespace), which
// makes no API call: what is left is TLS, HTTP and the decision itself.
func measureTenants(ctx context.Context, c kubernetes.Interface, br *brokerProcess, many, n int) (*tenantReport, error) {
	r := &tenantReport{FewNamespaces: 1, Namespaces: many}
	post := func(ns string, want int) func(context.Context) error {
		body, _ := json.Marshal(apiv1.KubeconfigRequest{Namespace: ns, ServiceAccount: "tenant-runner", TTL: "10m"})
		return func(ctx context.Context) error { return br.postKubeconfig(ctx, body, want, nil) }
	}
	deny, issue := post("bench-plain", http.StatusForbidden), post("bench", http.StatusCreated)
	timed := func() (float64, float64, error) {
		_ = measure(ctx, deny, 1, 20)
		d := measure(ctx, deny, 1, n)
		i := measure(ctx, issue, 1, n)
		if d.Errors > 0 || i.Errors > 0 {
			return 0, 0, fmt.Errorf("%d refused and %d issued requests failed", d.Errors, i.Errors)
		}
		return d.P50ms, i.P50ms, nil
	}
	var err error
	if r.FewDecisionP50ms, r.FewIssueP50ms, err = timed(); err != nil {
		return nil, err
	}
	r.RSSBeforeMB = rssMB(br.cmd.Process.Pid)

	var next, failed atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < 16; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(many) {
					return
				}
				_, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
					Name: fmt.Sprintf("bench-tenant-%05d", i), Labels: map[string]string{tenantLabel: "bench"},
				}}, metav1.CreateOptions{})
				if err != nil {
					failed.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	if failed.Load() > 0 {
		return nil, fmt.Errorf("%d namespaces could not be created", failed.Load())
	}
	created := time.Now()
	want := fmt.Sprintf(`tokenbroker_selector_namespaces{grant="tenant",peer="west"} %d`, many+1)
	for {
		if body, err := httpGet(br.opsURL + "/metrics"); err == nil && strings.Contains(body, want) {
			break
		}
		if time.Since(created) > 2*time.Minute || ctx.Err() != nil {
			return nil, fmt.Errorf("the broker's namespace cache never reached %d namespaces", many+1)
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.SyncSeconds = time.Since(created).Seconds()
	if r.ManyDecisionP50ms, r.ManyIssueP50ms, err = timed(); err != nil {
		return nil, err
	}
	r.RSSAfterMB = rssMB(br.cmd.Process.Pid)
	return r, nil
}

func httpGet(url string) (string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// ownTimeOf runs a row of the case name and, for a broker's row, sets
// *own to the percentiles of that broker's own time per issuance over the
// row alone (the broker with the pool off serves caseBrokerSequential,
// the other every other broker row). A failed read leaves *own nil.
func ownTimeOf(ctx context.Context, name, brokerURL, sequentialURL string, own *map[string]float64, run func() result) result {
	name = strings.TrimPrefix(name, pacedPrefix)
	if !strings.HasPrefix(name, "broker") {
		return run()
	}
	opsURL := brokerURL
	if name == caseBrokerSequential {
		opsURL = sequentialURL
	}
	before, err := readOwnHistogram(ctx, opsURL)
	r := run()
	if err != nil {
		return r
	}
	if after, err := readOwnHistogram(ctx, opsURL); err == nil {
		*own = after.since(before).quantiles()
	}
	return r
}

// printOwnTimes prints the broker's own time per issuance of each broker
// row that has it.
func printOwnTimes(rs []result) {
	printed := false
	for _, r := range rs {
		if r.OwnMillis == nil {
			continue
		}
		if !printed {
			fmt.Println("the issuing broker's own time per issuance, by row (tokenbroker_issuance_own_seconds over the row's requests; buckets 50, 100, 250, 500 µs…):")
			printed = true
		}
		fmt.Printf("  %-44s c=%-3d p50 %.3f ms, p90 %.3f ms, p99 %.3f ms\n", r.Name, r.Concurrency, r.OwnMillis["p50"], r.OwnMillis["p90"], r.OwnMillis["p99"])
	}
	if printed {
		fmt.Println()
	}
}
