package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// brokerEnv is a running broker process with its PKI on disk.
type brokerEnv struct {
	dir, api, ops string
	ca            string // CA bundle that verifies the broker
	proc          *process
	startup       time.Duration
	bin           string
	args          []string // serve's arguments but the listen addresses
	policy        string   // the policy file
}

// curl calls the broker as the given client (cert/key file prefix, or ""
// for no client certificate) and returns the status code and body.
func (e *brokerEnv) curl(t *testing.T, client string, args ...string) (int, string, error) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "body")
	a := []string{"-sS", "--cacert", e.ca, "-o", out, "-w", "%{http_code}"}
	if client != "" {
		a = append(a, "--cert", client+".crt", "--key", client+".key")
	}
	a = append(a, args...)
	code, stderr, err := runErr("curl", a...)
	body, _ := os.ReadFile(out)
	if err != nil {
		return 0, stderr, err
	}
	var status int
	_, _ = fmt.Sscanf(code, "%d", &status)
	return status, string(body), nil
}

func (e *brokerEnv) postKubeconfig(t *testing.T, client, body string, extra ...string) (int, string) {
	t.Helper()
	args := append([]string{"-H", "Content-Type: application/json", "-d", body}, extra...)
	args = append(args, "https://"+e.api+"/v1/kubeconfigs")
	status, out, err := e.curl(t, client, args...)
	require.NoError(t, err, out)
	return status, out
}

// requireLog waits for the broker to log a line containing text. The TLS
// 1.3 client learns of a refused certificate only after its handshake, so
// curl's own message varies (alert, reset, not connected); the broker's
// log says why it refused.
func (e *brokerEnv) requireLog(t *testing.T, text string) {
	t.Helper()
	require.Eventually(t, func() bool { return strings.Contains(e.proc.logs.String(), text) },
		5*time.Second, 20*time.Millisecond, "broker never logged %q", text)
}

// handshakeFailures is the broker's
// tokenbroker_tls_handshake_failures_total on the API listener for reason.
func (e *brokerEnv) handshakeFailures(t *testing.T, reason string) float64 {
	t.Helper()
	out := run(t, "curl", "-sSf", "http://"+e.ops+"/metrics")
	want := `tokenbroker_tls_handshake_failures_total{listener="api",reason="` + reason + `"} `
	for _, line := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(line, want); ok {
			var f float64
			_, err := fmt.Sscanf(v, "%g", &f)
			require.NoError(t, err, line)
			return f
		}
	}
	return 0
}

// requireHandshakeFailure waits for the count of refused handshakes for
// reason to pass before. (The log of them is rate-limited; the count is
// not.)
func (e *brokerEnv) requireHandshakeFailure(t *testing.T, reason string, before float64) {
	t.Helper()
	require.Eventually(t, func() bool { return e.handshakeFailures(t, reason) > before },
		5*time.Second, 20*time.Millisecond, "tokenbroker_tls_handshake_failures_total{reason=%q} stays at %g", reason, before)
}

func setUpTarget(t *testing.T, c *testcluster.Cluster) {
	t.Helper()
	ctx := context.Background()
	mk := func(err error) { require.NoError(t, err) }
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "argo"}}, metav1.CreateOptions{})
	mk(err)
	_, err = c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	mk(err)
	_, err = c.Client.RbacV1().Roles("argo").Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "configmap-reader"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list"}}},
	}, metav1.CreateOptions{})
	mk(err)
	_, err = c.Client.RbacV1().RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "runner-view"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "configmap-reader"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "runner", Namespace: "argo"}},
	}, metav1.CreateOptions{})
	mk(err)
	_, err = c.Client.CoreV1().ConfigMaps("argo").Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "hello"}, Data: map[string]string{"k": "v"},
	}, metav1.CreateOptions{})
	mk(err)
}

// startBroker makes a PKI with the tokenbroker pki commands and starts
// "tokenbroker serve" against c, with extra serve arguments if given.
func startBroker(t *testing.T, c *testcluster.Cluster, extra ...string) *brokerEnv {
	t.Helper()
	e := newBrokerEnv(t, c, extra...)
	e.launch(t)
	t.Logf("broker ready %s after start", e.startup.Round(time.Millisecond))
	return e
}

