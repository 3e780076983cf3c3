// Package agentscale runs one `tokenbroker agent` with many targets
// against harness brokers and measures what it costs: the agent's memory,
// the time from its start to every target's Secret written, and the calls
// one refresh cycle makes to the source cluster's API server and to the
// brokers. The bench (`make bench-agent`) reports the figures; an e2e test
// holds the calls to the bound the design gives.
//
// The setup, in one harness cluster that is both the source and the target
// cluster:
//
//   - a few `tokenbroker serve` processes (Options.Brokers), each listening
//     on all addresses of its port. Every target reaches its broker at a
//     loopback address of its own (127.1.x.y), so the agent sees as many
//     broker URLs as targets — one client, one TLS connection and one
//     HTTP/2 stream state per target, as with one broker per cluster —
//     without the CPU and memory of a hundred broker processes on a small
//     machine;
//   - per target a ServiceAccount of its own to ask for, and an output
//     Secret of its own in the source namespace;
//   - the agent as its own process, with an identity directory, a
//     10-minute token per target refreshed after Options.Fraction of it, and
//     a kubeconfig that authenticates as the ServiceAccount AgentUser with
//     the least privilege the agent needs (get, create, update on Secrets
//     in one namespace).
//
// The API server's audit log (AuditArgs) records every request of
// AgentUser, and nothing else, so the agent's calls are counted by the API
// server itself, not by the agent. Broker calls are the brokers'
// tokenbroker_http_requests_total.
package agentscale

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/promtext"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// Namespaces and names of the setup.
const (
	// TargetNamespace holds the ServiceAccounts the targets ask for.
	TargetNamespace = "agentscale-targets"
	// OutputNamespace holds the agent's ServiceAccount and every output
	// Secret.
	OutputNamespace = "agentscale-outputs"
	agentSA         = "tokenbroker-agent"
	// AgentUser is who the agent is to the API server: its requests, and
	// only they, are in the audit log.
	AgentUser = "system:serviceaccount:" + OutputNamespace + ":" + agentSA

	trustDomain = "agentscale.example"
	// tokenTTL is what every target asks for: the API server's minimum for
	// a TokenRequest.
	tokenTTL = 10 * time.Minute
	// revokeGrace is short so that a cycle ends soon after its last
	// refresh.
	revokeGrace = 2 * time.Second
	// brokerIdleConnTimeout is the agent's (agent/brokers.go): after it,
	// the agent holds no broker connection.
	brokerIdleConnTimeout = 5 * time.Second
)

// Options says what to run.
type Options struct {
	// Cluster is the harness cluster, started with AuditArgs' arguments.
	Cluster *testcluster.Cluster
	// AuditLog is the log file AuditArgs named.
	AuditLog string
	// Bin is the tokenbroker binary.
	Bin string
	// AgentEnv is added to the agent's environment (e.g. GOGC=50).
	AgentEnv []string
	// Targets is the number of targets of the one agent.
	Targets int
	// Brokers is the number of broker processes serving them (at least 1).
	Brokers int
	// Fraction is the agent's refresh.fraction: each 10-minute token is
	// refreshed after Fraction × 10 minutes (less up to 1 % jitter). The
	// cycle measured must end before the next begins, so it should exceed
	// the time to write every Secret (about 3 calls per target at the
	// agent's 20 requests/s) plus a few seconds, e.g. 0.05 (30 s) for 100
	// targets.
	Fraction float64
	// Dir is a scratch directory for the PKI, configs and logs.
	Dir string
	// IdleSample, if set, is how long RSS is also sampled after the cycle,
	// once its broker connections have closed: the agent between
	// refreshes. The next cycle must not begin before it ends.
	IdleSample time.Duration
}

