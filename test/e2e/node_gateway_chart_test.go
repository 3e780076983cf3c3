//go:build node

package e2e

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestNodeTheChartsGatewayForwardsAndEndsEveryStreamAtRevocation is the
// lease gateway as the broker's chart installs it (gateway.enabled, the
// signing CA from enrollment.caSecret, the chart's own flags), in a Pod on
// the harness's node from make image's archive, with the agent's chart in
// a Pod beside it writing a Flux-format Secret for a target with access:
// gateway. The lease in that Secret is used as its consumers would use
// it: client-go loads it (clientcmd) and lists and watches through the
// chart's gateway, and real kubectl processes get, watch (get -w), exec
// into a Pod on the node and port-forward to it, with a connection
// through the port-forward. Revoking the lease (DELETE /v1/leases/{id})
// ends every one of those streams within 2 s of the DELETE's answer, and
// the lease's next request is refused with 401 and the gateway's
// message. Before the gateway's
// upstream tokens were bound to the lease Secret, the chart's
// --gateway-pod-name/--gateway-pod-uid bound them to the broker's Pod,
// which the API server refuses for a ServiceAccount of another namespace:
// every request through the chart's gateway was answered 503, and this
// test fails at its first list.
//
// The Pods run on the node's network (hostNetwork), because the harness's
// API server listens on loopback; the gateway's URL is then
// https://127.0.0.1:<port>, which both the test and the agent's Pod
// reach, and which the broker's serving certificate names.
func TestNodeTheChartsGatewayForwardsAndEndsEveryStreamAtRevocation(t *testing.T) {
	const bound = 2 * time.Second // from the DELETE's answer to a stream's end
	c := testcluster.Start(t, testcluster.WithNode())
	setUpTarget(t, c)
	grantWatch(t, c, "argo", "runner", "configmaps")
	grantPodStreams(t, c)
	ctx := t.Context()
	kubectl := kubectlBinary(t)
	for _, ns := range []string{"tokenbroker", "tokenbroker-agent", "flux-system"} {
		_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	imported := time.Now()
	require.NoError(t, c.Node.ImportImage(ctx, imageArchive(t)))
	t.Logf("make image's archive imported into the node in %s", time.Since(imported).Round(100*time.Millisecond))
	startProbePod(t, c, kubectl, "argo", "probe")

	// The broker's PKI, peer certificates and ports; the broker runs in
	// the chart's Pod on e.api and e.ops, so that e's helpers reach it.
	e := newBrokerEnv(t, c)
	pkiDir := filepath.Join(e.dir, "pki")
	createSecretFromFiles(t, c, "tokenbroker", "tokenbroker-tls", corev1.SecretTypeTLS, map[string]string{
		"tls.crt": filepath.Join(pkiDir, "server.crt"), "tls.key": filepath.Join(pkiDir, "server.key"), "ca.crt": filepath.Join(pkiDir, "ca.crt"),
	})
	createSecretFromFiles(t, c, "tokenbroker", "tokenbroker-ca", corev1.SecretTypeTLS, map[string]string{
		"tls.crt": filepath.Join(pkiDir, "ca.crt"), "tls.key": filepath.Join(pkiDir, "ca.key"),
	})
	port := func(addr string) string { return addr[strings.LastIndex(addr, ":")+1:] }
	gatewayPort := freePort(t)
	gatewayURL := fmt.Sprintf("https://127.0.0.1:%d", gatewayPort)
	repository, tag := splitImageRef(imageRef(t))
	apiPort := port(c.URL)
	values := writeFile(t, filepath.Join(t.TempDir(), "values.yaml"), fmt.Sprintf(`image: {repository: %s, tag: %s, pullPolicy: Never}
replicaCount: 1
hostNetwork: true
containerPorts: {https: %s, ops: %s}
pki: {tlsSecret: tokenbroker-tls}
enrollment: {caSecret: tokenbroker-ca}
gateway: {enabled: true, url: %s, containerPort: %d}
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
          access: gateway
`, repository, tag, port(e.api), port(e.ops), gatewayURL, gatewayPort, apiPort, c.URL))
	installed := time.Now()
	h := newHelm(t)
	h.run(t, "install", "tokenbroker", h.chart, "-f", values, "--kubeconfig", c.KubeconfigPath, "--namespace", "tokenbroker")
	run(t, kubectl, "--kubeconfig", c.KubeconfigPath, "-n", "tokenbroker", "rollout", "status", "deployment/tokenbroker", "--timeout=120s")
	t.Logf("helm install, then the broker's Pod with the gateway Ready in %s", time.Since(installed).Round(100*time.Millisecond))
	brokerLogs := func() string {
		out, _, _ := runErr(kubectl, "--kubeconfig", c.KubeconfigPath, "-n", "tokenbroker", "logs", "deployment/tokenbroker")
		return out
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the broker Pod's log:\n%s", brokerLogs())
		}
	})

	// The agent's chart, its target asking for a gateway lease, writes a
	// Flux-format Secret from its Pod.
	createSecretFromFiles(t, c, "tokenbroker-agent", "tokenbroker-agent-identity", corev1.SecretTypeOpaque, map[string]string{
		"tls.crt": filepath.Join(e.dir, "west.crt"), "tls.key": filepath.Join(e.dir, "west.key"), "ca.crt": filepath.Join(pkiDir, "ca.crt"),
	})
	agentValues := writeFile(t, filepath.Join(t.TempDir(), "agent-values.yaml"), fmt.Sprintf(`image: {repository: %s, tag: %s, pullPolicy: Never}
hostNetwork: true
containerPorts: {ops: %d}
extraEnv:
  - {name: KUBERNETES_SERVICE_HOST, value: 127.0.0.1}
  - {name: KUBERNETES_SERVICE_PORT, value: "%s"}
config:
  targets:
    - name: east
      broker: https://%s
      request: {namespace: argo, serviceAccount: runner, ttl: 1h, access: gateway}
      outputs:
        - secret: {namespace: flux-system, name: east, format: flux}
`, repository, tag, freePort(t), apiPort, e.api))
	ha := newAgentHelm(t)
	agentInstalled := time.Now()
	ha.run(t, "install", "tokenbroker-agent", ha.chart, "-f", agentValues, "--kubeconfig", c.KubeconfigPath, "--namespace", "tokenbroker-agent")
	var sec *corev1.Secret
	require.Eventually(t, func() bool {
		var err error
		sec, err = c.Client.CoreV1().Secrets("flux-system").Get(ctx, "east", metav1.GetOptions{})
		return err == nil
	}, 90*time.Second, 200*time.Millisecond, "the agent's Pod writes flux-system/east")
	t.Logf("helm install of the agent, then its Secret written in %s", time.Since(agentInstalled).Round(100*time.Millisecond))
	lease := sec.Annotations[annLeaseID]
	require.NotEmpty(t, lease, "the Secret names its lease")
	raw := sec.Data["value"] // Flux's default key
	requireGatewayKubeconfig(t, raw, gatewayURL, "flux-system/east")
	kc := writeFile(t, filepath.Join(t.TempDir(), "lease.kubeconfig"), string(raw))
	withLease := func(args ...string) []string { return append([]string{"--kubeconfig", kc, "-n", "argo"}, args...) }

	// The consumer: client-go loads the Secret's kubeconfig and lists and
	// watches ConfigMaps through the chart's gateway.
	cfg, err := clientcmd.RESTConfigFromKubeConfig(raw)
	require.NoError(t, err)
	require.Equal(t, gatewayURL, cfg.Host)
	consumer, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	list, err := consumer.CoreV1().ConfigMaps("argo").List(ctx, metav1.ListOptions{})
	require.NoError(t, err, "the consumer lists through the chart's gateway")
	require.Contains(t, configMapNames(list.Items), "hello")
	cw, err := consumer.CoreV1().ConfigMaps("argo").Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	require.NoError(t, err, "the consumer watches through the chart's gateway")
	t.Cleanup(cw.Stop)
	consumerAdded, consumerDone := drainWatch(cw)

	// kubectl, as real processes: get, get -w, exec into the probe Pod on
	// the node, port-forward to it and a connection through it.
	require.Equal(t, "v", run(t, kubectl, withLease("get", "configmap", "hello", "-o", "jsonpath={.data.k}")...), "kubectl get through the chart's gateway")
	kwatch := startStream(t, kubectl, withLease("get", "configmaps", "-w", "-o", "name")...)
	execSession := startStream(t, kubectl, withLease("exec", "-i", "probe", "--", "/nodeprobe", "cat")...)
	pf := startWatchedPortForward(t, kubectl, withLease("port-forward", "pod/probe", ":8080")...)
	conn := pf.dial(t)
	require.NoError(t, execSession.echo("before the revocation"), "kubectl exec through the chart's gateway")
	require.NoError(t, conn.echo("before the revocation"), "a connection through kubectl port-forward through the chart's gateway")
	require.NoError(t, waitForLine(kwatch, "configmap/hello", 30*time.Second), "kubectl get -w lists through the chart's gateway")
	// Both watches deliver an event made after they opened: they are
	// open, through the gateway.
	_, err = c.Client.CoreV1().ConfigMaps("argo").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "after-watch"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.NoError(t, waitForLine(kwatch, "configmap/after-watch", 10*time.Second), "kubectl get -w sees a new ConfigMap")
	select {
	case name := <-consumerAdded:
		require.Equal(t, "after-watch", name)
	case <-time.After(10 * time.Second):
		t.Fatal("the consumer's watch did not see the new ConfigMap within 10s")
	}
	require.GreaterOrEqual(t, gatewayConnCount(t, e), 4.0, "kubectl get -w, exec, port-forward and the consumer each hold a connection of the chart's gateway")

	// Each end is stamped as it happens, not as it is looked at.
	streams := []struct {
		name string
		end  <-chan time.Time
	}{
		{"kubectl get -w", stampEnd(kwatch.done)},
		{"kubectl exec", stampEnd(execSession.done)},
		{"kubectl port-forward", stampEnd(pf.done)},
		{"a connection through the port-forward", stampEnd(closedAtEOF(t, conn))},
		{"the consumer's client-go watch", stampEnd(consumerDone)},
	}
	sent, answered := revokeAsWest(t, e, lease)

	// All are measured before any is judged, so that the log shows every
	// one. A negative time is an end before curl had the answer.
	waitUntil := answered.Add(10 * time.Second)
	report := make([]string, len(streams))
	took := make([]time.Duration, len(streams))
	ended := make([]bool, len(streams))
	for i, s := range streams {
		select {
		case end := <-s.end:
			took[i], ended[i] = end.Sub(answered), true
			report[i] = took[i].Round(time.Millisecond).String()
		case <-time.After(time.Until(waitUntil)):
			report[i] = "still open after 10s"
		}
	}
	named := make([]string, len(streams))
	for i, s := range streams {
		named[i] = s.name + " " + report[i]
	}
	t.Logf("through the chart's gateway, the DELETE took %s; from its answer to each stream's end: %s",
		answered.Sub(sent).Round(time.Millisecond), strings.Join(named, ", "))
	for i, s := range streams {
		require.True(t, ended[i] && took[i] < bound, "%s: %s (bound %s)", s.name, report[i], bound)
	}

	// The lease's next request is refused with 401 and the gateway's
	// message: on a new connection (each stream's was closed), which
	// holds no place but is answered why.
	tlsCfg, err := rest.TLSConfigFor(cfg)
	require.NoError(t, err)
	tr := &http.Transport{TLSClientConfig: tlsCfg, DisableKeepAlives: true}
	t.Cleanup(tr.CloseIdleConnections)
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Get(cfg.Host + "/api/v1/namespaces/argo/configmaps")
	require.NoError(t, err, "a raw request after the revocation is answered")
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	require.Equal(t, http.StatusUnauthorized, resp.StatusCode, "a raw request after the revocation: %s", body)
	require.Contains(t, string(body), "the lease is revoked or expired")
	_, err = consumer.CoreV1().ConfigMaps("argo").List(ctx, metav1.ListOptions{})
	require.Error(t, err, "the consumer's list after the revocation")
	var refused apierrors.APIStatus
	require.True(t, errors.As(err, &refused), "the consumer's list after the revocation: %v", err)
	require.Equal(t, int32(http.StatusUnauthorized), refused.Status().Code, "the consumer's list after the revocation: %v", err)
	require.Contains(t, err.Error(), "the lease is revoked or expired")
	// (kubectl's discovery, if it is not cached, drops the gateway's
	// message and says what client-go says of any 401.)
	out, err := exec.CommandContext(ctx, kubectl, withLease("get", "configmap", "hello")...).CombinedOutput()
	require.Error(t, err, "kubectl get after the revocation: %s", out)
	require.Regexp(t, `the lease is revoked or expired|the server has asked for the client to provide credentials`, string(out))
	require.Eventually(t, func() bool { return gatewayConnCount(t, e) == 0 }, 5*time.Second, 20*time.Millisecond,
		"the chart's gateway holds no connection of the revoked lease")

	// The broker's audit (the Pod's stdout) says it ended the lease's
	// connections because it was revoked.
	require.Eventually(t, func() bool {
		sc := bufio.NewScanner(strings.NewReader(brokerLogs()))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var ev map[string]any
			if json.Unmarshal(sc.Bytes(), &ev) == nil && ev["audit"] != nil &&
				ev["action"] == "gateway_close" && ev["lease_id"] == lease && ev["reason"] == "revoked" {
				return true
			}
		}
		return false
	}, 5*time.Second, 200*time.Millisecond, "the broker's audit records the gateway closing the revoked lease's connections")
}

