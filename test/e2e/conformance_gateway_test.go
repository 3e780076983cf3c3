package e2e

import (
	"bufio"
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/conformance/consumers/check"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// revocationBound is how long after the DELETE's answer a consumer's open
// watch may go on through the gateway (docs/guides/gateway.md: "ends at
// once").
const revocationBound = 2 * time.Second

// TestConsumersReachTheTargetThroughTheLeaseGatewayAndLoseItsWatchesAtRevocation
// is the conformance test of the lease gateway (issue item 6): a broker in
// east with the gateway and a grant with access: gateway, the agent in west
// writing every Secret format for a gateway target, and each consumer's
// own loader turning its Secret into a client whose server is the gateway
// and whose credential is the lease certificate. Argo CD's cluster cache
// (gitops-engine, as the application controller syncs it) and client-go
// informers (Admiralty's and Kargo's loaders) sync through the gateway and
// get watch events; revoking the lease ends their watches within
// revocationBound of the DELETE's answer, their attempts to re-establish
// them are refused, and so is every consumer's next request.
func TestConsumersReachTheTargetThroughTheLeaseGatewayAndLoseItsWatchesAtRevocation(t *testing.T) {
	t.Parallel()
	bins, built := consumerBinaries(t, consumerAdmiralty, consumerArgoCD, consumerFlux, consumerKargo)
	east, west := startTwoClusters(t)
	setUpTarget(t, east)
	grantWatch(t, east, "argo", "runner", "configmaps")
	built()

	e, gatewayURL := startBrokerWithGateway(t, east, `      - namespaces: [argo]
        serviceAccounts: [runner]
        access: gateway
`)
	idDir := agentIdentityDir(t, e)
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
	// A 1 h lease is refreshed after 40 min: the test sees one lease.
	ops := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cfg := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), fmt.Sprintf(`identity:
  dir: %s
refresh: {minBackoff: 500ms, maxBackoff: 2s}
targets:
  - name: east
    broker: https://%s
    request: {namespace: argo, serviceAccount: runner, ttl: 1h, access: gateway}
    outputs:
      - secret: {namespace: admiralty, name: east, format: admiralty}
      - secret: {namespace: argocd, name: east, format: argocd, argocd: {project: team-a, namespaces: [argo]}}
      - secret: {namespace: flux-system, name: east, format: flux}
      - secret: {namespace: flux-system, name: east-yaml, format: flux, key: value.yaml}
      - secret: {namespace: tenant, name: east, format: kubeconfig, key: kubeconfig, labels: {reconcile.fluxcd.io/watch: Enabled}}
      - secret: {namespace: kargo, name: east, format: kubeconfig, key: kubeconfig.yaml}
  - name: east-exec
    broker: https://%s
    request: {namespace: argo, serviceAccount: runner, ttl: 1h, access: gateway}
    outputs:
      - secret:
          namespace: argocd
          name: east-exec
          format: argocd
          argocd: {exec: {command: %s, identityDir: %s, env: {XDG_CACHE_HOME: %s}}}
kubeconfig: %s
opsAddress: %q
`, idDir, e.api, e.api, tokenbrokerBinary(t), idDir, t.TempDir(), west.KubeconfigPath, ops))
	first := watchAdded(t, west, "kargo", "east")
	agentProc := startAgent(t, cfg)
	waitTime(t, first, agentSecretsWait, "the agent's first Secrets")
	agentProc.waitReady(t)
	lease := getSecret(t, west, "kargo", "east").Annotations[annLeaseID]
	require.NotEmpty(t, lease)

	t.Run("every Secret names the gateway as its server and holds a lease certificate and key, no token", func(t *testing.T) {
		for _, c := range checks {
			s := getSecret(t, west, c.namespace, c.name)
			require.Equal(t, lease, s.Annotations[annLeaseID], c.String())
			if c.consumer == consumerArgoCD {
				requireGatewayArgoCDSecret(t, s, gatewayURL)
				continue
			}
			// The key each consumer reads: Flux's own order, value then
			// value.yaml, when its secretRef names none.
			key := c.key
			switch {
			case key != "":
			case c.consumer == consumerAdmiralty:
				key = "config"
			case c.consumer == consumerKargo:
				key = "kubeconfig.yaml"
			case c.consumer == consumerFlux && s.Data["value"] != nil:
				key = "value"
			case c.consumer == consumerFlux:
				key = "value.yaml"
			}
			requireGatewayKubeconfig(t, s.Data[key], gatewayURL, c.String())
		}
	})

	t.Run("each consumer's own loader lists ConfigMaps in east through the gateway as the granted ServiceAccount", func(t *testing.T) {
		before := gatewayRequests(t, e, lease)
		for _, c := range checks {
			r := c.run(t, bins, west, c.name, "")
			require.Equal(t, http.StatusOK, r.Status, "%s: %s", c, r.Error)
			require.Contains(t, r.ConfigMaps, "hello", c.String())
			if r.Server != "" { // Flux's client does not say; its Secret did above
				require.Equal(t, gatewayURL, r.Server, "%s talks to the gateway", c)
			}
		}
		require.Eventually(t, func() bool { return gatewayRequests(t, e, lease)-before >= len(checks) }, 5*time.Second, 20*time.Millisecond,
			"the broker audited every consumer's list as a request of the lease it forwarded")
		r := consumerCheck{consumer: consumerArgoCD, namespace: "argocd"}.run(t, bins, west, "east", "")
		require.Equal(t, map[string]any{
			"name": "east", "server": gatewayURL, "project": "team-a",
			"namespaces": []any{"argo"}, "clusterResources": false,
			"serverName": "", "proxyUrl": "",
			"hasBearerToken": false, "hasCAData": true, "insecure": false,
		}, r.Cluster, "Argo CD reads the gateway and its CA, and no bearer token")
	})

	t.Run("Argo CD runs tokenbroker credential for a gateway lease from an exec-mode Secret", func(t *testing.T) {
		held := getSecret(t, west, "argocd", "east-exec")
		require.Equal(t, gatewayURL, string(held.Data["server"]))
		require.NotContains(t, string(held.Data["config"]), "bearerToken")
		require.NotContains(t, string(held.Data["config"]), "keyData", "the exec-mode Secret holds no credential")
		r := consumerCheck{consumer: consumerArgoCD, namespace: "argocd", name: "east-exec"}.run(t, bins, west, "east-exec", "")
		require.Equal(t, http.StatusOK, r.Status, "Argo CD's RESTConfig ran the plugin, whose certificate the gateway took: %s", r.Error)
		require.Contains(t, r.ConfigMaps, "hello")
		require.Equal(t, gatewayURL, r.Server)
	})

	t.Run("Flux's impersonator reaches east through the gateway, impersonating with the Flux guide's RBAC", func(t *testing.T) {
		flux := checks[2]
		const impersonate = "flux-reconciler"
		r := flux.run(t, bins, west, flux.name, impersonate)
		require.Equal(t, http.StatusForbidden, r.Status, "runner may not impersonate yet: %s", r.Error)
		grantImpersonation(t, east, "argo", "runner", flux.namespace, impersonate)
		require.Eventually(t, func() bool { return flux.run(t, bins, west, flux.name, impersonate).Status == http.StatusOK },
			10*time.Second, 200*time.Millisecond, "the gateway forwards Flux's impersonation, which the API server allows with the guide's RBAC")
	})

	t.Run("Argo CD's cluster cache and client-go informers sync and watch through the gateway, lose their watches at the revocation, and every consumer is refused after it", func(t *testing.T) {
		watchers := []*consumerWatch{
			startConsumerWatch(t, bins[consumerArgoCD], "Argo CD's cluster cache", check.Args{Kubeconfig: west.KubeconfigPath, Namespace: "argocd", Name: "east", ListNamespace: "argo"}),
			startConsumerWatch(t, bins[consumerAdmiralty], "a client-go informer from Admiralty's loader", check.Args{Kubeconfig: west.KubeconfigPath, Namespace: "admiralty", Name: "east", ListNamespace: "argo"}),
			startConsumerWatch(t, bins[consumerKargo], "a client-go informer from Kargo's loader", check.Args{Kubeconfig: west.KubeconfigPath, Namespace: "kargo", Name: "east", ListNamespace: "argo"}),
		}
		for _, w := range watchers {
			ev := w.wait(t, check.EventSynced, time.Minute)
			require.Equal(t, gatewayURL, ev.Server, "%s syncs through the gateway", w.name)
			require.Contains(t, ev.ConfigMaps, "hello", w.name)
		}
		// Each watch delivers an event made after the sync: it is open,
		// through the gateway.
		_, err := east.Client.CoreV1().ConfigMaps("argo").Create(context.Background(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "after-sync"}}, metav1.CreateOptions{})
		require.NoError(t, err)
		for _, w := range watchers {
			ev := w.wait(t, check.EventAdded, 10*time.Second)
			require.Equal(t, "after-sync", ev.Name, w.name)
			require.Positive(t, ev.Open, "%s holds a watch stream open", w.name)
		}
		require.Positive(t, gatewayConnCount(t, e), "the gateway holds the consumers' connections")

		age := leaseAge(t, getSecret(t, west, "kargo", "east").Data["kubeconfig.yaml"])
		sent, answered := revokeAsWest(t, e, lease)
		// Measured before judged, so that the log shows each one.
		report := make([]string, len(watchers))
		ended := make([]time.Duration, len(watchers))
		for i, w := range watchers {
			end, ok := w.waitFor(10*time.Second, func(ev check.WatchEvent) bool { return ev.Event == check.EventWatchEnded && ev.Open == 0 })
			if !ok {
				report[i] = w.name + ": still watching after 10s"
				ended[i] = time.Hour
				continue
			}
			ended[i] = end.At.Sub(answered)
			report[i] = fmt.Sprintf("%s: watch ended %s (%s)", w.name, ended[i].Round(time.Millisecond), end.Error)
			if lost, ok := w.waitFor(15*time.Second, func(ev check.WatchEvent) bool { return ev.Event == check.EventLost }); ok {
				report[i] += fmt.Sprintf(", re-establishing it refused %s", lost.At.Sub(answered).Round(time.Millisecond))
			}
		}
		t.Logf("the lease was %s old; the DELETE took %s; from its answer: %s", age.Round(time.Millisecond),
			answered.Sub(sent).Round(time.Millisecond), strings.Join(report, "; "))
		for i, w := range watchers {
			require.Less(t, ended[i], revocationBound, report[i])
			refused, ok := w.waitFor(0, func(ev check.WatchEvent) bool { return ev.Event == check.EventRefused })
			require.True(t, ok, "%s: a request after the revocation was refused", w.name)
			require.Equal(t, http.StatusUnauthorized, refused.Status, "%s: %s %s", w.name, refused.Path, refused.Error)
			require.Contains(t, refused.Error, "the lease is revoked or expired", w.name)
			w.requireExit(t, 1, 10*time.Second)
		}

		for _, c := range checks {
			r := c.run(t, bins, west, c.name, "")
			require.Equal(t, http.StatusUnauthorized, r.Status, "%s after the revocation: %s", c, r.Error)
			if c.consumer != consumerFlux {
				// Flux's client fails in its discovery, whose error
				// drops the gateway's message.
				require.Contains(t, r.Error, "the lease is revoked or expired", c.String())
			}
		}
		require.Eventually(t, func() bool { return gatewayConnCount(t, e) == 0 }, 5*time.Second, 20*time.Millisecond,
			"the gateway holds no connection of the revoked lease")
		require.True(t, slices.ContainsFunc(e.auditEvents(t), func(ev map[string]string) bool {
			return ev["action"] == "gateway_close" && ev["lease_id"] == lease && ev["reason"] == "revoked"
		}), "the broker's audit says it ended the lease's connections because it was revoked")
	})
}

