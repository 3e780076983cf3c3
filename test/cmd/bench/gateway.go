package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/server/gateway"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// The gateway's ServiceAccount and namespaces: its leases and the direct
// comparison act as the same ServiceAccount, with the same RBAC, so that
// the only difference is the path.
const (
	gatewaySA     = "gateway-runner"
	gatewayListNS = "bench-list"
	// gatewayListSize is the ConfigMaps of the LIST row.
	gatewayListSize = 5000
)

// gatewayReport is the lease gateway against direct access on the same
// harness, in one run (issue "The lease gateway", its goals).
type gatewayReport struct {
	// Issue is a gateway lease's issuance at c=1 and IssueRatio its p50
	// over a bare TokenRequest's at c=1 (the run's own row).
	Issue      result  `json:"issue"`
	IssueRatio float64 `json:"issue_p50_over_tokenrequest"`
	// IssuePaced is the same issuance one every pacedEvery (as agents
	// refreshing ask), so that the pool refills between them, and
	// IssuePacedRatio its p50 over the bare TokenRequest's at c=1.
	IssuePaced      result  `json:"issue_paced"`
	IssuePacedRatio float64 `json:"issue_paced_p50_over_tokenrequest"`
	// Get is a GET of one ConfigMap at c=1 and c=32, direct and through
	// the gateway, and their differences.
	GetDirect          []result `json:"get_direct"`
	GetGateway         []result `json:"get_gateway"`
	GetP50OverheadMs   float64  `json:"get_p50_overhead_ms_c1"`
	GetThroughputRatio float64  `json:"get_throughput_ratio_c32"`
	// List is a LIST of gatewayListSize ConfigMaps (no paging).
	ListDirect          result  `json:"list_direct"`
	ListGateway         result  `json:"list_gateway"`
	ListThroughputRatio float64 `json:"list_throughput_ratio"`
	// BareProxy is the GET and LIST rows through a bare proxy, the
	// gateway's against them, and the CPU of both per forwarded GET.
	BareProxy *bareProxyReport `json:"bare_proxy,omitempty"`
	// WatchOverhead is how much later an event reached the gateway's
	// watch than the direct watch of the same objects (p50, p99, ms).
	WatchOverheadP50Ms float64 `json:"watch_overhead_p50_ms"`
	WatchOverheadP99Ms float64 `json:"watch_overhead_p99_ms"`
	WatchEvents        int     `json:"watch_events"`
	// Watches open through one lease, as many as its cap on requests
	// under way (LeaseCap, the broker's --gateway-max-requests-per-lease):
	// the broker's RSS growth at the cap and per open watch, how one
	// more request was answered, and how long after the DELETE's answer
	// the watches were all closed.
	LeaseCap         int      `json:"lease_cap"`
	Watches          int      `json:"open_watches"`
	LeaseCapRSSMiB   float64  `json:"lease_cap_rss_growth_mib"`
	RSSPerWatchKiB   float64  `json:"rss_per_watch_kib"`
	LeaseCapNext     capCheck `json:"lease_cap_next_request"`
	CloseP50Ms       float64  `json:"close_p50_ms"`
	CloseP99Ms       float64  `json:"close_p99_ms"`
	CloseMaxMs       float64  `json:"close_max_ms"`
	RefusedAfterMs   float64  `json:"new_request_refused_after_ms"`
	RefusedBy        string   `json:"new_request_refused_by"`
	SlowReaderRSSKiB float64  `json:"slow_reader_rss_growth_kib"`
	// PeerCap is one peer's whole allowance of watches, over as many of
	// its leases as the per-lease cap needs, on a replica of its own.
	PeerCap *peerCapReport `json:"peer_cap,omitempty"`
	// TwoReplicas is a lease's cap of watches through one lease on each
	// of two replicas, and its revocation.
	TwoReplicas *replicaReport `json:"two_replicas,omitempty"`
}

// bareProxyReport is the rows of the bare proxy (test/cmd/bareproxy):
// the gateway's listener TLS, HTTP/2 settings, proxy and upstream
// transports, and nothing else (no lease check, caps, audit or
// metrics), forwarding with the direct rows' token. The gateway over it
// is what the gateway's own work costs; it over direct is what the
// second hop costs by itself.
type bareProxyReport struct {
	// Get is a GET of one ConfigMap at c=1 and c=32, List the LIST of
	// gatewayListSize, through the bare proxy, in the same rounds as
	// the direct and gateway rows.
	Get  []result `json:"get"`
	List result   `json:"list"`
	// The gateway over the bare proxy.
	GatewayGetP50OverheadMs    float64 `json:"gateway_get_p50_overhead_ms_c1"`
	GatewayGetThroughputRatio  float64 `json:"gateway_get_throughput_ratio_c32"`
	GatewayListThroughputRatio float64 `json:"gateway_list_throughput_ratio"`
	// The bare proxy over direct.
	GetP50OverheadMs    float64 `json:"get_p50_overhead_ms_c1"`
	GetThroughputRatio  float64 `json:"get_throughput_ratio_c32"`
	ListThroughputRatio float64 `json:"list_throughput_ratio"`
	// CPU per forwarded GET over the c=32 rows' CPURequests requests:
	// the broker's process through the gateway, the bare proxy's
	// process, and the difference, the gateway's own.
	CPURequests         int     `json:"cpu_requests"`
	GatewayCPUMicros    float64 `json:"gateway_cpu_us_per_request"`
	CPUMicros           float64 `json:"cpu_us_per_request"`
	GatewayOwnCPUMicros float64 `json:"gateway_own_cpu_us_per_request"`
	// A watch event's arrival through the gateway after its arrival
	// through the bare proxy, and through the bare proxy after its direct
	// arrival (p50, p99, ms; the events of the gateway's watch row).
	GatewayWatchOverheadP50Ms float64 `json:"gateway_watch_overhead_p50_ms"`
	GatewayWatchOverheadP99Ms float64 `json:"gateway_watch_overhead_p99_ms"`
	WatchOverheadP50Ms        float64 `json:"watch_overhead_p50_ms"`
	WatchOverheadP99Ms        float64 `json:"watch_overhead_p99_ms"`
	// GatewayWatchOverheadP1Ms is the other tail of the first: how much
	// earlier than through the bare proxy an event came through the
	// gateway, at the 1st percentile. GatewayWatchP99OverBareMs is the
	// p99 of the gateway's delay over direct less the bare proxy's p99
	// over direct: what the gateway adds to a watch's tail, as the GET
	// rows compare p50s.
	GatewayWatchOverheadP1Ms  float64 `json:"gateway_watch_overhead_p1_ms"`
	GatewayWatchP99OverBareMs float64 `json:"gateway_watch_p99_over_bare_ms"`
}