// Result is what Run measured.
type Result struct {
	Targets int `json:"targets"`
	// BrokerProcesses serve the targets; BrokerURLs is how many distinct
	// broker URLs the agent had (one per target).
	BrokerProcesses int     `json:"broker_processes"`
	BrokerURLs      int     `json:"broker_urls"`
	RefreshAfterS   float64 `json:"refresh_after_s"`
	// FirstSecretMs and AllSecretsMs are the time from starting the agent
	// process to its first and to its last output Secret created.
	FirstSecretMs float64 `json:"first_secret_ms"`
	AllSecretsMs  float64 `json:"all_secrets_ms"`
	// RSSPeakMB is the highest RSS sampled (every 50 ms) from the start to
	// the end of the cycle (or of the idle sample); RSSRefreshingMB the
	// median during the cycle, from the last first write to the last
	// revocation, while every target refreshes; RSSSteadyMB the median over
	// Options.IdleSample after the cycle, once its broker connections have
	// closed: the agent between refreshes, where it spends its time (0
	// without IdleSample).
	RSSPeakMB       float64 `json:"rss_peak_mb"`
	RSSRefreshingMB float64 `json:"rss_refreshing_mb"`
	RSSSteadyMB     float64 `json:"rss_steady_mb,omitempty"`
	// RSSRefreshingAnonMB and RSSSteadyAnonMB are their anonymous parts
	// (heap, stacks, the runtime's own); the rest is the binary's mapped
	// pages.
	RSSRefreshingAnonMB float64 `json:"rss_refreshing_anon_mb"`
	RSSSteadyAnonMB     float64 `json:"rss_steady_anon_mb,omitempty"`
	// HeapInuseMB, StackInuseMB and Goroutines are the agent's own, from
	// its /metrics after the cycle (and the idle sample).
	HeapInuseMB  float64 `json:"heap_inuse_mb"`
	StackInuseMB float64 `json:"stack_inuse_mb"`
	Goroutines   int     `json:"goroutines"`
	// StartupKubeCalls are the agent's requests to its API server, by verb,
	// from its start to the last Secret created; CycleKubeCalls those of one
	// refresh cycle: from then until every target was refreshed once and
	// every replaced lease revoked.
	StartupKubeCalls map[string]int `json:"startup_kube_calls"`
	CycleKubeCalls   map[string]int `json:"cycle_kube_calls"`
	// StartupBrokerCalls and CycleBrokerCalls are the brokers' answered
	// requests over the same spans, by "METHOD route".
	StartupBrokerCalls map[string]int `json:"startup_broker_calls"`
	CycleBrokerCalls   map[string]int `json:"cycle_broker_calls"`
	// CycleSeconds is the cycle's span, from the last first write to the
	// last revocation.
	CycleSeconds float64 `json:"cycle_s"`
	// KubeCallsPerTarget and BrokerCallsPerTarget are the cycle's calls
	// divided by Targets.
	KubeCallsPerTarget   float64 `json:"kube_calls_per_target_per_cycle"`
	BrokerCallsPerTarget float64 `json:"broker_calls_per_target_per_cycle"`
}

// Total sums calls by verb or route.
func Total(calls map[string]int) int {
	n := 0
	for _, v := range calls {
		n += v
	}
	return n
}

// AuditArgs writes an audit policy that records every request of AgentUser
// (metadata only, once per request) and nothing else, and returns the
// kube-apiserver arguments that use it and the log file they name.
func AuditArgs(dir string) (args []string, logFile string, err error) {
	pol := filepath.Join(dir, "audit-policy.yaml")
	if err := os.WriteFile(pol, []byte(`apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: ["`+AgentUser+`"]
  - level: None
`), 0o644); err != nil {
		return nil, "", err
	}
	logFile = filepath.Join(dir, "audit.log")
	return []string{"--audit-policy-file=" + pol, "--audit-log-path=" + logFile}, logFile, nil
}

