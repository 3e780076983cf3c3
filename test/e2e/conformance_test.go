package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tokenbroker/tokenbroker/test/conformance/consumers/check"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// The consumers whose own code loads the agent's Secrets. Each is a
// checker program in a nested module of test/conformance/consumers, pinned
// to the consumer's release (docs/testing.md, "Conformance").
const (
	consumerAdmiralty = "admiralty" // mirror of Admiralty v0.17.0's loader
	consumerArgoCD    = "argocd"    // github.com/argoproj/argo-cd/v3 v3.2.12
	consumerFlux      = "flux"      // github.com/fluxcd/pkg/runtime v0.110.3
	consumerKargo     = "kargo"     // mirror of Kargo v1.11.2's loader
)

// consumerBinary builds a consumer checker into the bin directory (a cache
// hit after `make conformance-bins`) and returns its path.
func consumerBinary(t *testing.T, consumer string) string {
	t.Helper()
	dir := os.Getenv(testcluster.BinDirEnv)
	if dir == "" {
		dir = filepath.Join(repoRoot(t), "bin")
	}
	p := filepath.Join(dir, "conformance-"+consumer)
	// The flags of make conformance-bins, so that a binary it built is up
	// to date here rather than linked again.
	cmd := exec.Command("go", "build", "-ldflags", "-s -w", "-o", p, ".")
	cmd.Dir = filepath.Join(repoRoot(t), "test", "conformance", "consumers", consumer)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "build the %s checker:\n%s", consumer, out)
	return p
}

// consumerBinaries builds the checkers of consumers in the background; the
// map holds their paths once wait has returned.
func consumerBinaries(t *testing.T, consumers ...string) (bins map[string]string, wait func()) {
	t.Helper()
	bins = map[string]string{}
	var mu sync.Mutex
	var built sync.WaitGroup
	for _, c := range consumers {
		built.Go(func() {
			p := consumerBinary(t, c)
			mu.Lock()
			bins[c] = p
			mu.Unlock()
		})
	}
	return bins, built.Wait
}

// consumerCheck is one Secret loaded by one consumer.
type consumerCheck struct {
	consumer  string
	namespace string // of the Secret, in west
	name      string
	key       string // secretRef.key or kubeconfigSecret.key; "" for the default
}

func (c consumerCheck) String() string {
	s := c.consumer + " reads " + c.namespace + "/" + c.name
	if c.key != "" {
		s += " key " + c.key
	}
	return s
}

// run loads the Secret (or another of that name) with the consumer's code
// and lists ConfigMaps in east's namespace argo with the client it got.
// impersonate, if not "", is a ServiceAccount for Flux to impersonate.
func (c consumerCheck) run(t *testing.T, bins map[string]string, source *testcluster.Cluster, name, impersonate string) check.Result {
	t.Helper()
	args := check.Args{Kubeconfig: source.KubeconfigPath, Namespace: c.namespace, Name: name, Key: c.key, ListNamespace: "argo", ServiceAccount: impersonate}
	stdout, stderr, err := runErr(bins[c.consumer], args.CommandLine()...)
	require.NoError(t, err, "%s refused the Secret %s: %s", c.consumer, name, stderr)
	var r check.Result
	require.NoError(t, json.Unmarshal([]byte(stdout), &r), stdout)
	return r
}