// newBrokerEnv makes startBroker's PKI, policy and arguments without
// starting the broker, for a test that changes them first.
func newBrokerEnv(t *testing.T, c *testcluster.Cluster, extra ...string) *brokerEnv {
	t.Helper()
	bin := tokenbrokerBinary(t)
	dir := t.TempDir()
	pkiDir := filepath.Join(dir, "pki")
	run(t, bin, "pki", "init", "--dir", pkiDir)
	run(t, bin, "pki", "issue", "server", "--ca-dir", pkiDir, "--ip", "127.0.0.1", "--dns", "localhost")
	for _, peer := range []string{"west", "rogue"} {
		run(t, bin, "pki", "issue", "client", "--ca-dir", pkiDir, "--trust-domain", "e2e.example", "--cluster", peer,
			"--out-cert", filepath.Join(dir, peer+".crt"), "--out-key", filepath.Join(dir, peer+".key"))
	}
	// A client certificate for the same identity from a CA the broker does
	// not trust.
	otherDir := filepath.Join(dir, "other")
	run(t, bin, "pki", "init", "--dir", otherDir)
	run(t, bin, "pki", "issue", "client", "--ca-dir", otherDir, "--trust-domain", "e2e.example", "--cluster", "west",
		"--out-cert", filepath.Join(dir, "impostor.crt"), "--out-key", filepath.Join(dir, "impostor.key"))

	writeFile(t, filepath.Join(dir, "cluster-ca.crt"), string(c.CAData))
	pol := writeFile(t, filepath.Join(dir, "policy.yaml"), fmt.Sprintf(`cluster:
  name: east
  server: %s
  caFile: cluster-ca.crt
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://e2e.example/cluster/west
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
        maxTTL: 12h
`, c.URL))
	e := &brokerEnv{
		dir:    dir,
		api:    fmt.Sprintf("127.0.0.1:%d", freePort(t)),
		ops:    fmt.Sprintf("127.0.0.1:%d", freePort(t)),
		ca:     filepath.Join(pkiDir, "ca.crt"),
		bin:    bin,
		policy: pol,
		args: append([]string{
			"--tls-cert-file", filepath.Join(pkiDir, "server.crt"), "--tls-key-file", filepath.Join(pkiDir, "server.key"),
			"--client-ca-file", filepath.Join(pkiDir, "ca.crt"), "--policy-file", pol, "--kubeconfig", c.KubeconfigPath,
		}, extra...),
	}
	return e
}

// launch starts "tokenbroker serve" on e's addresses and waits until it is
// ready.
func (e *brokerEnv) launch(t *testing.T) {
	t.Helper()
	start := time.Now()
	e.proc = startProcess(t, e.bin, append([]string{"serve", "--listen-address", e.api, "--ops-address", e.ops}, e.args...)...)
	waitReady(t, e.proc, "http://"+e.ops+"/readyz")
	e.startup = time.Since(start)
}

// replica starts a second broker with the same PKI, policy and cluster on
// other ports.
func (e *brokerEnv) replica(t *testing.T) *brokerEnv {
	t.Helper()
	r := *e
	r.api = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	r.ops = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	r.launch(t)
	return &r
}