// createSecretFromFiles creates the Secret namespace/name of type typ
// whose data key k holds the file files[k].
func createSecretFromFiles(t *testing.T, c *testcluster.Cluster, namespace, name string, typ corev1.SecretType, files map[string]string) {
	t.Helper()
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace}, Type: typ, Data: map[string][]byte{}}
	for key, file := range files {
		b, err := os.ReadFile(file)
		require.NoError(t, err)
		s.Data[key] = b
	}
	_, err := c.Client.CoreV1().Secrets(namespace).Create(t.Context(), s, metav1.CreateOptions{})
	require.NoError(t, err)
}

// splitImageRef splits repository:tag.
func splitImageRef(ref string) (repository, tag string) {
	i := strings.LastIndex(ref, ":")
	return ref[:i], ref[i+1:]
}

func configMapNames(items []corev1.ConfigMap) []string {
	names := make([]string, len(items))
	for i, cm := range items {
		names[i] = cm.Name
	}
	return names
}

// drainWatch reads w until it ends: the names of the ConfigMaps it adds,
// and a channel closed when its result channel closes.
func drainWatch(w watch.Interface) (<-chan string, <-chan struct{}) {
	added := make(chan string, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.ResultChan() {
			if cm, ok := ev.Object.(*corev1.ConfigMap); ok && ev.Type == watch.Added {
				select {
				case added <- cm.Name:
				default:
				}
			}
		}
	}()
	return added, done
}

// waitForLine waits for s to print line, reading (and dropping) the lines
// before it.
func waitForLine(s *stream, line string, timeout time.Duration) error {
	deadline := time.After(timeout)
	for {
		select {
		case got := <-s.lines:
			if got == line {
				return nil
			}
		case <-s.done:
			return fmt.Errorf("the command ended before it printed %q", line)
		case <-deadline:
			return fmt.Errorf("%q not printed within %s", line, timeout)
		}
	}
}