// The goals of the RSS rows at the caps: a peer's whole allowance fits
// the chart's 256 Mi memory limit with room for the others (the
// broker's own working set, issuance, the other peers' streams), and a
// lease's is its share of a peer's.
const (
	gatewayPeerCapGoalMiB  = 96
	gatewayLeaseCapGoalMiB = 24
)

// capCheck is how the request after a cap's last one was answered: a
// raw request, since client-go retries a 429 until it passes.
type capCheck struct {
	Status     int    `json:"status"`
	RetryAfter string `json:"retry_after,omitempty"`
	Reason     string `json:"reason,omitempty"`
	Message    string `json:"message,omitempty"`
}

func (c capCheck) String() string {
	if c.Status != http.StatusTooManyRequests {
		return fmt.Sprintf("%d, NOT REFUSED (goal 429)", c.Status)
	}
	return fmt.Sprintf("%d %s, Retry-After %s, %q (goal 429)", c.Status, c.Reason, c.RetryAfter, c.Message)
}

// peerCapReport is peerCap's figures.
type peerCapReport struct {
	// Cap is the broker's --gateway-max-requests-per-peer; Watches (=
	// Cap) were open over Leases leases of one peer.
	Cap            int     `json:"cap"`
	Leases         int     `json:"leases"`
	Watches        int     `json:"open_watches"`
	RSSGrowthMiB   float64 `json:"rss_growth_mib"`
	RSSPerWatchKiB float64 `json:"rss_per_watch_kib"`
	// Next is one more request, through another lease of the same peer.
	Next capCheck `json:"next_request"`
}

// gatewayCaps are br's caps on the gateway's requests under way, per
// lease and per peer: its flags where the bench set them, else the
// broker's defaults.
func gatewayCaps(br *brokerProcess) (perLease, perPeer int, err error) {
	if perLease, err = brokerFlagInt(br, "--gateway-max-requests-per-lease", gateway.DefaultMaxRequestsPerLease); err != nil {
		return 0, 0, err
	}
	perPeer, err = brokerFlagInt(br, "--gateway-max-requests-per-peer", gateway.DefaultMaxRequestsPerPeer)
	return perLease, perPeer, err
}

// brokerFlagInt is the value of br's flag name (the last one given, as
// pflag takes it), or def if it was not given or is 0 (the default).
func brokerFlagInt(br *brokerProcess, name string, def int) (int, error) {
	args, v := br.cmd.Args[1:], ""
	for i, a := range args {
		if a == name && i+1 < len(args) {
			v = args[i+1]
		} else if s, ok := strings.CutPrefix(a, name+"="); ok {
			v = s
		}
	}
	if v == "" {
		return def, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("the broker's %s=%q: not a cap", name, v)
	}
	if n == 0 {
		return def, nil
	}
	return n, nil
}

// nextRequest sends one GET through cfg's lease as a raw request and
// says how the gateway answered it.
func nextRequest(ctx context.Context, cfg *rest.Config) (capCheck, error) {
	get, err := rawGet(cfg)
	if err != nil {
		return capCheck{}, err
	}
	return get(ctx)
}

// rawGet is a GET of the probe ConfigMap through cfg's lease, sent as a
// raw request with the lease's TLS configuration: client-go would wait
// out a 429's Retry-After and send it again.
func rawGet(cfg *rest.Config) (func(context.Context) (capCheck, error), error) {
	tr, err := rest.TransportFor(cfg)
	if err != nil {
		return nil, err
	}
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	return func(ctx context.Context) (capCheck, error) { return getProbe(ctx, client, cfg.Host) }, nil
}

// freshGet is rawGet on a connection of its own each time: once the
// gateway knows a lease revoked it closes the lease's new connections
// after their handshake (AdmitConn), so its refusal is a 401 or that.
func freshGet(cfg *rest.Config) (func(context.Context) (capCheck, error), error) {
	tlsCfg, err := rest.TLSConfigFor(cfg)
	if err != nil {
		return nil, err
	}
	return func(ctx context.Context) (capCheck, error) {
		tr := &http.Transport{TLSClientConfig: tlsCfg, DisableKeepAlives: true}
		defer tr.CloseIdleConnections()
		return getProbe(ctx, &http.Client{Transport: tr, Timeout: 30 * time.Second}, cfg.Host)
	}, nil
}

func getProbe(ctx context.Context, client *http.Client, host string) (capCheck, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, host+"/api/v1/namespaces/bench/configmaps/probe", nil)
	if err != nil {
		return capCheck{}, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return capCheck{}, err
	}
	defer resp.Body.Close()
	c := capCheck{Status: resp.StatusCode, RetryAfter: resp.Header.Get("Retry-After")}
	var st metav1.Status
	if b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10)); err == nil && json.Unmarshal(b, &st) == nil && st.Kind == "Status" {
		c.Reason, c.Message = string(st.Reason), st.Message
	}
	return c, nil
}