// Run sets up the brokers and the agent's targets, starts the agent, waits
// for every Secret and for one whole refresh cycle, stops everything and
// returns the figures. It fails if the cycle overlapped the next one (a
// target refreshed twice before every target was refreshed once).
func Run(ctx context.Context, o Options) (*Result, error) {
	if o.Targets < 1 || o.Brokers < 1 || o.Fraction <= 0 || o.Fraction >= 1 {
		return nil, errors.New("agentscale: Targets and Brokers must be positive and Fraction in (0, 1)")
	}
	if o.Targets > 60000 {
		return nil, errors.New("agentscale: at most 60000 targets (one loopback address each)")
	}
	c := o.Cluster
	names := make([]string, o.Targets)
	for i := range names {
		names[i] = fmt.Sprintf("t-%05d", i)
	}
	kubeconfig, err := setUpCluster(ctx, c, names, o.Dir)
	if err != nil {
		return nil, fmt.Errorf("set up the cluster: %w", err)
	}
	// Each broker's API and operations ports, then the agent's.
	ports, err := freePorts(2*o.Brokers + 1)
	if err != nil {
		return nil, err
	}
	brokers, err := startBrokers(ctx, o, names, ports[:2*o.Brokers])
	if err != nil {
		return nil, err
	}
	defer func() {
		for _, b := range brokers {
			b.stop()
		}
	}()

	// The agent's config: target i asks for ServiceAccount names[i] at its
	// own loopback address of broker i mod Brokers.
	ops := fmt.Sprintf("127.0.0.1:%d", ports[2*o.Brokers])
	var cfg strings.Builder
	fmt.Fprintf(&cfg, "identity: {dir: %s}\n", filepath.Join(o.Dir, "identity"))
	fmt.Fprintf(&cfg, "refresh: {fraction: %g, jitter: 0.01, minBackoff: 500ms, maxBackoff: 5s, revokeGrace: %s}\n", o.Fraction, revokeGrace)
	fmt.Fprintf(&cfg, "kubeconfig: %s\nopsAddress: %q\ntargets:\n", kubeconfig, ops)
	for i, n := range names {
		fmt.Fprintf(&cfg, "  - name: %s\n    broker: https://%s:%d\n", n, targetIP(i), brokers[i%len(brokers)].port)
		fmt.Fprintf(&cfg, "    request: {namespace: %s, serviceAccount: %s, ttl: %s}\n", TargetNamespace, n, tokenTTL)
		fmt.Fprintf(&cfg, "    outputs: [{secret: {namespace: %s, name: %s, format: kubeconfig}}]\n", OutputNamespace, n)
	}
	cfgFile := filepath.Join(o.Dir, "agent.yaml")
	if err := os.WriteFile(cfgFile, []byte(cfg.String()), 0o600); err != nil {
		return nil, err
	}

	// Watch the outputs from before the start: the first event of each
	// Secret is its creation, the next its first refresh.
	w, err := c.Client.CoreV1().Secrets(OutputNamespace).Watch(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	defer w.Stop()

	logFile := filepath.Join(o.Dir, "agent.log")
	agent, err := startProcess(o.Bin, o.AgentEnv, logFile, "agent", "--config", cfgFile, "--log-level", "warn")
	if err != nil {
		return nil, err
	}
	defer agent.stop()
	fail := func(err error) (*Result, error) {
		return nil, fmt.Errorf("%w (agent log: %s)", err, logFile)
	}
	rss := sampleRSS(agent.cmd.Process.Pid)
	defer rss.stop()

	r := &Result{Targets: o.Targets, BrokerProcesses: o.Brokers, BrokerURLs: o.Targets,
		RefreshAfterS: o.Fraction * tokenTTL.Seconds()}
	events := map[string]int{}
	var first, allWritten time.Time
	next := func(deadline time.Time) (watch.Event, error) {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				return ev, errors.New("the watch of the output Secrets ended")
			}
			return ev, nil
		case err := <-agent.done:
			return watch.Event{}, fmt.Errorf("the agent exited: %v", err)
		case <-t.C:
			return watch.Event{}, errors.New("timed out")
		case <-ctx.Done():
			return watch.Event{}, ctx.Err()
		}
	}
	deadline := agent.started.Add(2*time.Minute + time.Duration(o.Targets)*100*time.Millisecond)
	for created := 0; created < o.Targets; {
		ev, err := next(deadline)
		if err != nil {
			return fail(fmt.Errorf("waiting for %d Secrets, %d created: %w", o.Targets, created, err))
		}
		s, ok := ev.Object.(*corev1.Secret)
		if !ok {
			continue
		}
		events[s.Name]++
		if ev.Type == watch.Added {
			created++
			if created == 1 {
				first = time.Now()
			}
		}
	}
	allWritten = time.Now()
	r.FirstSecretMs = ms(first.Sub(agent.started))
	r.AllSecretsMs = ms(allWritten.Sub(agent.started))
	brokersAtStart, err := brokerCalls(ctx, brokers)
	if err != nil {
		return fail(err)
	}

	// The cycle: every Secret changed once more (its refresh) and every
	// replaced lease revoked.
	period := time.Duration(o.Fraction * float64(tokenTTL))
	deadline = time.Now().Add(period + time.Duration(o.Targets)*200*time.Millisecond + time.Minute)
	refreshed := 0
	for _, n := range events {
		if n >= 2 {
			refreshed++
		}
	}
	for refreshed < o.Targets {
		ev, err := next(deadline)
		if err != nil {
			return fail(fmt.Errorf("waiting for %d refreshes, %d seen: %w", o.Targets, refreshed, err))
		}
		s, ok := ev.Object.(*corev1.Secret)
		if !ok || ev.Type != watch.Modified {
			continue
		}
		if events[s.Name]++; events[s.Name] == 2 {
			refreshed++
		}
	}
	// The revocations, as the brokers count them: scraping the agent
	// itself this often would add to what is measured.
	const revoke = "DELETE /v1/leases/{id}"
	for {
		calls, err := brokerCalls(ctx, brokers)
		if err != nil {
			return fail(err)
		}
		if calls[revoke]-brokersAtStart[revoke] >= o.Targets {
			break
		}
		if time.Now().After(deadline) {
			return fail(fmt.Errorf("%d of %d replaced leases revoked by the deadline", calls[revoke]-brokersAtStart[revoke], o.Targets))
		}
		time.Sleep(50 * time.Millisecond)
	}
	cycleEnd := time.Now()
	r.CycleSeconds = cycleEnd.Sub(allWritten).Seconds()
	brokersAtEnd, err := brokerCalls(ctx, brokers)
	if err != nil {
		return fail(err)
	}
	f := rss.figures(allWritten, cycleEnd)
	r.RSSPeakMB, r.RSSRefreshingMB, r.RSSRefreshingAnonMB = f.peak, f.median, f.medianAnon
	if o.IdleSample > 0 {
		// Once the last connections have idled out, until the next cycle.
		from := cycleEnd.Add(brokerIdleConnTimeout + time.Second)
		to := from.Add(o.IdleSample)
		select {
		case <-time.After(time.Until(to)):
		case <-ctx.Done():
			return fail(ctx.Err())
		}
		f := rss.figures(from, to)
		r.RSSPeakMB, r.RSSSteadyMB, r.RSSSteadyAnonMB = f.peak, f.median, f.medianAnon
	}
	// The agent's own figures, scraped once, after RSS was sampled.
	own, err := promtext.Get(ctx, "http://"+ops+"/metrics")
	if err != nil {
		return fail(err)
	}
	r.HeapInuseMB = sum(own["go_memstats_heap_inuse_bytes"]) / (1 << 20)
	r.StackInuseMB = sum(own["go_memstats_stack_inuse_bytes"]) / (1 << 20)
	r.Goroutines = int(sum(own["go_goroutines"]))
	// Events still queued belong to the cycle (or the idle time after it);
	// a third event of a Secret means the next cycle had begun.
	for drained := false; !drained; {
		select {
		case ev := <-w.ResultChan():
			if s, ok := ev.Object.(*corev1.Secret); ok {
				events[s.Name]++
			}
		default:
			drained = true
		}
	}
	for n, k := range events {
		if k > 2 {
			return fail(fmt.Errorf("Secret %s changed %d times: the next cycle began before this one ended; raise Fraction", n, k))
		}
	}
	agent.stop()

	r.StartupBrokerCalls = diff(brokersAtStart, nil)
	r.CycleBrokerCalls = diff(brokersAtEnd, brokersAtStart)
	r.StartupKubeCalls, r.CycleKubeCalls, err = auditCalls(o.AuditLog, allWritten, cycleEnd)
	if err != nil {
		return fail(err)
	}
	r.KubeCallsPerTarget = float64(Total(r.CycleKubeCalls)) / float64(o.Targets)
	r.BrokerCallsPerTarget = float64(Total(r.CycleBrokerCalls)) / float64(o.Targets)
	return r, nil
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// targetIP is target i's loopback address: 127.1.0.1, 127.1.0.2, …
func targetIP(i int) net.IP {
	n := i + 1
	return net.IPv4(127, 1, byte(n>>8), byte(n))
}