// TestConsumersLoadTheAgentsSecretsWithTheirOwnCode is the conformance
// test of issue 11: a real broker in east, a real agent in west writing
// every Secret format, and each consumer's production loader (or, where
// its module cannot be required, a named mirror of it) turning the Secret
// into a client that lists ConfigMaps in east as the granted
// ServiceAccount. East sits behind a name its certificate does not carry,
// reached through an HTTP CONNECT proxy: a client that ignored the
// kubeconfig's proxy-url could not resolve the name, and one that ignored
// tls-server-name could not verify the certificate.
func TestConsumersLoadTheAgentsSecretsWithTheirOwnCode(t *testing.T) {
	t.Parallel()
	bins, built := consumerBinaries(t, consumerAdmiralty, consumerArgoCD, consumerFlux, consumerKargo)
	east, west := startTwoClusters(t)
	setUpTarget(t, east)
	built()

	// east's API server as peers see it: https://east.tokenbroker.test,
	// a name only the proxy knows, with SNI kubernetes.default (in the
	// serving certificate; east.tokenbroker.test is not).
	eastPort := strings.TrimPrefix(east.URL, "https://127.0.0.1:")
	proxy := startConnectProxy(t, "east.tokenbroker.test:"+eastPort, "127.0.0.1:"+eastPort)
	e := newBrokerEnv(t, east)
	writeFile(t, e.policy, fmt.Sprintf(`cluster:
  name: east
  server: https://east.tokenbroker.test:%s
  tlsServerName: kubernetes.default
  proxyURL: http://%s
  caFile: cluster-ca.crt
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://e2e.example/cluster/west
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
`, eastPort, proxy.addr))
	e.launch(t)

	// west: the agent's identity (the west client certificate of
	// startBroker), the consumers' namespaces, and the agent.
	idDir := t.TempDir()
	for src, dst := range map[string]string{"west.crt": "tls.crt", "west.key": "tls.key", filepath.Join("pki", "ca.crt"): "ca.crt"} {
		raw, err := os.ReadFile(filepath.Join(e.dir, src))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(idDir, dst), raw, 0o600))
	}
	for _, ns := range []string{"admiralty", "argocd", "flux-system", "kargo", "tenant"} {
		_, err := west.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	checks := []consumerCheck{
		{consumer: consumerAdmiralty, namespace: "admiralty", name: "east"},
		{consumer: consumerArgoCD, namespace: "argocd", name: "east"},
		{consumer: consumerFlux, namespace: "flux-system", name: "east"},
		{consumer: consumerFlux, namespace: "flux-system", name: "east-yaml"},
		{consumer: consumerFlux, namespace: "tenant", name: "east", key: "kubeconfig"},
		{consumer: consumerKargo, namespace: "kargo", name: "east"},
	}
	const grace = 20 * time.Second
	ops := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cfg := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), fmt.Sprintf(`identity:
  dir: %s
refresh: {fraction: 0.02, jitter: 0.01, minBackoff: 500ms, maxBackoff: 2s, revokeGrace: %s}
targets:
  - name: east
    broker: https://%s
    request: {namespace: argo, serviceAccount: runner, ttl: 10m}
    outputs:
      - secret: {namespace: admiralty, name: east, format: admiralty}
      - secret: {namespace: argocd, name: east, format: argocd, argocd: {project: team-a, namespaces: [argo], shard: 1}}
      - secret: {namespace: flux-system, name: east, format: flux}
      - secret: {namespace: flux-system, name: east-yaml, format: flux, key: value.yaml}
      - secret: {namespace: tenant, name: east, format: kubeconfig, key: kubeconfig, labels: {reconcile.fluxcd.io/watch: Enabled}}
      - secret: {namespace: kargo, name: east, format: kubeconfig, key: kubeconfig.yaml}
  # Argo CD's exec mode: the Secret names the plugin, which Argo CD's own
  # code runs in the checker's process.
  - name: east-exec
    broker: https://%s
    request: {namespace: argo, serviceAccount: runner, ttl: 10m}
    outputs:
      - secret:
          namespace: argocd
          name: east-exec
          format: argocd
          argocd: {exec: {command: %s, identityDir: %s, env: {XDG_CACHE_HOME: %s}}}
kubeconfig: %s
opsAddress: %q
`, idDir, grace, e.api, e.api, tokenbrokerBinary(t), idDir, t.TempDir(), west.KubeconfigPath, ops))
	first := watchAdded(t, west, "kargo", "east")
	agentProc := startAgent(t, cfg)
	waitTime(t, first, agentSecretsWait, "the agent's first Secrets")
	agentProc.waitReady(t)

	// Before the first refresh (about 12 s after the first write): keep a
	// copy of each Secret as it is (the previous credential, for the grace
	// check) and add what others add to the real one.
	lease1 := getSecret(t, west, "kargo", "east").Annotations[annLeaseID]
	for _, c := range checks {
		s := getSecret(t, west, c.namespace, c.name)
		require.Equal(t, lease1, s.Annotations[annLeaseID], c.String())
		prev := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: c.namespace, Name: c.name + "-previous"}, Data: s.Data}
		_, err := west.Client.CoreV1().Secrets(c.namespace).Create(context.Background(), prev, metav1.CreateOptions{})
		require.NoError(t, err)
		s.Data["foreign"] = []byte("kept")
		if c.consumer == consumerArgoCD {
			s.Data["clusterResources"] = []byte("true") // as `argocd cluster set` would
		}
		s.Labels["example.com/team"] = "a"
		_, err = west.Client.CoreV1().Secrets(c.namespace).Update(context.Background(), s, metav1.UpdateOptions{})
		require.NoError(t, err, c.String())
	}

	t.Run("each consumer's own loader reaches east through the proxy with the SNI name, as the granted ServiceAccount", func(t *testing.T) {
		before := proxy.tunnels.Load()
		for _, c := range checks {
			r := c.run(t, bins, west, c.name, "")
			require.Equal(t, 200, r.Status, "%s: %s", c, r.Error)
			require.Contains(t, r.ConfigMaps, "hello", c.String())
		}
		require.GreaterOrEqual(t, proxy.tunnels.Load()-before, int64(len(checks)), "every consumer went through proxy-url")
	})

	t.Run("Argo CD reads the options the agent writes and the keys others added", func(t *testing.T) {
		r := consumerCheck{consumer: consumerArgoCD, namespace: "argocd"}.run(t, bins, west, "east", "")
		require.Equal(t, "https://east.tokenbroker.test:"+eastPort, r.Server)
		require.Equal(t, map[string]any{
			"name": "east", "server": "https://east.tokenbroker.test:" + eastPort, "project": "team-a",
			"namespaces": []any{"argo"}, "clusterResources": true, "shard": float64(1),
			"serverName": "kubernetes.default", "proxyUrl": "http://" + proxy.addr,
			"hasBearerToken": true, "hasCAData": true, "insecure": false,
		}, r.Cluster)
	})

	t.Run("Argo CD runs tokenbroker credential from an exec-mode Secret that holds no credential and does not change", func(t *testing.T) {
		held := getSecret(t, west, "argocd", "east-exec")
		require.NotContains(t, string(held.Data["config"]), "bearerToken")
		execCheck := consumerCheck{consumer: consumerArgoCD, namespace: "argocd", name: "east-exec"}
		r := execCheck.run(t, bins, west, "east-exec", "")
		require.Equal(t, 200, r.Status, "Argo CD's RESTConfig ran the plugin: %s", r.Error)
		require.Contains(t, r.ConfigMaps, "hello")
		require.Equal(t, false, r.Cluster["hasBearerToken"])
		require.Equal(t, "kubernetes.default", r.Cluster["serverName"])
		// The agent's own lease for the target only told it the cluster
		// entry: revoked once the Secret was written.
		require.Eventually(t, func() bool { return !slices.Contains(leaseIDs(t, e, idDir), held.Annotations[annLeaseID]) },
			10*time.Second, 200*time.Millisecond, "the agent revokes the lease of an exec-mode target at once")
		// A refresh of the target changes nothing Argo CD reads.
		next := waitSecret(t, west, "argocd", "east-exec", 30*time.Second, func(s *corev1.Secret) bool { return s.Annotations[annLeaseID] != held.Annotations[annLeaseID] })
		require.Equal(t, held.Data, next.Data, "config, server and name are the same after a refresh")
		r = execCheck.run(t, bins, west, "east-exec", "")
		require.Equal(t, 200, r.Status, r.Error)
	})

	t.Run("Flux impersonating a ServiceAccount on the target needs the impersonate RBAC the Flux guide gives", func(t *testing.T) {
		flux := checks[2]
		const impersonate = "flux-reconciler"
		r := flux.run(t, bins, west, flux.name, impersonate)
		require.Equal(t, http.StatusForbidden, r.Status, "runner may not impersonate yet: %s", r.Error)
		grantImpersonation(t, east, "argo", "runner", flux.namespace, "flux-reconciler")
		require.Eventually(t, func() bool { return flux.run(t, bins, west, flux.name, impersonate).Status == 200 },
			10*time.Second, 200*time.Millisecond, "with the guide's RBAC Flux lists ConfigMaps as system:serviceaccount:flux-system:flux-reconciler")
	})

	t.Run("after a refresh the consumers get a working new credential, the old one works until the grace ends and is refused after it", func(t *testing.T) {
		sec := waitSecret(t, west, "kargo", "east", 30*time.Second, func(s *corev1.Secret) bool { return s.Annotations[annLeaseID] != lease1 })
		switched := time.Now()
		for _, c := range checks {
			s := getSecret(t, west, c.namespace, c.name)
			require.NotEqual(t, lease1, s.Annotations[annLeaseID], "%s: every output holds the new lease", c)
			require.Equal(t, "kept", string(s.Data["foreign"]), "%s: a key the agent does not own survives the refresh", c)
			require.Equal(t, "a", s.Labels["example.com/team"], "%s: so does a label", c)
			r := c.run(t, bins, west, c.name, "")
			require.Equal(t, 200, r.Status, "%s with the new credential: %s", c, r.Error)
			prev := c.run(t, bins, west, c.name+"-previous", "")
			require.Equal(t, 200, prev.Status, "%s: the previous credential works during the grace: %s", c, prev.Error)
		}
		require.Less(t, time.Since(switched), grace, "the checks above ran within the grace")
		t.Logf("lease %s replaced by %s; all %d loads with both credentials took %s", lease1, sec.Annotations[annLeaseID], 2*len(checks), time.Since(switched).Round(time.Millisecond))

		for _, c := range checks {
			require.Eventually(t, func() bool { return c.run(t, bins, west, c.name+"-previous", "").Status == http.StatusUnauthorized },
				grace+30*time.Second, 500*time.Millisecond, "%s: the previous credential is refused once the grace is over", c)
		}
		refused := time.Since(switched)
		require.GreaterOrEqual(t, refused, grace, "not refused before the grace ended")
		t.Logf("every consumer's previous credential was refused %s after the switch (grace %s, then the API server's token cache)", refused.Round(100*time.Millisecond), grace)
		for _, c := range checks {
			r := c.run(t, bins, west, c.name, "")
			require.Equal(t, 200, r.Status, "%s re-reading the Secret still works: %s", c, r.Error)
		}
	})
}