// setUpGateway makes the gateway's ServiceAccount, its RBAC, and the
// ConfigMaps the rows read.
func setUpGateway(ctx context.Context, c kubernetes.Interface) error {
	if _, err := c.CoreV1().ServiceAccounts("bench").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: gatewaySA}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: gatewayListNS}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	if _, err := c.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "bench-gateway"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list", "watch", "create"}}}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	for _, ns := range []string{"bench", gatewayListNS} {
		if _, err := c.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "bench-gateway"},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "bench-gateway"},
			Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: gatewaySA, Namespace: "bench"}}}, metav1.CreateOptions{}); err != nil {
			return err
		}
	}
	if _, err := c.CoreV1().ConfigMaps("bench").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "probe"}, Data: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	// The LIST's ConfigMaps, 16 writers at a time.
	errc := make(chan error, 16)
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < gatewayListSize; i += 16 {
				if _, err := c.CoreV1().ConfigMaps(gatewayListNS).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("cm-%05d", i)},
					Data: map[string]string{"k": "a value of a few dozen bytes, as ConfigMaps have"}}, metav1.CreateOptions{}); err != nil {
					errc <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	return <-errc
}

// measureGateway runs the gateway's rows against br, whose policy grants
// bench/gateway-runner with access gateway; tokenRequestC1 is the run's
// bare TokenRequest at c=1, and counter the client that reads the API
// server's counts (directClient).
func measureGateway(ctx context.Context, c *testcluster.Cluster, br *brokerProcess, counter kubernetes.Interface, n int, tokenRequestC1 result, profile string) (*gatewayReport, error) {
	rep := &gatewayReport{}
	body, _ := json.Marshal(apiv1.KubeconfigRequest{Namespace: "bench", ServiceAccount: gatewaySA, TTL: "1h", Access: apiv1.AccessGateway})
	issue := func(ctx context.Context) error { return br.postKubeconfig(ctx, body, http.StatusCreated, nil) }
	_ = measure(ctx, issue, 1, 20)
	// What each lease cost the API server, beside the bare TokenRequest's
	// (tokenRequestC1.APICalls): a pooled lease answers before any call,
	// and its writes (the claim, the pool's refill) follow it.
	pids := map[string]int{"kube-apiserver": c.APIServerPID(), "broker": br.cmd.Process.Pid}
	row := func(run func() result) result {
		var pooled float64
		r, calls := countAPICalls(ctx, counter, pids, func() result {
			var r result
			r, pooled = pooledFraction(ctx, br.opsURL, run)
			return r
		})
		r.PoolFraction, r.APICalls = &pooled, calls
		return r
	}
	rep.Issue = row(func() result { return measure(ctx, issue, 1, n) })
	rep.Issue.Name = "broker gateway lease (mTLS)"
	rep.IssuePaced = row(func() result { return measurePaced(ctx, issue, n/2, pacedEvery) })
	rep.IssuePaced.Name = pacedPrefix + rep.Issue.Name
	if tokenRequestC1.P50ms > 0 {
		rep.IssueRatio = rep.Issue.P50ms / tokenRequestC1.P50ms
		rep.IssuePacedRatio = rep.IssuePaced.P50ms / tokenRequestC1.P50ms
	}

	var lease apiv1.KubeconfigResponse
	if err := br.postKubeconfig(ctx, body, http.StatusCreated, &lease); err != nil {
		return nil, err
	}
	gwCfg, err := clientcmd.RESTConfigFromKubeConfig([]byte(lease.Kubeconfig))
	if err != nil {
		return nil, err
	}
	// The direct comparison: the same ServiceAccount's token, at the API
	// server, with the same client settings.
	secs := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts("bench").CreateToken(ctx, gatewaySA, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &secs}}, metav1.CreateOptions{})
	if err != nil {
		return nil, err
	}
	directCfg := &rest.Config{Host: c.URL, BearerToken: tr.Status.Token, TLSClientConfig: rest.TLSClientConfig{CAData: c.CAData}}
	for _, cfg := range []*rest.Config{gwCfg, directCfg} {
		cfg.QPS, cfg.Burst = brokerKubeQPS, brokerKubeBurst
		cfg.Timeout = time.Minute
	}
	gw, err := kubernetes.NewForConfig(gwCfg)
	if err != nil {
		return nil, err
	}
	direct, err := kubernetes.NewForConfig(directCfg)
	if err != nil {
		return nil, err
	}
	// The bare proxy: a process of its own, forwarding with the direct
	// rows' token; its client is the gateway's, the same lease
	// certificate and settings, at another address.
	bp, err := startBareProxy(ctx, c, br, tr.Status.Token)
	if err != nil {
		return nil, err
	}
	defer bp.stop()
	bareCfg := rest.CopyConfig(gwCfg)
	bareCfg.Host = bp.url
	bare, err := kubernetes.NewForConfig(bareCfg)
	if err != nil {
		return nil, err
	}
	bpRep := &bareProxyReport{}
	rep.BareProxy = bpRep

	// GET, c=1 and c=32, alternating the three paths' rounds; the CPU
	// of the broker and of the bare proxy over the c=32 rounds.
	get := func(cs kubernetes.Interface) func(context.Context) error {
		return func(ctx context.Context) error {
			_, err := cs.CoreV1().ConfigMaps("bench").Get(ctx, "probe", metav1.GetOptions{})
			return err
		}
	}
	if err := get(bare)(ctx); err != nil {
		return nil, fmt.Errorf("a GET through the bare proxy (log in %s): %w", bp.dir, err)
	}
	var gwCPU, bareCPU time.Duration
	for _, conc := range []int{1, 32} {
		_ = measure(ctx, get(direct), conc, 50)
		_ = measure(ctx, get(gw), conc, 50)
		_ = measure(ctx, get(bare), conc, 50)
		d := measure(ctx, get(direct), conc, 4*n)
		g, gCPU, err := measureCPU(ctx, br.cmd.Process.Pid, get(gw), conc, 4*n)
		if err != nil {
			return nil, fmt.Errorf("the broker's CPU: %w", err)
		}
		b, bCPU, err := measureCPU(ctx, bp.cmd.Process.Pid, get(bare), conc, 4*n)
		if err != nil {
			return nil, fmt.Errorf("the bare proxy's CPU: %w", err)
		}
		d.Name, g.Name, b.Name = "direct GET", "gateway GET", "bare proxy GET"
		rep.GetDirect, rep.GetGateway = append(rep.GetDirect, d), append(rep.GetGateway, g)
		bpRep.Get = append(bpRep.Get, b)
		gwCPU, bareCPU = gCPU, bCPU // the last round's, c=32
	}
	rep.GetP50OverheadMs = rep.GetGateway[0].P50ms - rep.GetDirect[0].P50ms
	rep.GetThroughputRatio = rep.GetGateway[1].PerSecond / rep.GetDirect[1].PerSecond
	bpRep.GatewayGetP50OverheadMs = rep.GetGateway[0].P50ms - bpRep.Get[0].P50ms
	bpRep.GatewayGetThroughputRatio = rep.GetGateway[1].PerSecond / bpRep.Get[1].PerSecond
	bpRep.GetP50OverheadMs = bpRep.Get[0].P50ms - rep.GetDirect[0].P50ms
	bpRep.GetThroughputRatio = bpRep.Get[1].PerSecond / rep.GetDirect[1].PerSecond
	bpRep.CPURequests = 4 * n
	bpRep.GatewayCPUMicros, bpRep.CPUMicros = microsPer(gwCPU, 4*n), microsPer(bareCPU, 4*n)
	bpRep.GatewayOwnCPUMicros = bpRep.GatewayCPUMicros - bpRep.CPUMicros
	if profile != "" {
		// -gateway-cpuprofile: the broker's profile over 5 s of the c=32
		// GET load, kept up until the profile is in.
		if err := profileUnder(ctx, br.opsURL, profile, get(gw), 32); err != nil {
			return nil, fmt.Errorf("the broker's CPU profile: %w", err)
		}
	}

	// LIST of 5,000, unpaged.
	list := func(cs kubernetes.Interface) func(context.Context) error {
		return func(ctx context.Context) error {
			l, err := cs.CoreV1().ConfigMaps(gatewayListNS).List(ctx, metav1.ListOptions{})
			if err != nil {
				return err
			}
			// The bench's own: kube-controller-manager adds
			// kube-root-ca.crt to every namespace.
			ours := 0
			for _, cm := range l.Items {
				if strings.HasPrefix(cm.Name, "cm-") {
					ours++
				}
			}
			if ours != gatewayListSize {
				return fmt.Errorf("listed %d of the bench's ConfigMaps, want %d", ours, gatewayListSize)
			}
			return nil
		}
	}
	_ = measure(ctx, list(direct), 1, 3)
	_ = measure(ctx, list(gw), 1, 3)
	_ = measure(ctx, list(bare), 1, 3)
	rep.ListDirect = measure(ctx, list(direct), 1, 20)
	rep.ListGateway = measure(ctx, list(gw), 1, 20)
	bpRep.List = measure(ctx, list(bare), 1, 20)
	rep.ListDirect.Name, rep.ListGateway.Name, bpRep.List.Name = "direct LIST 5000", "gateway LIST 5000", "bare proxy LIST 5000"
	rep.ListThroughputRatio = rep.ListGateway.PerSecond / rep.ListDirect.PerSecond
	bpRep.GatewayListThroughputRatio = rep.ListGateway.PerSecond / bpRep.List.PerSecond
	bpRep.ListThroughputRatio = bpRep.List.PerSecond / rep.ListDirect.PerSecond

	// WATCH: one watch each way on the same ConfigMaps; each event's
	// arrival through the gateway after its direct arrival and after its
	// arrival through the bare proxy.
	if err := watchOverhead(ctx, c.Client, direct, gw, bare, n, rep, bpRep); err != nil {
		return nil, fmt.Errorf("watch overhead: %w", err)
	}

	// A lease's cap of open watches, the request after them, then its
	// revocation; a peer's cap of them on a replica of its own.
	perLease, perPeer, err := gatewayCaps(br)
	if err != nil {
		return nil, err
	}
	if err := watchesAndRevocation(ctx, br, lease, gwCfg, gw, perLease, rep); err != nil {
		return nil, fmt.Errorf("watches and revocation: %w", err)
	}
	if rep.PeerCap, err = peerCap(ctx, br, body, perLease, perPeer); err != nil {
		return nil, fmt.Errorf("a peer's cap: %w", err)
	}
	if rep.SlowReaderRSSKiB, err = slowReader(ctx, c, br, body); err != nil {
		return nil, fmt.Errorf("slow reader: %w", err)
	}
	if rep.TwoReplicas, err = watchesOnTwoReplicas(ctx, br, body, perLease); err != nil {
		return nil, fmt.Errorf("two replicas: %w", err)
	}
	return rep, nil
}