// setUpCluster makes the targets' ServiceAccounts, the agent's
// ServiceAccount with its Role, and a kubeconfig for it; it returns the
// kubeconfig's path.
func setUpCluster(ctx context.Context, c *testcluster.Cluster, names []string, dir string) (string, error) {
	core := c.Client.CoreV1()
	for _, ns := range []string{TargetNamespace, OutputNamespace} {
		if _, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			return "", err
		}
	}
	for _, n := range append(slices.Clone(names), "") {
		ns, name := TargetNamespace, n
		if n == "" {
			ns, name = OutputNamespace, agentSA
		}
		if _, err := core.ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
			return "", err
		}
	}
	// What deploy/agent grants for Secret outputs.
	if _, err := c.Client.RbacV1().Roles(OutputNamespace).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: agentSA},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "create", "update"}}},
	}, metav1.CreateOptions{}); err != nil {
		return "", err
	}
	if _, err := c.Client.RbacV1().RoleBindings(OutputNamespace).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: agentSA},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: agentSA},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: agentSA, Namespace: OutputNamespace}},
	}, metav1.CreateOptions{}); err != nil {
		return "", err
	}
	exp := int64(3600)
	tr, err := core.ServiceAccounts(OutputNamespace).CreateToken(ctx, agentSA,
		&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		return "", err
	}
	kc := clientcmdapi.NewConfig()
	kc.Clusters["source"] = &clientcmdapi.Cluster{Server: c.URL, CertificateAuthorityData: c.CAData}
	kc.AuthInfos[agentSA] = &clientcmdapi.AuthInfo{Token: tr.Status.Token}
	kc.Contexts["source"] = &clientcmdapi.Context{Cluster: "source", AuthInfo: agentSA}
	kc.CurrentContext = "source"
	path := filepath.Join(dir, "agent.kubeconfig")
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return "", err
	}
	return path, os.Chmod(path, 0o600)
}