// TestMultiKueueDispatchesThroughTheLeaseGatewayAndLosesTheWorkerAtRevocation
// runs Kueue v0.17.0's own controllers as
// TestMultiKueueDispatchesWithTheAgentsSecretAndKeepsItsClusterActiveAcrossARotation
// does, with the guide's agent target asking for access: gateway and a
// broker whose grant gives gateway leases: the multikueue Secret names the
// gateway and holds a lease certificate, Kueue validates it, connects, and
// a Job is dispatched to the worker through the gateway. Revoking the
// lease ends Kueue's watches of the worker: the MultiKueueCluster turns
// Active=False (Kueue's reconnection refused) within revocationBound of
// the DELETE's answer.
func TestMultiKueueDispatchesThroughTheLeaseGatewayAndLosesTheWorkerAtRevocation(t *testing.T) {
	t.Parallel()
	bin := consumerBinary(t, consumerMultiKueue)
	kubectl := kubectlBinary(t)
	guide := readDoc(t, "docs/guides/multikueue.md")
	east, west := startTwoClusters(t)
	var wg sync.WaitGroup
	wg.Go(func() { installKueueCRDs(t, east) })
	wg.Go(func() { installKueueCRDs(t, west) })
	wg.Wait()

	// The worker, east: the ServiceAccount with the guide's RBAC, the
	// broker and its gateway, Kueue and its queues.
	ctx := context.Background()
	setUpMultiKueueWorker(t, kubectl, guide, east, west)
	e, gatewayURL := startBrokerWithGateway(t, east, `      - namespaces: [kueue-system]
        serviceAccounts: [multikueue]
        access: gateway
`)
	startProcess(t, bin, "--role", "worker", "--kubeconfig", east.KubeconfigPath)
	applyYAML(t, kubectl, east, kueueQueues(""))

	// The manager, west: the guide's target with access: gateway (a 1 h
	// lease, not refreshed during the test), Kueue, and the guide's
	// MultiKueueCluster.
	targets := replaceAll(t, fencedBlock(t, guide, "yaml", "targets:\n  - name: worker1"),
		"https://broker.worker1.example.com:8443", "https://"+e.api, "ttl: 2h}", "ttl: 1h, access: gateway}")
	ops := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	cfg := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), fmt.Sprintf(`identity:
  dir: %s
refresh: {minBackoff: 500ms, maxBackoff: 2s}
kubeconfig: %s
opsAddress: %q
%s`, agentIdentityDir(t, e), west.KubeconfigPath, ops, targets))
	first := watchAdded(t, west, "kueue-system", "worker1")
	agentProc := startAgent(t, cfg)
	waitTime(t, first, agentSecretsWait, "the agent's multikueue Secret")
	agentProc.waitReady(t)
	sec := getSecret(t, west, "kueue-system", "worker1")
	requireGatewayKubeconfig(t, sec.Data["kubeconfig"], gatewayURL, "the multikueue Secret")
	lease := sec.Annotations[annLeaseID]

	startProcess(t, bin, "--role", "manager", "--kubeconfig", west.KubeconfigPath)
	applyYAML(t, kubectl, west, multiKueueManagerObjects(fencedBlock(t, guide, "yaml", "apiVersion: kueue.x-k8s.io/v1beta2\nkind: MultiKueueCluster\nmetadata: {name: worker1}\nspec:\n  clusterSource:\n    kubeConfig")))

	westDyn := dynamic.NewForConfigOrDie(west.Config)
	mkc := westDyn.Resource(multiKueueClusterGVR)
	active := func() (status, reason, message string) {
		u, err := mkc.Get(ctx, "worker1", metav1.GetOptions{})
		if err != nil {
			return "", "", err.Error()
		}
		conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
		for _, c := range conds {
			if m, _ := c.(map[string]any); m["type"] == "Active" {
				status, _ = m["status"].(string)
				reason, _ = m["reason"].(string)
				message, _ = m["message"].(string)
			}
		}
		return status, reason, message
	}
	require.Eventually(t, func() bool { s, _, _ := active(); return s == "True" }, 60*time.Second, 250*time.Millisecond,
		"MultiKueueCluster worker1 Active=True through the gateway (the processes' logs follow a failure)")

	// A Job is dispatched: the manager Workload's check Ready, the copy in
	// the worker, created through the gateway under the lease.
	applyYAML(t, kubectl, west, multiKueueJob("sample-1"))
	var msg string
	require.Eventually(t, func() bool {
		l, err := westDyn.Resource(workloadGVR).Namespace("team-a").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for _, w := range l.Items {
			checks, _, _ := unstructured.NestedSlice(w.Object, "status", "admissionChecks")
			for _, c := range checks {
				if m, _ := c.(map[string]any); m["name"] == "multikueue" && m["state"] == "Ready" {
					msg, _ = m["message"].(string)
					return true
				}
			}
		}
		return false
	}, 60*time.Second, 250*time.Millisecond, "the manager Workload of Job sample-1 has its MultiKueue check Ready")
	require.Contains(t, msg, `"worker1"`)
	job, err := east.Client.BatchV1().Jobs("team-a").Get(ctx, "sample-1", metav1.GetOptions{})
	require.NoError(t, err, "the Job copy in the worker")
	require.Contains(t, job.Labels, "kueue.x-k8s.io/multikueue-origin")
	require.True(t, slices.ContainsFunc(e.auditEvents(t), func(ev map[string]string) bool {
		return ev["action"] == "gateway_request" && ev["lease_id"] == lease && ev["method"] == http.MethodPost &&
			ev["path"] == "/apis/batch/v1/namespaces/team-a/jobs" && ev["decision"] == "allow"
	}), "the broker forwarded Kueue's creation of the Job copy as a request of the lease")
	require.Positive(t, gatewayConnCount(t, e), "Kueue's watches of the worker are connections of the gateway")

	// The revocation: Kueue's watches end, its reconnection is refused,
	// and it says so on the MultiKueueCluster.
	age := leaseAge(t, sec.Data["kubeconfig"])
	sent, answered := revokeAsWest(t, e, lease)
	var inactive time.Time
	var reason, message string
	require.Eventually(t, func() bool {
		var s string
		s, reason, message = active()
		if s == "False" {
			inactive = time.Now()
			return true
		}
		return false
	}, 30*time.Second, 10*time.Millisecond, "MultiKueueCluster worker1 turns Active=False after the revocation")
	took := inactive.Sub(answered)
	t.Logf("the lease was %s old; the DELETE took %s; MultiKueueCluster worker1 Active=False %s after its answer (seen by polling every 10 ms): %s: %s",
		age.Round(time.Millisecond), answered.Sub(sent).Round(time.Millisecond), took.Round(time.Millisecond), reason, message)
	require.Equal(t, "ClientConnectionFailed", reason)
	// Kueue's new client fails in its discovery, whose error is
	// client-go's text for a 401, not the gateway's message.
	require.Contains(t, message, "the server has asked for the client to provide credentials", "Kueue's reconnection to the worker was refused")
	require.Less(t, took, revocationBound)
	require.Eventually(t, func() bool { return gatewayConnCount(t, e) == 0 }, 5*time.Second, 20*time.Millisecond,
		"the gateway holds no connection of the revoked lease")
}