// watchOverhead opens one watch of the same ConfigMaps directly, through
// the gateway (gw) and through the bare proxy (bare), creates n of them
// one by one, and records each event's arrival through the gateway after
// its direct arrival (rep) and after its arrival through the bare proxy
// (bp: what the gateway's own work adds to a watch), and through the bare
// proxy after its direct arrival (the hop alone).
func watchOverhead(ctx context.Context, admin kubernetes.Interface, direct, gw, bare kubernetes.Interface, n int, rep *gatewayReport, bp *bareProxyReport) error {
	l, err := direct.CoreV1().ConfigMaps("bench").List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil {
		return err
	}
	opts := metav1.ListOptions{ResourceVersion: l.ResourceVersion, LabelSelector: "bench=watch"}
	clients := []kubernetes.Interface{direct, gw, bare}
	at := make([]map[string]time.Time, len(clients))
	done := make(chan error, len(clients))
	for i, cs := range clients {
		w, err := cs.CoreV1().ConfigMaps("bench").Watch(ctx, opts)
		if err != nil {
			return err
		}
		defer w.Stop()
		at[i] = map[string]time.Time{}
		go func(out map[string]time.Time) {
			for len(out) < n {
				select {
				case ev, ok := <-w.ResultChan():
					if !ok {
						done <- errors.New("the watch ended")
						return
					}
					if cm, ok := ev.Object.(*corev1.ConfigMap); ok {
						out[cm.Name] = time.Now()
					}
				case <-time.After(30 * time.Second):
					done <- errors.New("no event for 30s")
					return
				}
			}
			done <- nil
		}(at[i])
	}
	for i := range n {
		if _, err := admin.CoreV1().ConfigMaps("bench").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("w-%05d", i), Labels: map[string]string{"bench": "watch"}}}, metav1.CreateOptions{}); err != nil {
			return err
		}
		time.Sleep(2 * time.Millisecond) // events one by one, as a controller sees them
	}
	for range clients {
		if err := <-done; err != nil {
			return err
		}
	}
	// later is, for each event seen by both, how much later it reached b
	// than a, sorted (ms).
	later := func(a, b map[string]time.Time) []float64 {
		var diffs []float64
		for name, ta := range a {
			if tb, ok := b[name]; ok {
				diffs = append(diffs, float64(tb.Sub(ta).Microseconds())/1000)
			}
		}
		sort.Float64s(diffs)
		return diffs
	}
	d := later(at[0], at[1])
	rep.WatchEvents = len(d)
	rep.WatchOverheadP50Ms, rep.WatchOverheadP99Ms = pctF(d, .50), pctF(d, .99)
	d = later(at[2], at[1])
	bp.GatewayWatchOverheadP1Ms, bp.GatewayWatchOverheadP50Ms, bp.GatewayWatchOverheadP99Ms = pctF(d, .01), pctF(d, .50), pctF(d, .99)
	d = later(at[0], at[2])
	bp.WatchOverheadP50Ms, bp.WatchOverheadP99Ms = pctF(d, .50), pctF(d, .99)
	bp.GatewayWatchP99OverBareMs = rep.WatchOverheadP99Ms - bp.WatchOverheadP99Ms
	return nil
}

