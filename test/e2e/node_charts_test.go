//go:build node

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestNodeBrokerChartRunsAsAPod installs the broker's chart into a cluster
// with a node, from make image's archive imported into the node: the Pod
// becomes Ready through the chart's own probes (with its read-only root,
// non-root user, dropped capabilities, mounted TLS Secret and policy
// ConfigMap, the in-cluster ServiceAccount token, GOMEMLIMIT from the
// downward API), and a peer gets a kubeconfig through the chart's Service
// (kubectl port-forward svc/tokenbroker) and uses it; the agent's chart,
// installed the same way, writes a kubeconfig Secret from its Pod. The
// harness's API
// server listens on loopback, so the Pod runs with hostNetwork and is told
// the API server's address with extraEnv. A helm upgrade then rolls the
// Pod while a peer asks for kubeconfigs over a new connection every 50 ms:
// the new Pod listens beside the old one on the node's ports
// (--reuse-port), the old one closes its listeners once the new one
// serves, and no request fails.
func TestNodeBrokerChartRunsAsAPod(t *testing.T) {
	c := testcluster.Start(t, testcluster.WithNode())
	setUpTarget(t, c)
	ctx := t.Context()
	kubectl := kubectlBinary(t)
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.NoError(t, c.Node.ImportImage(ctx, imageArchive(t)))

	e := newBrokerEnv(t, c) // its PKI and peer certificates; the broker runs in the Pod
	tlsSecret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-tls", Namespace: "tokenbroker"},
		Type:       corev1.SecretTypeTLS,
		Data:       map[string][]byte{},
	}
	for key, file := range map[string]string{"tls.crt": "server.crt", "tls.key": "server.key", "ca.crt": "ca.crt"} {
		b, err := os.ReadFile(filepath.Join(e.dir, "pki", file))
		require.NoError(t, err)
		tlsSecret.Data[key] = b
	}
	_, err = c.Client.CoreV1().Secrets("tokenbroker").Create(ctx, tlsSecret, metav1.CreateOptions{})
	require.NoError(t, err)

	ref := imageRef(t)
	httpsPort, opsPort := freePort(t), freePort(t)
	apiPort := c.URL[strings.LastIndex(c.URL, ":")+1:]
	values := writeFile(t, filepath.Join(t.TempDir(), "values.yaml"), fmt.Sprintf(`image:
  repository: %s
  tag: %s
  pullPolicy: Never
replicaCount: 1
hostNetwork: true
containerPorts: {https: %d, ops: %d}
pki: {tlsSecret: tokenbroker-tls}
extraEnv:
  - {name: KUBERNETES_SERVICE_HOST, value: 127.0.0.1}
  - {name: KUBERNETES_SERVICE_PORT, value: "%s"}
policy:
  cluster: {name: east, server: %s}
  peers:
    - name: west
      identity: spiffe://e2e.example/cluster/west
      grants:
        - namespaces: [argo]
          serviceAccounts: [runner]
          maxTTL: 12h
`, ref[:strings.LastIndex(ref, ":")], ref[strings.LastIndex(ref, ":")+1:], httpsPort, opsPort, apiPort, c.URL))
	h := newHelm(t)
	kube := []string{"--kubeconfig", c.KubeconfigPath, "--namespace", "tokenbroker"}
	start := time.Now()
	h.run(t, append([]string{"install", "tokenbroker", h.chart, "-f", values}, kube...)...)
	// kubectl waits for the Pod to be available (helm's --wait would do,
	// now that a rollout keeps the old Pod until the new one is ready).
	rolledOut := func(t *testing.T) {
		t.Helper()
		run(t, kubectl, "--kubeconfig", c.KubeconfigPath, "-n", "tokenbroker", "rollout", "status", "deployment/tokenbroker", "--timeout=120s")
	}
	rolledOut(t)
	t.Logf("helm install, then the broker's Pod Ready through its probes in %s", time.Since(start).Round(100*time.Millisecond))

	issue := func(t *testing.T, addr string) (int, string) {
		t.Helper()
		status, out, err := e.curl(t, filepath.Join(e.dir, "west"), "--max-time", "5", "-H", "Content-Type: application/json",
			"-d", `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`, "https://"+addr+"/v1/kubeconfigs")
		if err != nil {
			return 0, out
		}
		return status, out
	}

	t.Run("a peer gets a kubeconfig through the Service and uses it", func(t *testing.T) {
		pf := startPortForward(t, kubectl, "--kubeconfig", c.KubeconfigPath, "-n", "tokenbroker", "port-forward", "svc/tokenbroker", ":443")
		status, body := issue(t, "127.0.0.1:"+pf.port)
		require.Equal(t, 201, status, body)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(body), &resp))
		kc := writeFile(t, filepath.Join(t.TempDir(), "lease.kubeconfig"), resp.Kubeconfig)
		out := run(t, kubectl, "--kubeconfig", kc, "-n", "argo", "get", "configmap", "hello", "-o", "jsonpath={.data.k}")
		require.Equal(t, "v", out)
	})

	t.Run("the agent's chart installed the same way writes its Secret from a Pod", func(t *testing.T) {
		_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-agent"}}, metav1.CreateOptions{})
		require.NoError(t, err)
		id := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-agent-identity", Namespace: "tokenbroker-agent"}, Data: map[string][]byte{}}
		for key, file := range map[string]string{"tls.crt": "west.crt", "tls.key": "west.key", "ca.crt": filepath.Join("pki", "ca.crt")} {
			b, err := os.ReadFile(filepath.Join(e.dir, file))
			require.NoError(t, err)
			id.Data[key] = b
		}
		_, err = c.Client.CoreV1().Secrets("tokenbroker-agent").Create(ctx, id, metav1.CreateOptions{})
		require.NoError(t, err)
		agentValues := writeFile(t, filepath.Join(t.TempDir(), "agent-values.yaml"), agentOnNodeValues(t, c)+fmt.Sprintf(`config:
  targets:
    - name: east
      broker: https://127.0.0.1:%d
      request: {namespace: argo, serviceAccount: runner, ttl: 1h}
      outputs:
        - secret: {namespace: argo, name: east, format: kubeconfig}
`, httpsPort))
		ha := newHelm(t)
		ha.chart = filepath.Join(repoRoot(t), "deploy", "helm", "tokenbroker-agent")
		ha.run(t, "install", "tokenbroker-agent", ha.chart, "-f", agentValues, "--wait", "--timeout", "120s",
			"--kubeconfig", c.KubeconfigPath, "--namespace", "tokenbroker-agent")
		var sec *corev1.Secret
		require.Eventually(t, func() bool {
			sec, err = c.Client.CoreV1().Secrets("argo").Get(ctx, "east", metav1.GetOptions{})
			return err == nil
		}, 30*time.Second, 200*time.Millisecond, "the agent's Pod writes argo/east")
		kc := writeFile(t, filepath.Join(t.TempDir(), "east.kubeconfig"), string(sec.Data["kubeconfig"]))
		require.Equal(t, "v", run(t, kubectl, "--kubeconfig", kc, "-n", "argo", "get", "configmap", "hello", "-o", "jsonpath={.data.k}"))
	})

	t.Run("helm upgrade rolls the Pod without a failed request", func(t *testing.T) {
		// What docs/operations.md asks of a node that runs the broker on
		// its network: a connection the kernel queued on the old Pod's
		// socket as it closes goes to the new Pod's, not reset. Left set,
		// as on such a node (the server package's tests set it too).
		require.NoError(t, os.WriteFile("/proc/sys/net/ipv4/tcp_migrate_req", []byte("1"), 0o644), "Linux 5.14 or later")
		addr := fmt.Sprintf("127.0.0.1:%d", httpsPort)
		stop := make(chan struct{})
		type outcome struct {
			at     time.Time
			status int
		}
		results := make(chan []outcome, 1)
		go func() {
			var got []outcome
			for {
				select {
				case <-stop:
					results <- got
					return
				default:
				}
				status, _ := issue(t, addr)
				got = append(got, outcome{time.Now(), status})
				time.Sleep(50 * time.Millisecond)
			}
		}()
		upgraded := time.Now()
		h.run(t, append([]string{"upgrade", "tokenbroker", h.chart, "-f", values, "--set", "logLevel=debug"}, kube...)...)
		rolledOut(t)
		// The old Pod hands over once the new one serves; wait for it to
		// be gone, with requests still running.
		require.Eventually(t, func() bool {
			pods, err := c.Client.CoreV1().Pods("tokenbroker").List(ctx, metav1.ListOptions{})
			return err == nil && len(pods.Items) == 1
		}, 90*time.Second, 100*time.Millisecond, "the old Pod is gone")
		rolled := time.Since(upgraded)
		status, body := issue(t, addr)
		require.Equal(t, 201, status, "the new Pod serves: %s", body)
		close(stop)
		got := <-results
		var failed int
		var first, last time.Time
		for _, o := range got {
			if o.status != 201 {
				if failed == 0 {
					first = o.at
				}
				failed++
				last = o.at
			}
		}
		t.Logf("helm upgrade rolled the Pod in %s: %d requests over new connections, %d failed", rolled.Round(100*time.Millisecond), len(got), failed)
		require.Zero(t, failed, "no request fails during the upgrade (the first at %s, the last at %s)",
			first.Format(time.StampMilli), last.Format(time.StampMilli))
		pods, err := c.Client.CoreV1().Pods("tokenbroker").List(ctx, metav1.ListOptions{})
		require.NoError(t, err)
		require.Len(t, pods.Items, 1)
		require.Contains(t, pods.Items[0].Spec.Containers[0].Args, "--log-level=debug", "the Pod is the upgraded one")
	})
}