// startBrokerWithGateway starts startBroker's broker with the signing CA
// and the lease gateway on a free port of 127.0.0.1, and a policy whose
// peer west has the given grants (YAML list items indented for
// peers[0].grants). It returns the broker and the gateway's URL; the
// node's stream test uses it too.
func startBrokerWithGateway(t *testing.T, c *testcluster.Cluster, grants string) (*brokerEnv, string) {
	t.Helper()
	e := newBrokerEnv(t, c)
	pkiDir := filepath.Join(e.dir, "pki")
	// The URL is in every gateway kubeconfig, so the port is chosen before
	// the broker starts; the serving certificate names 127.0.0.1.
	addr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	e.args = append(e.args, "--ca-cert-file", filepath.Join(pkiDir, "ca.crt"), "--ca-key-file", filepath.Join(pkiDir, "ca.key"),
		"--gateway-address", addr, "--gateway-url", "https://"+addr)
	writeFile(t, e.policy, fmt.Sprintf(`cluster:
  name: east
  server: %s
  caFile: cluster-ca.crt
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://e2e.example/cluster/west
    grants:
%s`, c.URL, grants))
	e.launch(t)
	t.Logf("broker with the lease gateway at %s ready %s after start", addr, e.startup.Round(time.Millisecond))
	return e, "https://" + addr
}