// watchesAndRevocation opens count watches (the lease's cap) through
// gw, the lease's client, measures the broker's RSS growth, sends one
// more request through gwCfg, then revokes the lease and times the
// watches' ends and the refusal of a new request.
func watchesAndRevocation(ctx context.Context, br *brokerProcess, lease apiv1.KubeconfigResponse, gwCfg *rest.Config, gw kubernetes.Interface, count int, rep *gatewayReport) error {
	before := rssMB(br.cmd.Process.Pid)
	ws := make([]watch.Interface, 0, count)
	defer func() {
		for _, w := range ws {
			w.Stop()
		}
	}()
	for range count {
		w, err := gw.CoreV1().ConfigMaps("bench").Watch(ctx, metav1.ListOptions{LabelSelector: "bench=none"})
		if err != nil {
			return err
		}
		ws = append(ws, w)
	}
	time.Sleep(2 * time.Second) // every stream settled
	rep.LeaseCap, rep.Watches = count, count
	rep.LeaseCapRSSMiB = rssMB(br.cmd.Process.Pid) - before
	rep.RSSPerWatchKiB = rep.LeaseCapRSSMiB * 1024 / float64(count)
	get, err := rawGet(gwCfg)
	if err != nil {
		return err
	}
	if rep.LeaseCapNext, err = get(ctx); err != nil {
		return fmt.Errorf("the request after the lease's cap: %w", err)
	}
	fresh, err := freshGet(gwCfg)
	if err != nil {
		return err
	}

	revoked, ended, err := revokeWhileWatching(ctx, br, lease.LeaseID, ws, 30*time.Second, func(revoked time.Time) error {
		// New requests: refused how long after the DELETE's answer? Raw
		// requests (until the gateway learns of the deletion the lease
		// is at its cap, and client-go would wait out each 429's
		// second), each on a new connection, which the gateway closes
		// after the handshake once it knows the lease gone.
		for {
			c, err := fresh(ctx)
			var op *net.OpError
			switch {
			case ctx.Err() != nil:
				return ctx.Err()
			case errors.As(err, &op) && op.Op == "dial":
				return err
			case err != nil:
				rep.RefusedAfterMs, rep.RefusedBy = ms(time.Since(revoked)), "connection closed at admission"
				return nil
			case c.Status == http.StatusUnauthorized:
				rep.RefusedAfterMs, rep.RefusedBy = ms(time.Since(revoked)), "401"
				return nil
			}
			if time.Since(revoked) > 30*time.Second {
				return errors.New("requests still served 30s after the revocation")
			}
		}
	})
	if err != nil {
		return err
	}
	after := make([]float64, count)
	for i, t := range ended {
		after[i] = ms(t.Sub(revoked))
	}
	sort.Float64s(after)
	rep.CloseP50Ms, rep.CloseP99Ms, rep.CloseMaxMs = pctF(after, .50), pctF(after, .99), after[len(after)-1]
	return nil
}