// startBrokers writes the PKI (a CA, a server certificate for every
// target's address, the agent's identity directory) and the policy, starts
// o.Brokers brokers, broker b with its API on every address at port
// ports[2b] and its operations listener on 127.0.0.1:ports[2b+1], and
// returns them once they are ready.
func startBrokers(ctx context.Context, o Options, names []string, ports []int) ([]*process, error) {
	f := func(n string) string { return filepath.Join(o.Dir, n) }
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "agentscale CA"})
	if err != nil {
		return nil, err
	}
	if err := ca.WriteFiles(f("ca.crt"), f("ca.key")); err != nil {
		return nil, err
	}
	ips := []net.IP{net.IPv4(127, 0, 0, 1)}
	for i := range names {
		ips = append(ips, targetIP(i))
	}
	srv, err := ca.IssueServer(pki.ServerOptions{IPAddresses: ips})
	if err != nil {
		return nil, err
	}
	if err := srv.WriteFiles(f("server.crt"), f("server.key")); err != nil {
		return nil, err
	}
	id, err := pki.ClusterIdentity(trustDomain, "source")
	if err != nil {
		return nil, err
	}
	cli, err := ca.IssueClient(pki.ClientOptions{Identity: id})
	if err != nil {
		return nil, err
	}
	idDir := f("identity")
	if err := os.MkdirAll(idDir, 0o700); err != nil {
		return nil, err
	}
	if err := cli.WriteFiles(filepath.Join(idDir, "tls.crt"), filepath.Join(idDir, "tls.key")); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(idDir, "ca.crt"), ca.CertPEM(), 0o644); err != nil {
		return nil, err
	}
	if err := os.WriteFile(f("cluster-ca.crt"), o.Cluster.CAData, 0o644); err != nil {
		return nil, err
	}
	pol := fmt.Sprintf(`cluster: {name: target, server: %q, caFile: cluster-ca.crt}
ttl: {default: 10m, max: 1h}
limits: {issuancesPerMinute: 1000000, burst: 1000000, maxLiveLeases: 1000000, leaseReadsPerMinute: 1000000, leaseReadsInFlight: 1000000}
peers:
  - name: source
    identity: %s
    grants:
      - namespaces: [%s]
        serviceAccounts: [%s]
`, o.Cluster.URL, id, TargetNamespace, strings.Join(names, ", "))
	if err := os.WriteFile(f("policy.yaml"), []byte(pol), 0o644); err != nil {
		return nil, err
	}

	var procs []*process
	stop := func() {
		for _, p := range procs {
			p.stop()
		}
	}
	for b := range o.Brokers {
		// All addresses: the targets' loopback addresses reach it.
		port := ports[2*b]
		api := fmt.Sprintf(":%d", port)
		ops := fmt.Sprintf("127.0.0.1:%d", ports[2*b+1])
		p, err := startProcess(o.Bin, nil, f(fmt.Sprintf("broker-%d.log", b)), "serve",
			"--listen-address", api, "--ops-address", ops,
			"--tls-cert-file", f("server.crt"), "--tls-key-file", f("server.key"),
			"--client-ca-file", f("ca.crt"), "--policy-file", f("policy.yaml"),
			"--kubeconfig", o.Cluster.KubeconfigPath, "--log-level", "warn", "--max-live-leases", "1000000")
		if err != nil {
			stop()
			return nil, err
		}
		p.ops, p.port = ops, port
		procs = append(procs, p)
	}
	for _, p := range procs {
		if err := waitOK(ctx, "http://"+p.ops+"/readyz", p, 60*time.Second); err != nil {
			stop()
			return nil, fmt.Errorf("broker: %w (log: %s)", err, p.log)
		}
	}
	return procs, nil
}