// agentIdentityDir is an agent identity directory holding startBroker's
// west client certificate.
func agentIdentityDir(t *testing.T, e *brokerEnv) string {
	t.Helper()
	dir := t.TempDir()
	for src, dst := range map[string]string{"west.crt": "tls.crt", "west.key": "tls.key", filepath.Join("pki", "ca.crt"): "ca.crt"} {
		raw, err := os.ReadFile(filepath.Join(e.dir, src))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, dst), raw, 0o600))
	}
	return dir
}

// grantWatch lets namespace/sa also watch resource in namespace
// (setUpTarget grants get and list on ConfigMaps).
func grantWatch(t *testing.T, c *testcluster.Cluster, namespace, sa, resource string) {
	t.Helper()
	ctx := context.Background()
	_, err := c.Client.RbacV1().Roles(namespace).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: resource + "-watcher"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{resource}, Verbs: []string{"watch"}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.RbacV1().RoleBindings(namespace).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: sa + "-" + resource + "-watch"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: resource + "-watcher"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: namespace}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
}

// requireGatewayKubeconfig checks a kubeconfig the agent wrote for a
// gateway target: its current context's server is the gateway, and its
// user a client certificate and key with no token.
func requireGatewayKubeconfig(t *testing.T, raw []byte, gatewayURL, what string) {
	t.Helper()
	kc, err := clientcmd.Load(raw)
	require.NoError(t, err, what)
	ctx := kc.Contexts[kc.CurrentContext]
	require.NotNil(t, ctx, what)
	require.Equal(t, gatewayURL, kc.Clusters[ctx.Cluster].Server, "%s: the server is the gateway", what)
	require.NotEmpty(t, kc.Clusters[ctx.Cluster].CertificateAuthorityData, what)
	user := kc.AuthInfos[ctx.AuthInfo]
	require.NotNil(t, user, what)
	require.NotEmpty(t, user.ClientCertificateData, "%s: a lease certificate", what)
	require.NotEmpty(t, user.ClientKeyData, "%s: and its key", what)
	require.Empty(t, user.Token, "%s: no token", what)
}