// peerCap opens perPeer watches, perLease through each of as many
// leases of one peer as that needs, on a replica of br started for it
// (so that the growth is the whole allowance's, not what the process
// had left from the rows before), measures the replica's RSS growth,
// sends one more request through another lease of the same peer, and
// revokes every lease, which ends the watches.
func peerCap(ctx context.Context, br *brokerProcess, body []byte, perLease, perPeer int) (*peerCapReport, error) {
	replica, replicaGateway, err := startReplica(ctx, br)
	if err != nil {
		return nil, err
	}
	defer replica.stop()
	leases := (perPeer + perLease - 1) / perLease
	cfgs, ids := make([]*rest.Config, leases+1), make([]string, leases+1) // the last one is the next request's
	revoked := make([]bool, leases+1)
	defer func() {
		// After a failure: no lease of this row left for the next ones.
		for i, id := range ids {
			if id != "" && !revoked[i] {
				if req, err := http.NewRequestWithContext(context.WithoutCancel(ctx), http.MethodDelete, br.url+"/v1/leases/"+id, nil); err == nil {
					_ = brokerDo(br, req, http.StatusNoContent, nil)
				}
			}
		}
	}()
	for i := range cfgs {
		var lease apiv1.KubeconfigResponse
		if err := br.postKubeconfig(ctx, body, http.StatusCreated, &lease); err != nil {
			return nil, err
		}
		ids[i] = lease.LeaseID
		if cfgs[i], err = clientcmd.RESTConfigFromKubeConfig([]byte(lease.Kubeconfig)); err != nil {
			return nil, err
		}
		cfgs[i].QPS, cfgs[i].Burst = brokerKubeQPS, brokerKubeBurst
		cfgs[i].Host = replicaGateway
	}
	time.Sleep(time.Second) // the replica has seen the leases
	pid := replica.cmd.Process.Pid
	before := rssMB(pid)
	ws := make([][]watch.Interface, leases)
	defer func() {
		for _, l := range ws {
			for _, w := range l {
				w.Stop()
			}
		}
	}()
	for i, left := 0, perPeer; i < leases; i, left = i+1, left-perLease {
		cs, err := kubernetes.NewForConfig(cfgs[i])
		if err != nil {
			return nil, err
		}
		for range min(perLease, left) {
			w, err := cs.CoreV1().ConfigMaps("bench").Watch(ctx, metav1.ListOptions{LabelSelector: "bench=none"})
			if err != nil {
				return nil, err
			}
			ws[i] = append(ws[i], w)
		}
	}
	time.Sleep(2 * time.Second) // every stream settled
	rep := &peerCapReport{Cap: perPeer, Leases: leases, Watches: perPeer, RSSGrowthMiB: rssMB(pid) - before}
	rep.RSSPerWatchKiB = rep.RSSGrowthMiB * 1024 / float64(perPeer)
	if rep.Next, err = nextRequest(ctx, cfgs[leases]); err != nil {
		return nil, fmt.Errorf("the request after the peer's cap: %w", err)
	}
	for i := range leases {
		if _, _, err := revokeWhileWatching(ctx, br, ids[i], ws[i], 30*time.Second, nil); err != nil {
			return nil, err
		}
		revoked[i] = true
	}
	return rep, nil
}

// slowReader opens a watch through the gateway whose client reads
// nothing, makes events it would receive, and reports how much the
// broker's RSS grew meanwhile.
func slowReader(ctx context.Context, c *testcluster.Cluster, br *brokerProcess, body []byte) (float64, error) {
	var lease apiv1.KubeconfigResponse
	if err := br.postKubeconfig(ctx, body, http.StatusCreated, &lease); err != nil {
		return 0, err
	}
	cfg, err := clientcmd.RESTConfigFromKubeConfig([]byte(lease.Kubeconfig))
	if err != nil {
		return 0, err
	}
	tr, err := rest.TransportFor(cfg)
	if err != nil {
		return 0, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, cfg.Host+"/api/v1/namespaces/"+gatewayListNS+"/configmaps?watch=1", nil)
	if err != nil {
		return 0, err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close() // never read: the slow reader
	time.Sleep(time.Second)
	before := rssMB(br.cmd.Process.Pid)
	// Every ConfigMap of the list namespace updated twice: about 2 MB of
	// events for a client that reads none.
	for round := range 2 {
		for i := range gatewayListSize {
			if _, err := c.Client.CoreV1().ConfigMaps(gatewayListNS).Update(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("cm-%05d", i)},
				Data: map[string]string{"k": fmt.Sprintf("round %d: a value of a few dozen bytes", round)}}, metav1.UpdateOptions{}); err != nil {
				return 0, err
			}
		}
	}
	time.Sleep(2 * time.Second)
	return (rssMB(br.cmd.Process.Pid) - before) * 1024, nil
}

// profileUnder writes the broker's 5 s CPU profile to file while op runs
// at conc, in rounds, until the profile is in.
func profileUnder(ctx context.Context, opsURL, file string, op func(context.Context) error, conc int) error {
	done := make(chan error, 1)
	go func() { done <- fetchProfile(ctx, opsURL, file) }()
	for {
		select {
		case err := <-done:
			return err
		default:
			_ = measure(ctx, op, conc, 10*conc)
		}
	}
}

func pctF(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	return xs[int(p*float64(len(xs)-1))]
}