// grantImpersonation is docs/guides/flux.md's RBAC for a Kustomization in
// west's namespace kustomizationNS that impersonates target: in east, the
// ServiceAccount namespace/sa that the kubeconfig holds may impersonate
// system:serviceaccount:<kustomizationNS>:<target> (a user of east; no
// such ServiceAccount need exist there), and that user may read ConfigMaps
// in namespace.
func grantImpersonation(t *testing.T, c *testcluster.Cluster, namespace, sa, kustomizationNS, target string) {
	t.Helper()
	ctx := context.Background()
	rbac := c.Client.RbacV1()
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: kustomizationNS}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = rbac.Roles(kustomizationNS).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: sa + "-impersonate"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"serviceaccounts"},
			Verbs: []string{"impersonate"}, ResourceNames: []string{target}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	bind := func(ns, name, role string, subject rbacv1.Subject) {
		_, err := rbac.RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: role},
			Subjects:   []rbacv1.Subject{subject},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	bind(kustomizationNS, sa+"-impersonate", sa+"-impersonate", rbacv1.Subject{Kind: "ServiceAccount", Name: sa, Namespace: namespace})
	bind(namespace, target+"-view", "configmap-reader", rbacv1.Subject{Kind: "ServiceAccount", Name: target, Namespace: kustomizationNS})
}

// connectProxy is an HTTP CONNECT proxy that opens tunnels to one host
// only, the way a corporate proxy or an SNI router reaches an API server
// under a name of its own. It counts the tunnels it opened.
type connectProxy struct {
	addr    string
	tunnels atomic.Int64
}

func startConnectProxy(t *testing.T, host, target string) *connectProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &connectProxy{addr: ln.Addr().String()}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { p.serve(conn, host, target) })
		}
	})
	return p
}

func (p *connectProxy) serve(conn net.Conn, host, target string) {
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(time.Minute))
	br := bufio.NewReader(conn)
	req, err := http.ReadRequest(br)
	if err != nil {
		return
	}
	if req.Method != http.MethodConnect || req.Host != host {
		_, _ = io.WriteString(conn, "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
		return
	}
	up, err := net.Dial("tcp", target)
	if err != nil {
		_, _ = io.WriteString(conn, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
		return
	}
	defer up.Close()
	p.tunnels.Add(1)
	if _, err := io.WriteString(conn, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, br); done <- struct{}{} }()
	go func() { _, _ = io.Copy(conn, up); done <- struct{}{} }()
	<-done
}