// requireGatewayArgoCDSecret checks an argocd-format Secret the agent
// wrote for a gateway target.
func requireGatewayArgoCDSecret(t *testing.T, s *corev1.Secret, gatewayURL string) {
	t.Helper()
	require.Equal(t, gatewayURL, string(s.Data["server"]))
	var config struct {
		BearerToken     string `json:"bearerToken"`
		TLSClientConfig struct {
			CertData []byte `json:"certData"`
			KeyData  []byte `json:"keyData"`
			CAData   []byte `json:"caData"`
		} `json:"tlsClientConfig"`
	}
	require.NoError(t, json.Unmarshal(s.Data["config"], &config))
	require.Empty(t, config.BearerToken)
	require.NotEmpty(t, config.TLSClientConfig.CertData, "a lease certificate")
	require.NotEmpty(t, config.TLSClientConfig.KeyData, "and its key")
	require.NotEmpty(t, config.TLSClientConfig.CAData, "the gateway's CA")
}

// leaseAge is the age of the lease of a gateway kubeconfig, for the log:
// a lease revoked young is refused at once as well (the gateway
// remembers what the lease watch reported gone).
func leaseAge(t *testing.T, kubeconfig []byte) time.Duration {
	t.Helper()
	kc, err := clientcmd.Load(kubeconfig)
	require.NoError(t, err)
	user := kc.AuthInfos[kc.Contexts[kc.CurrentContext].AuthInfo]
	block, _ := pem.Decode(user.ClientCertificateData)
	require.NotNil(t, block)
	cert, err := x509.ParseCertificate(block.Bytes)
	require.NoError(t, err)
	return time.Since(cert.NotBefore.Add(pki.Backdate))
}

