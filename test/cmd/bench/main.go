// Command bench measures what the broker adds on top of the API server. It
// starts a harness cluster on 127.0.0.1, then, in one run, times
//
//   - direct TokenRequest calls with client-go (the floor),
//   - the pair of calls the broker makes — create a lease Secret, then a
//     TokenRequest bound to it — made directly, and
//   - POST /v1/kubeconfigs through the broker over mutual TLS with a
//     kept-alive client,
//
// at each concurrency, and prints latency percentiles, throughput and the
// ratios broker ÷ direct pair and broker ÷ direct TokenRequest.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/issuers/tokenrequest"
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
}

func run() error {
	n := flag.Int("n", 300, "requests per measurement")
	concs := flag.String("c", "1,8,32", "comma-separated concurrency levels")
	out := flag.String("out", "", "also write the results as JSON to this file")
	flag.Parse()

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	c, err := testcluster.Run(ctx)
	if err != nil {
		return err
	}
	defer c.Stop()
	if err := setUp(ctx, c.Client); err != nil {
		return err
	}
	url, client, stop, err := startBroker(c)
	if err != nil {
		return err
	}
	defer stop()

	body, _ := json.Marshal(apiv1.KubeconfigRequest{Namespace: "bench", ServiceAccount: "runner", TTL: "10m"})
	seconds := int64(600)
	cases := []struct {
		name string
		op   func(context.Context) error
	}{
		{"direct TokenRequest", func(ctx context.Context) error {
			_, err := c.Client.CoreV1().ServiceAccounts("bench").CreateToken(ctx, "runner",
				&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &seconds}}, metav1.CreateOptions{})
			return err
		}},
		{"direct Secret + bound TokenRequest", func(ctx context.Context) error {
			s, err := c.Client.CoreV1().Secrets("bench").Create(ctx, &corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{GenerateName: "pair-", Labels: map[string]string{"bench": "pair"}},
			}, metav1.CreateOptions{})
			if err != nil {
				return err
			}
			_, err = c.Client.CoreV1().ServiceAccounts("bench").CreateToken(ctx, "runner", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
				ExpirationSeconds: &seconds,
				BoundObjectRef:    &authnv1.BoundObjectReference{Kind: "Secret", APIVersion: "v1", Name: s.Name, UID: s.UID},
			}}, metav1.CreateOptions{})
			return err
		}},
		{"broker POST /v1/kubeconfigs (mTLS)", func(ctx context.Context) error {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/kubeconfigs", bytes.NewReader(body))
			req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			_, _ = io.Copy(io.Discard, resp.Body)
			if resp.StatusCode != http.StatusCreated {
				return fmt.Errorf("status %d", resp.StatusCode)
			}
			return nil
		}},
	}

	var results []result
	for _, cs := range strings.Split(*concs, ",") {
		conc, err := strconv.Atoi(strings.TrimSpace(cs))
		if err != nil || conc < 1 {
			return fmt.Errorf("bad concurrency %q", cs)
		}
		for _, tc := range cases {
			_ = measure(ctx, tc.op, conc, 20) // warm up connections and caches
			r := measure(ctx, tc.op, conc, *n)
			r.Name = tc.name
			results = append(results, r)
		}
	}
	print(results)
	if *out != "" {
		if err := os.MkdirAll(filepath.Dir(*out), 0o755); err != nil {
			return err
		}
		b, _ := json.MarshalIndent(results, "", "  ")
		return os.WriteFile(*out, b, 0o644)
	}
	return nil
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

func print(rs []result) {
	fmt.Printf("%-38s %5s %6s %9s %9s %9s %9s %6s\n", "case", "conc", "n", "p50 ms", "p90 ms", "p99 ms", "req/s", "errors")
	for _, r := range rs {
		fmt.Printf("%-38s %5d %6d %9.2f %9.2f %9.2f %9.0f %6d\n", r.Name, r.Concurrency, r.Requests, r.P50ms, r.P90ms, r.P99ms, r.PerSecond, r.Errors)
	}
	fmt.Println()
	fmt.Printf("%-6s %22s %22s\n", "conc", "broker/pair p50", "broker/TokenRequest p50")
	for i := 0; i+2 < len(rs); i += 3 {
		fmt.Printf("%-6d %22.2f %22.2f\n", rs[i].Concurrency, rs[i+2].P50ms/rs[i+1].P50ms, rs[i+2].P50ms/rs[i].P50ms)
	}
}

func setUp(ctx context.Context, c kubernetes.Interface) error {
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "bench"}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	_, err := c.CoreV1().ServiceAccounts("bench").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	return err
}

// startBroker runs the broker in this process with the production TLS
// profiles and returns its URL and a kept-alive mTLS client.
func startBroker(c *testcluster.Cluster) (string, *http.Client, func(), error) {
	dir, err := os.MkdirTemp("", "bench-")
	if err != nil {
		return "", nil, nil, err
	}
	fail := func(err error) (string, *http.Client, func(), error) {
		os.RemoveAll(dir)
		return "", nil, nil, err
	}
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "bench CA"})
	if err != nil {
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
	f := func(n string) string { return filepath.Join(dir, n) }
	if err := srvKP.WriteFiles(f("server.crt"), f("server.key")); err != nil {
		return fail(err)
	}
	if err := cliKP.WriteFiles(f("west.crt"), f("west.key")); err != nil {
		return fail(err)
	}
	if err := os.WriteFile(f("cluster-ca.crt"), c.CAData, 0o644); err != nil {
		return fail(err)
	}
	policy := fmt.Sprintf(`cluster: {name: bench, server: %q, caFile: cluster-ca.crt}
peers:
  - name: west
    identity: %s
    grants: [{namespaces: [bench], serviceAccounts: [runner]}]
`, c.URL, id)
	if err := os.WriteFile(f("policy.yaml"), []byte(policy), 0o644); err != nil {
		return fail(err)
	}
	p, err := broker.LoadPolicyFile(f("policy.yaml"))
	if err != nil {
		return fail(err)
	}
	b, err := broker.New(broker.Config{
		Secrets: c.Client.CoreV1(),
		Issuers: map[string]broker.Issuer{apiv1.CredentialToken: tokenrequest.New(c.Client.CoreV1())},
		Policy:  broker.NewPolicyStore(p),
		Logger:  zap.NewNop(),
	})
	if err != nil {
		return fail(err)
	}
	certs, err := pki.NewCertReloader(f("server.crt"), f("server.key"))
	if err != nil {
		return fail(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	opsLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail(err)
	}
	srv, err := server.New(server.Config{Listener: ln, OpsListener: opsLn, TLSConfig: pki.ServerTLSConfig(certs, ca.CertPool()), Broker: b})
	if err != nil {
		return fail(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	<-srv.Listening()
	cliCerts, err := pki.NewCertReloader(f("west.crt"), f("west.key"))
	if err != nil {
		cancel()
		return fail(err)
	}
	client := &http.Client{Transport: &http.Transport{
		TLSClientConfig:     pki.ClientTLSConfig(ca.CertPool(), cliCerts),
		MaxIdleConnsPerHost: 64,
	}}
	return "https://" + ln.Addr().String(), client, func() {
		cancel()
		<-done
		os.RemoveAll(dir)
	}, nil
}
