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
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	clientauthv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"

	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const podSignerName = "tokenbroker.io/e2e-workloads"

// TestNodeAPodCertificateFromTheAgentsSignerGetsALease runs the chain of
// pod certificates where it runs in production. The broker signs cluster
// CAs (pki init --cluster-cas, serve --sign-cluster-cas); the agent's
// chart, with podSigner, runs the agent as a Pod that enrolls with a join
// token, receives its cluster's CA and answers the kubelet's
// PodCertificateRequests; a workload Pod whose projected podCertificate
// volume names that signer gets its key from the kubelet (never leaving
// the node) and its certificate from the agent, and runs the exec plugin
// with them alone: no Secret holds any credential of that workload. The
// lease it gets authenticates to the API server as the granted
// ServiceAccount. Revoking the Pod's uid at the broker ends its access on
// the next request. The test logs the time from the Pod's creation to its
// first lease.
func TestNodeAPodCertificateFromTheAgentsSignerGetsALease(t *testing.T) {
	c := testcluster.Start(t, testcluster.WithNode())
	requirePodCertificates(t, c)
	setUpTarget(t, c) // argo/runner may read ConfigMaps; argo/hello
	ctx := t.Context()
	require.NoError(t, c.Node.ImportImage(ctx, imageArchive(t)))
	runner, err := c.Client.CoreV1().ServiceAccounts("argo").Get(ctx, "runner", metav1.GetOptions{})
	require.NoError(t, err)
	runner.Labels = map[string]string{"tokenbroker.io/pod-certificates": "true"}
	_, err = c.Client.CoreV1().ServiceAccounts("argo").Update(ctx, runner, metav1.UpdateOptions{})
	require.NoError(t, err)

	// The broker, on the host: a CA that may sign cluster CAs, and a
	// policy that takes west's workloads by their pod certificates.
	bin := tokenbrokerBinary(t)
	dir := t.TempDir()
	pkiDir := filepath.Join(dir, "pki")
	run(t, bin, "pki", "init", "--dir", pkiDir, "--cluster-cas")
	run(t, bin, "pki", "issue", "server", "--ca-dir", pkiDir, "--ip", "127.0.0.1", "--dns", "localhost")
	writeFile(t, filepath.Join(dir, "cluster-ca.crt"), string(c.CAData))
	pol := writeFile(t, filepath.Join(dir, "policy.yaml"), fmt.Sprintf(`cluster: {name: east, server: %s, caFile: cluster-ca.crt}
peers:
  - name: west
    identity: spiffe://e2e.example/cluster/west
    workloadIdentity: {podCertificates: true, livePodsFromPeer: true}
    agent: {namespace: tokenbroker-agent, serviceAccount: tokenbroker-agent-pod}
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
      - namespaces: [argo]
        serviceAccounts: [runner]
        workloads: [{namespace: argo, serviceAccount: runner}]
      - namespaces: [argo]
        serviceAccounts: [runner]
        workloads: [{namespace: argo, serviceAccount: runner}]
        access: gateway
`, c.URL))
	api, enroll, ops := fmt.Sprintf("127.0.0.1:%d", freePort(t)), fmt.Sprintf("127.0.0.1:%d", freePort(t)), fmt.Sprintf("127.0.0.1:%d", freePort(t))
	gateway := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	proc := startProcess(t, bin, "serve", "--listen-address", api, "--enroll-address", enroll, "--ops-address", ops,
		"--gateway-address", gateway, "--gateway-url", "https://"+gateway,
		"--tls-cert-file", filepath.Join(pkiDir, "server.crt"), "--tls-key-file", filepath.Join(pkiDir, "server.key"),
		"--client-ca-file", filepath.Join(pkiDir, "ca.crt"),
		"--ca-cert-file", filepath.Join(pkiDir, "ca.crt"), "--ca-key-file", filepath.Join(pkiDir, "ca.key"),
		"--sign-cluster-cas", "--policy-file", pol, "--kubeconfig", c.KubeconfigPath, "--namespace", "default")
	waitReady(t, proc, "http://"+ops+"/readyz")
	caPEM, err := os.ReadFile(filepath.Join(pkiDir, "ca.crt"))
	require.NoError(t, err)

	// The agent's chart in west, podSigner on, enrolling with a join token.
	token, stderr, err := runErr(bin, "pki", "join-token", "--ca-dir", pkiDir, "--trust-domain", "e2e.example", "--cluster", "west", "--audience", "east", "--ttl", "10m")
	require.NoError(t, err, stderr)
	fp := fingerprintRE.FindString(stderr)
	require.NotEmpty(t, fp, stderr)
	_, err = c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-agent"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.CoreV1().Secrets("tokenbroker-agent").Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-agent-join"}, StringData: map[string]string{"token": strings.TrimSpace(token)},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	agentValues := writeFile(t, filepath.Join(t.TempDir(), "agent-values.yaml"), agentOnNodeValues(t, c)+fmt.Sprintf(`config:
  identity:
    renewBroker: https://%s
    enroll: {broker: "https://%s", caFingerprint: "%s"}
  podSigner: {signerName: %s}
  jwksUpload:
    brokers: ["https://%s"]
    keys: false
    livePods: {namespaces: [argo, tokenbroker-agent], interval: 5s}
`, api, enroll, fp, podSignerName, api))
	ha := newHelm(t)
	ha.chart = filepath.Join(repoRoot(t), "deploy", "helm", "tokenbroker-agent")
	ha.run(t, "install", "tokenbroker-agent", ha.chart, "-f", agentValues, "--wait", "--timeout", "120s",
		"--kubeconfig", c.KubeconfigPath, "--namespace", "tokenbroker-agent")
	var identity *corev1.Secret
	require.Eventually(t, func() bool {
		identity, err = c.Client.CoreV1().Secrets("tokenbroker-agent").Get(ctx, "tokenbroker-agent-identity", metav1.GetOptions{})
		return err == nil && len(identity.Data["cluster-ca.crt"]) > 0
	}, 60*time.Second, 200*time.Millisecond, "the agent enrolls and stores its cluster's CA")
	clusterCAs, err := pki.ParseCertificatesPEM(identity.Data["cluster-ca.crt"])
	require.NoError(t, err)
	own, err := pki.ClusterCAIdentity(clusterCAs[0])
	require.NoError(t, err)
	require.Equal(t, "spiffe://e2e.example/cluster/west", own)

	// The broker's CA for the workload's plugin, in a ConfigMap: public.
	_, err = c.Client.CoreV1().ConfigMaps("argo").Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "broker-ca"}, Data: map[string]string{"ca.crt": string(caPEM)},
	}, metav1.CreateOptions{})
	require.NoError(t, err)

	pod := runPodCertificatePod(t, c, api, "pod-certificate")
	require.Equal(t, corev1.PodRunning, pod.phase, pod.logs)
	t.Logf("the Pod's creation to its first lease (the kubelet's key, the agent's certificate, the plugin's request): at most %s (seen Running; the plugin's container finished at %s)",
		pod.running.Sub(pod.created).Round(10*time.Millisecond), pod.finished.Format(time.RFC3339))
	var cred clientauthv1.ExecCredential
	require.NoError(t, json.Unmarshal([]byte(pod.logs), &cred), pod.logs)
	require.NotNil(t, cred.Status)
	review, err := c.Client.AuthenticationV1().TokenReviews().Create(ctx, &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: cred.Status.Token},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.True(t, review.Status.Authenticated, review.Status.Error)
	require.Equal(t, "system:serviceaccount:argo:runner", review.Status.User.Username)

	// The certificate the kubelet wrote, read from the node: its chain is
	// the agent's cluster CA's, and it names the Pod.
	chain, err := pki.ParseCertificatesPEM(pod.certPEM)
	require.NoError(t, err)
	require.Equal(t, "spiffe://e2e.example/cluster/west/ns/argo/sa/runner", chain[0].URIs[0].String())
	require.Equal(t, pod.uid, chain[0].Subject.SerialNumber)
	require.True(t, chain[1].Equal(clusterCAs[0]), "signed by the cluster CA the agent received")

	// The same files as a gateway kubeconfig's identity, as a client-go
	// program in the Pod would name them: kubectl reads through the lease
	// gateway, the lease's key never written anywhere.
	idDir := t.TempDir()
	writeFile(t, filepath.Join(idDir, "tls.crt"), string(pod.certPEM))
	writeFile(t, filepath.Join(idDir, "tls.key"), string(pod.keyPEM))
	writeFile(t, filepath.Join(idDir, "ca.crt"), string(caPEM))
	gatewayKC := filepath.Join(t.TempDir(), "gateway.kubeconfig")
	run(t, bin, "get", "kubeconfig", "--exec", "--access", "gateway", "--broker", "https://"+api, "--identity-dir", idDir,
		"--namespace", "argo", "--service-account", "runner", "--ttl", "1h", "-o", gatewayKC)
	kcText, err := os.ReadFile(gatewayKC)
	require.NoError(t, err)
	require.Contains(t, string(kcText), "https://"+gateway, "the kubeconfig names the gateway")
	require.Contains(t, string(kcText), idDir, "and the pod certificate's files, for the plugin")
	out, stderr, err := runWithEnv([]string{"TOKENBROKER_NO_CACHE=true"}, kubectlBinary(t), "--kubeconfig", gatewayKC, "-n", "argo",
		"get", "configmap", "hello", "-o", "jsonpath={.data.k}")
	require.NoError(t, err, stderr)
	require.Equal(t, "v", out)

	// Deleted: the agent reports the Pods without it, and the broker
	// refuses the certificate, long before it expires.
	e := &brokerEnv{dir: dir, api: api, ca: filepath.Join(pkiDir, "ca.crt")}
	body := `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`
	client := podClient(t, pod)
	var status int
	require.Eventually(t, func() bool {
		status, out = e.postKubeconfig(t, client, body)
		return status == 201
	}, 10*time.Second, 50*time.Millisecond, "the Pod's own certificate and key, by hand")
	require.NoError(t, c.Client.CoreV1().Pods("argo").Delete(ctx, "pod-certificate", metav1.DeleteOptions{GracePeriodSeconds: ptrTo(int64(0))}))
	require.Eventually(t, func() bool {
		_, err := c.Client.CoreV1().Pods("argo").Get(ctx, "pod-certificate", metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	}, 60*time.Second, 100*time.Millisecond, "the Pod is deleted")
	gone := time.Now()
	require.Eventually(t, func() bool {
		status, out = e.postKubeconfig(t, client, body)
		return status == 401
	}, 15*time.Second, 50*time.Millisecond, "a deleted Pod's certificate is refused")
	require.Equal(t, "pod-not-live", problemReason(t, out))
	t.Logf("a deleted Pod's certificate (valid until %s) was refused %s after the Pod was gone from the API server",
		chain[0].NotAfter.Format(time.RFC3339), time.Since(gone).Round(10*time.Millisecond))

	// Revoked by its Pod's uid: the next request is refused.
	second := runPodCertificatePod(t, c, api, "pod-certificate-2")
	require.Equal(t, corev1.PodRunning, second.phase, second.logs)
	client = podClient(t, second)
	require.Eventually(t, func() bool {
		status, out = e.postKubeconfig(t, client, body)
		return status == 201
	}, 10*time.Second, 50*time.Millisecond, "the new Pod is reported (a 503 until then)")
	run(t, bin, "pki", "revoke", "--pod-uid", second.uid, "--kubeconfig", c.KubeconfigPath, "--namespace", "default")
	revoked := time.Now()
	require.Eventually(t, func() bool {
		status, out = e.postKubeconfig(t, client, body)
		return status == 401
	}, 10*time.Second, 20*time.Millisecond, "a revoked Pod's certificate is refused")
	t.Logf("the Pod's certificate was refused %s after pki revoke --pod-uid returned", time.Since(revoked).Round(time.Millisecond))

	// The agent whose identity is its own Pod's certificate: a second
	// release of the chart, with podCertificate, beside the signer's.
	// The kubelet has the signer sign its certificate before it starts;
	// the broker's policy names its ServiceAccount as west's agent, so
	// that the certificate speaks for the cluster: a grant that names no
	// workload, written to a Secret for a consumer. No Secret holds a key
	// of that agent's, and no join token was used.
	_, err = c.Client.CoreV1().ConfigMaps("tokenbroker-agent").Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "broker-ca"}, Data: map[string]string{"ca.crt": string(caPEM)},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	podAgentValues := writeFile(t, filepath.Join(t.TempDir(), "pod-agent-values.yaml"), agentOnNodeValues(t, c)+fmt.Sprintf(`podCertificate: {signerName: %s, caConfigMap: broker-ca, maxExpirationSeconds: 3600}
config:
  targets:
    - name: east
      broker: https://%s
      request: {namespace: argo, serviceAccount: runner, ttl: 1h}
      outputs:
        - secret: {namespace: argo, name: east-from-pod-agent, format: admiralty}
`, podSignerName, api))
	installed := time.Now()
	// Not --wait: helm would wait for the next readiness probe too.
	ha.run(t, "install", "tokenbroker-agent-pod", ha.chart, "-f", podAgentValues,
		"--kubeconfig", c.KubeconfigPath, "--namespace", "tokenbroker-agent")
	out = ""
	require.Eventually(t, func() bool {
		s, err := c.Client.CoreV1().Secrets("argo").Get(ctx, "east-from-pod-agent", metav1.GetOptions{})
		if err == nil {
			out = string(s.Data["config"])
		}
		return out != ""
	}, 120*time.Second, 50*time.Millisecond, "the agent writes its target's Secret")
	t.Logf("the pod-certificate agent's install to its first Secret written (the kubelet's key, the signer's certificate, the lease): %s",
		time.Since(installed).Round(10*time.Millisecond))
	review, err = c.Client.AuthenticationV1().TokenReviews().Create(ctx, &authenticationv1.TokenReview{
		Spec: authenticationv1.TokenReviewSpec{Token: tokenOf(t, []byte(out))},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	require.True(t, review.Status.Authenticated, review.Status.Error)
	require.Equal(t, "system:serviceaccount:argo:runner", review.Status.User.Username)
	secrets, err := c.Client.CoreV1().Secrets("tokenbroker-agent").List(ctx, metav1.ListOptions{})
	require.NoError(t, err)
	var names []string
	for _, s := range secrets.Items {
		if s.Type != "helm.sh/release.v1" { // helm's record of each release
			names = append(names, s.Name)
		}
	}
	require.ElementsMatch(t, []string{"tokenbroker-agent-identity", "tokenbroker-agent-join"}, names,
		"the signer's identity and join token alone: nothing of the pod-certificate agent's")

	// Its certificate, read from the node, is west's at the broker until
	// its Pod's uid is revoked.
	pods, err := c.Client.CoreV1().Pods("tokenbroker-agent").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=tokenbroker-agent-pod"})
	require.NoError(t, err)
	require.Len(t, pods.Items, 1)
	agentPod := pods.Items[0]
	vol := filepath.Join(c.Node.Dir, "kubelet", "pods", string(agentPod.UID), "volumes", "kubernetes.io~projected", "pod-identity")
	agentCert, err := os.ReadFile(filepath.Join(vol, "tls.crt"))
	require.NoError(t, err)
	agentKey, err := os.ReadFile(filepath.Join(vol, "tls.key"))
	require.NoError(t, err)
	agentChain, err := pki.ParseCertificatesPEM(agentCert)
	require.NoError(t, err)
	require.Equal(t, "spiffe://e2e.example/cluster/west/ns/tokenbroker-agent/sa/tokenbroker-agent-pod", agentChain[0].URIs[0].String())
	client = podClient(t, podCertificatePod{certPEM: agentCert, keyPEM: agentKey})
	agentBody := `{"namespace":"argo","serviceAccount":"runner","ttl":"1h"}`
	status, out = e.postKubeconfig(t, client, agentBody)
	require.Equal(t, 201, status, out)
	status, out, err = e.curl(t, client, "https://"+api+"/v1/whoami")
	require.NoError(t, err, out)
	require.Equal(t, 200, status, out)
	require.Contains(t, out, `"peer":"west"`, "the agent's certificate speaks for its cluster")
	require.NotContains(t, out, `"workload"`, "not for a workload")
	run(t, bin, "pki", "revoke", "--pod-uid", string(agentPod.UID), "--kubeconfig", c.KubeconfigPath, "--namespace", "default")
	require.Eventually(t, func() bool {
		status, out = e.postKubeconfig(t, client, agentBody)
		return status == 401
	}, 10*time.Second, 20*time.Millisecond, "a revoked agent Pod's certificate is refused")
}

// agentOnNodeValues is the start of the agent chart's values on the
// harness's node: the image imported there, the host's network (where the
// API server and the broker listen on 127.0.0.1) with a free ops port,
// and the API server's address.
func agentOnNodeValues(t *testing.T, c *testcluster.Cluster) string {
	t.Helper()
	ref := imageRef(t)
	return fmt.Sprintf(`image:
  repository: %s
  tag: %s
  pullPolicy: Never
hostNetwork: true
containerPorts: {ops: %d}
extraEnv:
  - {name: KUBERNETES_SERVICE_HOST, value: 127.0.0.1}
  - {name: KUBERNETES_SERVICE_PORT, value: "%s"}
`, ref[:strings.LastIndex(ref, ":")], ref[strings.LastIndex(ref, ":")+1:], freePort(t), c.URL[strings.LastIndex(c.URL, ":")+1:])
}

// podClient writes the certificate and key the kubelet wrote for pod, for
// brokerEnv.curl, and returns their common prefix.
func podClient(t *testing.T, pod podCertificatePod) string {
	t.Helper()
	client := filepath.Join(t.TempDir(), "pod")
	writeFile(t, client+".crt", string(pod.certPEM))
	writeFile(t, client+".key", string(pod.keyPEM))
	return client
}

// requirePodCertificates skips on a Kubernetes that does not serve
// PodCertificateRequests at certificates.k8s.io/v1 by default (before
// 1.37).
func requirePodCertificates(t *testing.T, c *testcluster.Cluster) {
	t.Helper()
	res, err := c.Client.Discovery().ServerResourcesForGroupVersion("certificates.k8s.io/v1")
	require.NoError(t, err)
	for _, r := range res.APIResources {
		if r.Name == "podcertificaterequests" {
			return
		}
	}
	v, err := c.Client.Discovery().ServerVersion()
	require.NoError(t, err)
	t.Skipf("pod certificates need certificates.k8s.io/v1 PodCertificateRequests (Kubernetes 1.37); this API server is %s", v.GitVersion)
}

// podCertificatePod is how the workload Pod went, with what the kubelet
// wrote to its podCertificate volume.
type podCertificatePod struct {
	uid             string
	phase           corev1.PodPhase
	logs            string
	created         time.Time // its create call returned
	running         time.Time // first seen Running, the plugin done
	finished        time.Time // the plugin's container finished (to the second)
	certPEM, keyPEM []byte
}

// runPodCertificatePod runs `tokenbroker credential` once in a Pod of
// argo/runner on the host's network (where the broker listens on
// 127.0.0.1), whose identity directory is its podCertificate volume
// (tls.crt, tls.key) and the broker's CA (ca.crt, a ConfigMap).
func runPodCertificatePod(t *testing.T, c *testcluster.Cluster, api, name string) podCertificatePod {
	t.Helper()
	nonroot := int64(65532)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "argo"},
		Spec: corev1.PodSpec{
			ServiceAccountName:           "runner",
			AutomountServiceAccountToken: ptrTo(false),
			HostNetwork:                  true,
			RestartPolicy:                corev1.RestartPolicyNever,
			SecurityContext:              &corev1.PodSecurityContext{RunAsUser: &nonroot, RunAsGroup: &nonroot, FSGroup: &nonroot},
			Containers:                   []corev1.Container{{Name: "hold", Image: testcluster.NodeImageRef, ImagePullPolicy: corev1.PullNever}},
			InitContainers: []corev1.Container{{
				Name: "credential", Image: imageRef(t), ImagePullPolicy: corev1.PullNever,
				Args: []string{"credential", "--broker", "https://" + api, "--identity-dir", "/identity",
					"--namespace", "argo", "--service-account", "runner", "--ttl", "1h", "--no-cache"},
				VolumeMounts: []corev1.VolumeMount{{Name: "identity", MountPath: "/identity", ReadOnly: true}},
			}},
			Volumes: []corev1.Volume{{Name: "identity", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
				DefaultMode: ptrTo(int32(0o440)),
				Sources: []corev1.VolumeProjection{
					{PodCertificate: &corev1.PodCertificateProjection{SignerName: podSignerName, KeyType: "ECDSAP256",
						CertificateChainPath: "tls.crt", KeyPath: "tls.key"}},
					{ConfigMap: &corev1.ConfigMapProjection{LocalObjectReference: corev1.LocalObjectReference{Name: "broker-ca"}}},
				},
			}}}},
		},
	}
	created, err := c.Client.CoreV1().Pods("argo").Create(t.Context(), pod, metav1.CreateOptions{})
	require.NoError(t, err)
	createdAt := time.Now()
	var p *corev1.Pod
	require.Eventually(t, func() bool {
		p, err = c.Client.CoreV1().Pods("argo").Get(t.Context(), pod.Name, metav1.GetOptions{})
		return err == nil && (p.Status.Phase == corev1.PodRunning || p.Status.Phase == corev1.PodFailed)
	}, 120*time.Second, 200*time.Millisecond, "the Pod never ran its plugin")
	logs, err := c.Client.CoreV1().Pods("argo").GetLogs(pod.Name, &corev1.PodLogOptions{Container: "credential"}).DoRaw(t.Context())
	require.NoError(t, err)
	out := podCertificatePod{uid: string(created.UID), phase: p.Status.Phase, logs: strings.TrimSpace(string(logs)),
		created: createdAt, running: time.Now()}
	if p.Status.Phase != corev1.PodRunning {
		return out
	}
	if st := p.Status.InitContainerStatuses; len(st) == 1 && st[0].State.Terminated != nil {
		out.finished = st[0].State.Terminated.FinishedAt.Time
	}
	vol := filepath.Join(c.Node.Dir, "kubelet", "pods", out.uid, "volumes", "kubernetes.io~projected", "identity")
	out.certPEM, err = os.ReadFile(filepath.Join(vol, "tls.crt"))
	require.NoError(t, err, "the kubelet projects the certificate chain into %s", vol)
	out.keyPEM, err = os.ReadFile(filepath.Join(vol, "tls.key"))
	require.NoError(t, err)
	return out
}