// revokeAsWest revokes a lease with DELETE /v1/leases/{id} as its holder,
// and returns when the request was sent and when its answer came.
func revokeAsWest(t *testing.T, e *brokerEnv, lease string) (sent, answered time.Time) {
	t.Helper()
	sent = time.Now()
	status, body, err := e.curl(t, filepath.Join(e.dir, "west"), "-X", "DELETE", "https://"+e.api+"/v1/leases/"+lease)
	answered = time.Now()
	require.NoError(t, err, body)
	require.Equal(t, http.StatusNoContent, status, body)
	return sent, answered
}

// gatewayConnCount is the broker's tokenbroker_gateway_connections: the
// open connections of its gateway leases.
func gatewayConnCount(t *testing.T, e *brokerEnv) float64 {
	t.Helper()
	n, _ := sumSamples(t, run(t, "curl", "-sSf", "http://"+e.ops+"/metrics"), "tokenbroker_gateway_connections")
	return n
}

// gatewayRequests counts the broker's gateway_request audit events of a
// lease that it forwarded.
func gatewayRequests(t *testing.T, e *brokerEnv, lease string) int {
	t.Helper()
	n := 0
	for _, ev := range e.auditEvents(t) {
		if ev["action"] == "gateway_request" && ev["lease_id"] == lease && ev["decision"] == "allow" {
			n++
		}
	}
	return n
}