func (r *gatewayReport) print() {
	fmt.Println()
	fmt.Println("lease gateway, against direct access as the same ServiceAccount (one run):")
	fmt.Printf("  issuance c=1, back to back: gateway lease p50 %.2f ms = %.2f× a bare TokenRequest (goal ≤ 1.0×), %.0f%% answered from the pool\n", r.Issue.P50ms, r.IssueRatio, 100*derefOr(r.Issue.PoolFraction))
	fmt.Printf("  issuance c=1, one every %s: gateway lease p50 %.2f ms = %.2f× a bare TokenRequest, %.0f%% answered from the pool\n", pacedEvery, r.IssuePaced.P50ms, r.IssuePacedRatio, 100*derefOr(r.IssuePaced.PoolFraction))
	if r.Issue.APICalls != nil {
		fmt.Printf("    API server per lease, back to back: %s\n", r.Issue.APICalls)
	}
	if r.IssuePaced.APICalls != nil {
		fmt.Printf("    API server per lease, paced: %s\n", r.IssuePaced.APICalls)
	}
	fmt.Printf("  GET c=1: direct p50 %.2f ms, gateway %.2f ms: overhead %.2f ms (goal ≤ 0.3 ms)\n", r.GetDirect[0].P50ms, r.GetGateway[0].P50ms, r.GetP50OverheadMs)
	fmt.Printf("  GET c=32: direct %.0f/s, gateway %.0f/s: %.2f× (goal ≥ 0.9×)\n", r.GetDirect[1].PerSecond, r.GetGateway[1].PerSecond, r.GetThroughputRatio)
	fmt.Printf("  LIST %d ConfigMaps: direct %.1f/s (p50 %.1f ms), gateway %.1f/s (p50 %.1f ms): %.2f× (goal ≥ 0.9×)\n", gatewayListSize,
		r.ListDirect.PerSecond, r.ListDirect.P50ms, r.ListGateway.PerSecond, r.ListGateway.P50ms, r.ListThroughputRatio)
	if b := r.BareProxy; b != nil {
		fmt.Println("  against a bare proxy (the gateway's listener TLS, HTTP/2 settings, proxy and upstream transports; no lease check, caps, audit or metrics):")
		fmt.Printf("    GET c=1: bare proxy p50 %.2f ms: the gateway's overhead over it %.2f ms, %.2f× (goal ≤ 1.05×; the bare hop's over direct %.2f ms)\n",
			b.Get[0].P50ms, b.GatewayGetP50OverheadMs, r.GetGateway[0].P50ms/b.Get[0].P50ms, b.GetP50OverheadMs)
		fmt.Printf("    GET c=32: bare proxy %.0f/s: gateway ÷ bare proxy %.2f× (goal ≥ 0.95×; bare proxy ÷ direct %.2f×)\n",
			b.Get[1].PerSecond, b.GatewayGetThroughputRatio, b.GetThroughputRatio)
		fmt.Printf("    LIST %d ConfigMaps: bare proxy %.1f/s (p50 %.1f ms): gateway ÷ bare proxy %.2f× (goal ≥ 0.95×; bare proxy ÷ direct %.2f×)\n", gatewayListSize,
			b.List.PerSecond, b.List.P50ms, b.GatewayListThroughputRatio, b.ListThroughputRatio)
		fmt.Printf("    CPU per forwarded GET at c=32 (%d requests): the broker %.1f µs, the bare proxy %.1f µs: the gateway's own %.1f µs (%.2f×; goal ≤ 1.10×)\n",
			b.CPURequests, b.GatewayCPUMicros, b.CPUMicros, b.GatewayOwnCPUMicros, b.GatewayCPUMicros/b.CPUMicros)
		fmt.Printf("    WATCH event p99 after the direct watch's: gateway %.2f ms, bare proxy %.2f ms: the gateway's over the bare proxy's %.2f ms (goal ≤ 0.2 ms); p50 %.2f ms over direct through the bare proxy\n",
			r.WatchOverheadP99Ms, b.WatchOverheadP99Ms, b.GatewayWatchP99OverBareMs, b.WatchOverheadP50Ms)
		fmt.Printf("    WATCH event through the gateway after the bare proxy's, event by event: p1 %.2f ms, p50 %.2f ms, p99 %.2f ms (the two processes' turns on the cores, both ways)\n",
			b.GatewayWatchOverheadP1Ms, b.GatewayWatchOverheadP50Ms, b.GatewayWatchOverheadP99Ms)
	}
	fmt.Printf("  WATCH event through the gateway after the direct watch's: p50 %.2f ms, p99 %.2f ms over %d events (goal p99 ≤ 1 ms)\n", r.WatchOverheadP50Ms, r.WatchOverheadP99Ms, r.WatchEvents)
	fmt.Printf("  a lease's cap, %d open watches through one lease: the broker's RSS grew %.1f MiB (goal ≤ %d MiB: fits the chart's 256 Mi limit with room for the others), %.1f KiB per watch (goal ≤ 64 KiB)\n",
		r.Watches, r.LeaseCapRSSMiB, gatewayLeaseCapGoalMiB, r.RSSPerWatchKiB)
	fmt.Printf("  the lease's cap's next request: %s\n", r.LeaseCapNext)
	fmt.Printf("  that lease revoked: all %d watches closed p50 %.1f ms, p99 %.1f ms, max %.1f ms after the DELETE (goal p99 ≤ 1 s); new requests refused %.1f ms after it (%s; goal ≤ 100 ms)\n",
		r.Watches, r.CloseP50Ms, r.CloseP99Ms, r.CloseMaxMs, r.RefusedAfterMs, r.RefusedBy)
	if p := r.PeerCap; p != nil {
		fmt.Printf("  a peer's cap, %d open watches over %d leases of one peer, on a fresh replica: its RSS grew %.1f MiB (goal ≤ %d MiB: fits the chart's 256 Mi limit with room for the others), %.1f KiB per watch\n",
			p.Watches, p.Leases, p.RSSGrowthMiB, gatewayPeerCapGoalMiB, p.RSSPerWatchKiB)
		fmt.Printf("  the peer's cap's next request, through another lease of the peer: %s\n", p.Next)
	}
	fmt.Printf("  a watch whose client reads nothing, sent 10,000 events: the broker's RSS grew %.0f KiB\n", r.SlowReaderRSSKiB)
	if t := r.TwoReplicas; t != nil {
		fmt.Printf("  %d open watches through one lease, its cap on each of two replicas: RSS per watch %.1f and %.1f KiB (goal ≤ 64 KiB); revoked: closed p99 %.0f and %.0f ms, max %.0f and %.0f ms after the DELETE (goal p99 ≤ 1 s on every replica)\n",
			t.Watches, t.RSSPerWatchKiB[0], t.RSSPerWatchKiB[1], t.CloseP99Ms[0], t.CloseP99Ms[1], t.CloseMaxMs[0], t.CloseMaxMs[1])
	}
}