func TestBrokerEndToEnd(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startBroker(t, c)
	kubectl := kubectlBinary(t)
	west := filepath.Join(e.dir, "west")

	t.Run("curl gets a kubeconfig that real kubectl uses as the ServiceAccount", func(t *testing.T) {
		kc := filepath.Join(t.TempDir(), "kubeconfig")
		// The command as docs/api.md shows it.
		run(t, "curl", "-sS", "--fail-with-body", "--cert", west+".crt", "--key", west+".key", "--cacert", e.ca,
			"-H", "Content-Type: application/json", "-H", "Accept: application/yaml",
			"-d", `{"namespace":"argo","serviceAccount":"runner","ttl":"2h"}`,
			"https://"+e.api+"/v1/kubeconfigs", "-o", kc)

		out := run(t, kubectl, "--kubeconfig", kc, "auth", "whoami", "-o", "json")
		var who struct {
			Status struct {
				UserInfo struct{ Username string } `json:"userInfo"`
			} `json:"status"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &who), out)
		require.Equal(t, "system:serviceaccount:argo:runner", who.Status.UserInfo.Username)

		out = run(t, kubectl, "--kubeconfig", kc, "get", "configmaps", "-o", "name")
		require.Contains(t, out, "configmap/hello")

		_, stderr, err := runErr(kubectl, "--kubeconfig", kc, "get", "secrets")
		require.Error(t, err, "RBAC must still confine the ServiceAccount")
		require.Contains(t, stderr, "forbidden")
	})

	t.Run("every decision is in the audit trail, joined to the API server's by the token's jti", func(t *testing.T) {
		testAuditTrail(t, e, kubectl)
	})

	t.Run("a TTL over the grant is clamped and says so", func(t *testing.T) {
		status, body := e.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner","ttl":"48h"}`)
		require.Equal(t, 201, status, body)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(body), &resp))
		require.Equal(t, "grant.maxTTL", resp.ClampedBy)
		require.Equal(t, "12h0m0s", resp.GrantedTTL)
		require.Equal(t, "48h0m0s", resp.RequestedTTL)
	})

	problem := func(t *testing.T, body string, status int) apiv1.Problem {
		t.Helper()
		var p apiv1.Problem
		require.NoError(t, json.Unmarshal([]byte(body), &p), body)
		require.Equal(t, status, p.Status)
		require.True(t, strings.HasPrefix(p.Type, "urn:tokenbroker:problem:"), p.Type)
		return p
	}

	t.Run("a minTTL above what can be granted is refused with 422", func(t *testing.T) {
		status, body := e.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner","ttl":"24h","minTTL":"13h"}`)
		require.Equal(t, 422, status, body)
		problem(t, body, 422)
	})

	t.Run("a namespace outside the grant is forbidden", func(t *testing.T) {
		status, body := e.postKubeconfig(t, west, `{"namespace":"kube-system","serviceAccount":"runner"}`)
		require.Equal(t, 403, status, body)
		problem(t, body, 403)
	})

	t.Run("a peer with no grant is forbidden with the same body", func(t *testing.T) {
		status, body := e.postKubeconfig(t, filepath.Join(e.dir, "rogue"), `{"namespace":"argo","serviceAccount":"runner"}`)
		require.Equal(t, 403, status, body)
		p := problem(t, body, 403)
		_, other := e.postKubeconfig(t, west, `{"namespace":"kube-system","serviceAccount":"runner"}`)
		q := problem(t, other, 403)
		require.Equal(t, p.Detail, q.Detail)
		require.Equal(t, p.Title, q.Title)
	})

	t.Run("malformed JSON is a 400", func(t *testing.T) {
		status, body := e.postKubeconfig(t, west, `{"namespace":"argo",`)
		require.Equal(t, 400, status, body)
		problem(t, body, 400)
	})

	// Each refused handshake is counted by reason and logged with the
	// reason (and the presented identity, nothing else of the certificate).
	for _, tc := range []struct {
		name, client, reason string
		extra                []string
	}{
		{name: "no client certificate is refused in the TLS handshake", reason: "no_certificate"},
		{name: "a certificate from another CA is refused in the TLS handshake", client: filepath.Join(e.dir, "impostor"), reason: "unknown_authority"},
		{name: "a TLS 1.2 client is refused in the TLS handshake", client: west, reason: "protocol_version", extra: []string{"--tls-max", "1.2"}},
		// curl (OpenSSL) aborts with an alert the Go server reads as a bad
		// record MAC, not as the peer's alert; Go clients' refusals count as
		// refused_by_client (server/listener_test.go).
		{name: "a client that does not trust the broker's CA aborts the handshake", client: west, reason: "other",
			extra: []string{"--cacert", filepath.Join(e.dir, "other", "ca.crt")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := e.handshakeFailures(t, tc.reason)
			status, stderr, err := e.curl(t, tc.client, append(tc.extra, "https://"+e.api+"/v1/whoami")...)
			require.Error(t, err, "got HTTP %d", status)
			t.Logf("curl: %s", strings.TrimSpace(stderr))
			e.requireHandshakeFailure(t, tc.reason, before)
		})
	}
	e.requireLog(t, `"identity":"spiffe://e2e.example/cluster/west"`)

	t.Run("whoami shows the identity and grants", func(t *testing.T) {
		status, body, err := e.curl(t, west, "https://"+e.api+"/v1/whoami")
		require.NoError(t, err)
		require.Equal(t, 200, status, body)
		var who apiv1.WhoAmI
		require.NoError(t, json.Unmarshal([]byte(body), &who))
		require.Equal(t, "spiffe://e2e.example/cluster/west", who.Identity)
		require.Equal(t, "west", who.Peer)
		require.Len(t, who.Grants, 1)
	})

	t.Run("leases are listed and revoked with curl", func(t *testing.T) {
		status, body := e.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner"}`)
		require.Equal(t, 201, status, body)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(body), &resp))
		status, body, err := e.curl(t, west, "https://"+e.api+"/v1/leases")
		require.NoError(t, err)
		require.Equal(t, 200, status)
		require.Contains(t, body, resp.LeaseID)
		status, body, err = e.curl(t, west, "-X", "DELETE", "https://"+e.api+"/v1/leases/"+resp.LeaseID)
		require.NoError(t, err)
		require.Equal(t, 204, status, body)
		status, _, err = e.curl(t, west, "https://"+e.api+"/v1/leases/"+resp.LeaseID)
		require.NoError(t, err)
		require.Equal(t, 404, status)
	})

	t.Run("the operations listener serves metrics", func(t *testing.T) {
		out := run(t, "curl", "-sSf", "http://"+e.ops+"/metrics")
		require.Contains(t, out, `tokenbroker_issuances_total{outcome="granted"}`)
		require.Contains(t, out, `tokenbroker_issuances_total{outcome="denied"}`)
		run(t, "curl", "-sSf", "http://"+e.ops+"/healthz")
		requireDocumentedExposition(t, out, 15)
	})

	t.Run("no log line of the broker holds a token", func(t *testing.T) {
		status, body := e.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner"}`)
		require.Equal(t, 201, status)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(body), &resp))
		sig := resp.Token[strings.LastIndex(resp.Token, ".")+1:]
		time.Sleep(100 * time.Millisecond)
		require.NotContains(t, e.proc.logs.String(), sig)
		require.Contains(t, e.proc.logs.String(), resp.LeaseID, "the decision is logged with the lease id")
	})

	t.Run("SIGTERM stops the broker cleanly", func(t *testing.T) {
		require.NoError(t, e.proc.cmd.Process.Signal(syscall.SIGTERM))
		select {
		case err := <-e.proc.done:
			require.NoError(t, err, e.proc.logs.String())
			e.proc.done <- err // for the cleanup
		case <-time.After(30 * time.Second):
			t.Fatal("broker did not stop within 30s of SIGTERM")
		}
	})
}