// consumerWatch is a consumer checker in watch mode (check.WithWatch):
// its check.WatchEvent lines as they come, and its exit.
type consumerWatch struct {
	name   string
	stderr *syncBuffer
	exited chan struct{} // closed when the checker has exited; err is then set
	err    error

	mu     sync.Mutex
	events []check.WatchEvent
}

func startConsumerWatch(t *testing.T, bin, name string, a check.Args) *consumerWatch {
	t.Helper()
	a.Watch = true
	w := &consumerWatch{name: name, stderr: &syncBuffer{}, exited: make(chan struct{})}
	cmd := exec.Command(bin, a.CommandLine()...)
	cmd.Stderr = w.stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	go func() {
		defer close(w.exited)
		sc := bufio.NewScanner(stdout)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			var ev check.WatchEvent
			if json.Unmarshal(sc.Bytes(), &ev) == nil {
				w.mu.Lock()
				w.events = append(w.events, ev)
				w.mu.Unlock()
			}
		}
		w.err = cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-w.exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-w.exited
		}
		if t.Failed() {
			t.Logf("%s (stderr):\n%s", name, w.stderr.String())
		}
	})
	return w
}

// waitFor returns the first event that match accepts, waiting up to
// timeout for it (0: only what came already).
func (w *consumerWatch) waitFor(timeout time.Duration, match func(check.WatchEvent) bool) (check.WatchEvent, bool) {
	deadline := time.Now().Add(timeout)
	for {
		w.mu.Lock()
		i := slices.IndexFunc(w.events, match)
		var ev check.WatchEvent
		if i >= 0 {
			ev = w.events[i]
		}
		w.mu.Unlock()
		if i >= 0 {
			return ev, true
		}
		select {
		case <-w.exited:
			// Every line is read before exited closes: one last look.
			w.mu.Lock()
			defer w.mu.Unlock()
			if i := slices.IndexFunc(w.events, match); i >= 0 {
				return w.events[i], true
			}
			return check.WatchEvent{}, false
		default:
		}
		if !time.Now().Before(deadline) {
			return check.WatchEvent{}, false
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// wait is waitFor of the first event of a kind, failing the test without
// it.
func (w *consumerWatch) wait(t *testing.T, event string, timeout time.Duration) check.WatchEvent {
	t.Helper()
	ev, ok := w.waitFor(timeout, func(ev check.WatchEvent) bool { return ev.Event == event })
	require.True(t, ok, "%s: no %q within %s; stderr:\n%s", w.name, event, timeout, w.stderr.String())
	return ev
}

// requireExit waits for the checker to exit with the given status.
func (w *consumerWatch) requireExit(t *testing.T, status int, timeout time.Duration) {
	t.Helper()
	select {
	case <-w.exited:
	case <-time.After(timeout):
		t.Fatalf("%s is still running %s later", w.name, timeout)
	}
	var exit *exec.ExitError
	if status == 0 {
		require.NoError(t, w.err, w.name)
		return
	}
	require.True(t, errors.As(w.err, &exit), "%s: %v", w.name, w.err)
	require.Equal(t, status, exit.ExitCode(), "%s exits %d once it has lost the cluster", w.name, status)
}