// startReplica starts a second "tokenbroker serve" of b's files (its CA,
// certificates and policy: a replica of the same broker) on ports of its
// own, and returns it with its gateway's URL.
func startReplica(ctx context.Context, b *brokerProcess) (*brokerProcess, string, error) {
	args := append([]string(nil), b.cmd.Args[1:]...)
	api, ops, gateway := freeAddr(), freeAddr(), freeAddr()
	for i := 0; i+1 < len(args); i++ {
		switch args[i] {
		case "--listen-address":
			args[i+1] = api
		case "--ops-address":
			args[i+1] = ops
		case "--gateway-address":
			args[i+1] = gateway
		case "--gateway-url":
			args[i+1] = "https://" + gateway
		}
	}
	r := &brokerProcess{cmd: exec.CommandContext(ctx, b.cmd.Path, args...), url: "https://" + api, opsURL: "http://" + ops, client: b.client, bin: b.bin}
	logFile, err := os.Create(filepath.Join(b.dir, "replica.log"))
	if err != nil {
		return nil, "", err
	}
	defer logFile.Close()
	r.cmd.Stdout, r.cmd.Stderr = logFile, logFile
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := r.cmd.Start(); err != nil {
		return nil, "", err
	}
	for start := time.Now(); ; time.Sleep(5 * time.Millisecond) {
		if resp, err := http.Get(r.opsURL + "/readyz"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return r, "https://" + gateway, nil
			}
		}
		if time.Since(start) > 30*time.Second {
			r.stop()
			return nil, "", fmt.Errorf("replica not ready after 30s; log in %s", filepath.Join(b.dir, "replica.log"))
		}
	}
}

// watchesOnTwoReplicas opens perReplica watches (the lease's cap, which
// each replica counts on its own) through one lease on br's gateway and
// as many on a replica's, and measures each broker's RSS per open watch
// and how long after the DELETE's answer the watches of each were all
// closed.
func watchesOnTwoReplicas(ctx context.Context, br *brokerProcess, body []byte, perReplica int) (*replicaReport, error) {
	replica, replicaGateway, err := startReplica(ctx, br)
	if err != nil {
		return nil, err
	}
	defer replica.stop()
	var lease apiv1.KubeconfigResponse
	if err := br.postKubeconfig(ctx, body, http.StatusCreated, &lease); err != nil {
		return nil, err
	}
	cfg, err := clientcmd.RESTConfigFromKubeConfig([]byte(lease.Kubeconfig))
	if err != nil {
		return nil, err
	}
	cfg.QPS, cfg.Burst = brokerKubeQPS, brokerKubeBurst
	other := rest.CopyConfig(cfg)
	other.Host = replicaGateway
	procs := []*brokerProcess{br, replica}
	count := 2 * perReplica
	rep := &replicaReport{Watches: count}
	var ws []watch.Interface
	defer func() {
		for _, w := range ws {
			w.Stop()
		}
	}()
	owner := make([]int, 0, count)
	for i, c := range []*rest.Config{cfg, other} {
		cs, err := kubernetes.NewForConfig(c)
		if err != nil {
			return nil, err
		}
		before := rssMB(procs[i].cmd.Process.Pid)
		for range perReplica {
			w, err := cs.CoreV1().ConfigMaps("bench").Watch(ctx, metav1.ListOptions{LabelSelector: "bench=none"})
			if err != nil {
				return nil, err
			}
			ws = append(ws, w)
			owner = append(owner, i)
		}
		time.Sleep(2 * time.Second) // every stream settled
		rep.RSSPerWatchKiB = append(rep.RSSPerWatchKiB, (rssMB(procs[i].cmd.Process.Pid)-before)*1024/float64(perReplica))
	}
	revoked, ended, err := revokeWhileWatching(ctx, br, lease.LeaseID, ws, 60*time.Second, nil)
	if err != nil {
		return nil, err
	}
	for p := range procs {
		var after []float64
		for i, t := range ended {
			if owner[i] == p {
				after = append(after, ms(t.Sub(revoked)))
			}
		}
		sort.Float64s(after)
		rep.CloseP99Ms = append(rep.CloseP99Ms, pctF(after, .99))
		rep.CloseMaxMs = append(rep.CloseMaxMs, after[len(after)-1])
	}
	return rep, nil
}

// replicaReport is watchesOnTwoReplicas' figures, one per replica.
type replicaReport struct {
	Watches        int       `json:"open_watches"`
	RSSPerWatchKiB []float64 `json:"rss_per_watch_kib"`
	CloseP99Ms     []float64 `json:"close_p99_ms"`
	CloseMaxMs     []float64 `json:"close_max_ms"`
}

// revokeWhileWatching notes when each of ws ends, revokes the lease id
// through br, runs afterDelete (if set) with the moment the DELETE was
// answered, and waits at most timeout for every watch to end. It returns
// that moment and each watch's end.
func revokeWhileWatching(ctx context.Context, br *brokerProcess, id string, ws []watch.Interface, timeout time.Duration, afterDelete func(revoked time.Time) error) (time.Time, []time.Time, error) {
	ended := make([]time.Time, len(ws))
	var wg sync.WaitGroup
	for i, w := range ws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range w.ResultChan() {
			}
			ended[i] = time.Now()
		}()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodDelete, br.url+"/v1/leases/"+id, nil)
	if err != nil {
		return time.Time{}, nil, err
	}
	if err := brokerDo(br, req, http.StatusNoContent, nil); err != nil {
		return time.Time{}, nil, err
	}
	revoked := time.Now()
	if afterDelete != nil {
		if err := afterDelete(revoked); err != nil {
			return time.Time{}, nil, err
		}
	}
	waited := make(chan struct{})
	go func() { wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(timeout):
		return time.Time{}, nil, fmt.Errorf("watches still open %s after the revocation", timeout)
	}
	return revoked, ended, nil
}

// derefOr is *f, or 0 for nil.
func derefOr(f *float64) float64 {
	if f == nil {
		return 0
	}
	return *f
}
