package e2e

import (
	"context"
	"crypto"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	certv1 "k8s.io/api/certificates/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// certPolicy is the e2e policy with a clientCertificate grant: west may
// get tokens for argo/runner, and client certificates whose user may do in
// argo what the ClusterRole view allows.
func certPolicy(c *testcluster.Cluster) string {
	return fmt.Sprintf(`cluster:
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
      - namespaces: [argo]
        credential: clientCertificate
        clusterRole: view
        maxTTL: 2h
`, c.URL)
}

// applyClientCertificateRBAC applies, for real, the ServiceAccount and RBAC
// of deploy/base with the component deploy/components/client-certificates
// (its RBAC and its ValidatingAdmissionPolicy), as an overlay renders them.
func applyClientCertificateRBAC(t *testing.T, c *testcluster.Cluster) {
	t.Helper()
	kubectl := kubectlBinary(t)
	overlay := t.TempDir()
	rel := func(p string) string {
		r, err := filepath.Rel(overlay, filepath.Join(repoRoot(t), p))
		require.NoError(t, err)
		return r
	}
	writeFile(t, filepath.Join(overlay, "kustomization.yaml"), fmt.Sprintf("resources: [%s]\ncomponents: [%s]\n",
		rel("deploy/base"), rel("deploy/components/client-certificates")))
	docs := splitManifests(t, run(t, kubectl, "kustomize", overlay))
	var b strings.Builder
	for _, d := range docs {
		switch {
		case d.Kind == "Namespace", d.Kind == "ServiceAccount", strings.Contains(d.Kind, "Role"), strings.HasPrefix(d.Kind, "ValidatingAdmissionPolicy"):
			b.WriteString("---\n")
			b.Write(d.raw)
		}
	}
	run(t, kubectl, "--kubeconfig", c.KubeconfigPath, "apply", "-f", writeFile(t, filepath.Join(t.TempDir(), "rbac.yaml"), b.String()))
}

// TestClientCertificateKubeconfigs issues client-certificate kubeconfigs
// from a broker that runs with nothing but the RBAC of deploy/base and the
// client-certificates component, against a real kube-apiserver and a real
// kube-controller-manager that signs (csrsigning) and collects garbage.
func TestClientCertificateKubeconfigs(t *testing.T) {
	c := testcluster.Start(t, testcluster.WithControllerManager("csrsigning", "garbagecollector", "clusterrole-aggregation"))
	ctx := context.Background()
	kubectl := kubectlBinary(t)
	setUpTarget(t, c)
	applyClientCertificateRBAC(t, c)
	// view is an aggregated ClusterRole: its rules arrive once
	// kube-controller-manager has aggregated them.
	require.Eventually(t, func() bool {
		view, err := c.Client.RbacV1().ClusterRoles().Get(ctx, "view", metav1.GetOptions{})
		return err == nil && len(view.Rules) > 0
	}, 30*time.Second, 100*time.Millisecond, "the ClusterRole view was never aggregated")
	brokerKubeconfig := serviceAccountKubeconfig(t, c, "tokenbroker", "tokenbroker")
	e := newBrokerEnv(t, &testcluster.Cluster{URL: c.URL, CAData: c.CAData, KubeconfigPath: brokerKubeconfig},
		"--credentials", "token,clientCertificate", "--namespace", "tokenbroker")
	writeFile(t, e.policy, certPolicy(c))
	e.launch(t)
	west := filepath.Join(e.dir, "west")
	api := "https://" + e.api

	// A CSR made by someone else, before the broker issues anything: it
	// must stay pending.
	otherCSR, _, _, err := pki.NewUserCSR(func(crypto.PublicKey) (string, error) { return "mallory", nil }, nil)
	require.NoError(t, err)
	_, err = c.Client.CertificatesV1().CertificateSigningRequests().Create(ctx, &certv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{Name: "not-the-brokers"},
		Spec: certv1.CertificateSigningRequestSpec{
			Request: otherCSR, SignerName: certv1.KubeAPIServerClientSignerName,
			Usages: []certv1.KeyUsage{certv1.UsageClientAuth, certv1.UsageDigitalSignature},
		},
	}, metav1.CreateOptions{})
	require.NoError(t, err)

	kubectlAs := func(kc string, args ...string) (string, string, error) {
		return runErr(kubectl, append([]string{"--kubeconfig", kc}, args...)...)
	}
	var leaseID, user string
	kc := filepath.Join(e.dir, "cert.kubeconfig")

	t.Run("a certificate from the broker's key may do what view allows in argo, and nothing else", func(t *testing.T) {
		status, body := e.postKubeconfig(t, west, `{"namespace":"argo","credential":"clientCertificate","ttl":"1h"}`)
		require.Equal(t, 201, status, body)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(body), &resp))
		require.Equal(t, apiv1.CredentialClientCertificate, resp.Credential)
		require.Empty(t, resp.Token)
		require.Regexp(t, `^tokenbroker:west:[0-9a-f]{32}$`, resp.User)
		require.WithinDuration(t, time.Now().Add(time.Hour), resp.ExpiresAt, time.Minute, "the expiry read from the certificate")
		leaseID, user = resp.LeaseID, resp.User
		require.Contains(t, resp.Kubeconfig, "client-certificate-data")
		require.Contains(t, resp.Kubeconfig, "client-key-data")
		writeFile(t, kc, resp.Kubeconfig)

		out, stderr, err := kubectlAs(kc, "-n", "argo", "get", "configmap", "hello", "-o", "jsonpath={.data.k}")
		require.NoError(t, err, stderr)
		require.Equal(t, "v", out)
		out, _, err = kubectlAs(kc, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
		require.NoError(t, err)
		require.Equal(t, user, out)
		for _, args := range [][]string{{"-n", "argo", "get", "secrets"}, {"-n", "default", "get", "configmaps"}, {"-n", "argo", "create", "configmap", "x"}} {
			_, stderr, err := kubectlAs(kc, args...)
			require.Error(t, err, "%v must be refused", args)
			require.Contains(t, strings.ToLower(stderr), "forbidden", args)
		}
		rb, err := c.Client.RbacV1().RoleBindings("argo").Get(ctx, "tokenbroker-lease-"+leaseID, metav1.GetOptions{})
		require.NoError(t, err)
		require.Equal(t, "Secret", rb.OwnerReferences[0].Kind, "the lease owns the binding")
		require.Equal(t, user, rb.Subjects[0].Name)
		csrs, err := c.Client.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{LabelSelector: "tokenbroker.io/lease-id=" + leaseID})
		require.NoError(t, err)
		require.Empty(t, csrs.Items, "the CSR is deleted once the certificate is read")
		e.requireLog(t, `"certificate_serial"`)
	})

	t.Run("after DELETE of its lease the certificate is refused within seconds, although it has not expired", func(t *testing.T) {
		status, body, err := e.curl(t, west, "-X", "DELETE", api+"/v1/leases/"+leaseID)
		require.NoError(t, err)
		require.Equal(t, 204, status, body)
		deleted := time.Now()
		var refusedAfter time.Duration
		require.Eventually(t, func() bool {
			_, stderr, err := kubectlAs(kc, "-n", "argo", "get", "configmap", "hello")
			refusedAfter = time.Since(deleted)
			return err != nil && strings.Contains(stderr, "Forbidden")
		}, 10*time.Second, 50*time.Millisecond)
		t.Logf("refused %s after DELETE", refusedAfter.Round(time.Millisecond))
	})

	t.Run("a one-minute certificate lease works at 50 s and is forbidden by 75 s, though the certificate lives ten minutes", func(t *testing.T) {
		start := time.Now()
		status, body := e.postKubeconfig(t, west, `{"namespace":"argo","credential":"clientCertificate","ttl":"1m"}`)
		require.Equal(t, 201, status, body)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(body), &resp))
		require.Equal(t, "1m0s", resp.GrantedTTL)
		require.Empty(t, resp.ClampedBy)
		require.WithinDuration(t, start.Add(time.Minute), resp.ExpiresAt, 5*time.Second, "the lease's expiry")
		short := filepath.Join(e.dir, "short.kubeconfig")
		writeFile(t, short, resp.Kubeconfig)
		cfg, err := clientcmd.Load([]byte(resp.Kubeconfig))
		require.NoError(t, err)
		for _, ai := range cfg.AuthInfos {
			leaf, err := pki.ParseCertificatesPEM(ai.ClientCertificateData)
			require.NoError(t, err)
			require.WithinDuration(t, start.Add(10*time.Minute), leaf[0].NotAfter, time.Minute, "the CSR API's minimum")
		}

		time.Sleep(time.Until(start.Add(50 * time.Second)))
		_, stderr, err := kubectlAs(short, "-n", "argo", "get", "configmap", "hello")
		require.NoError(t, err, "the certificate works at 50 s: %s", stderr)
		require.Eventually(t, func() bool {
			_, stderr, err := kubectlAs(short, "-n", "argo", "get", "configmap", "hello")
			return err != nil && strings.Contains(stderr, "Forbidden")
		}, time.Until(start.Add(75*time.Second)), 250*time.Millisecond, "forbidden by 75 s: the lease's RoleBinding is gone")
		t.Logf("forbidden %s after issuance", time.Since(start).Round(time.Millisecond))
		_, err = c.Client.RbacV1().RoleBindings("argo").Get(ctx, "tokenbroker-lease-"+resp.LeaseID, metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "the RoleBinding is deleted: %v", err)
	})

	t.Run("the recipe of docs/api.md with the broker's key runs as printed", func(t *testing.T) {
		dir := t.TempDir()
		copyPeerFiles(t, e, dir)
		script := strings.ReplaceAll(fencedBlock(t, readDoc(t, "docs/api.md"), "sh", `curl -sS --fail-with-body --cert west.crt --key west.key --cacert ca.crt -H 'Content-Type: application/json' -H 'Accept: application/yaml' -d '{"namespace":"argo","credential":"clientCertificate"`), "https://broker.example:8443", api)
		out := runShell(t, dir, kubectl, filepath.Join(dir, "unused"), script)
		require.Regexp(t, `tokenbroker:west:[0-9a-f]{32}`, out)
	})

	t.Run("with its own CSR the key never leaves the peer, and the kubeconfig works with it", func(t *testing.T) {
		dir := t.TempDir()
		// The recipe of docs/api.md, as printed but for the broker's address.
		script := strings.ReplaceAll(fencedBlock(t, readDoc(t, "docs/api.md"), "sh", "PEER=$(curl"), "https://broker.example:8443", api)
		copyPeerFiles(t, e, dir)
		out := runShell(t, dir, kubectl, filepath.Join(dir, "unused"), script)
		require.Regexp(t, `tokenbroker:west:[0-9a-f]{32}`, out, "kubectl auth whoami is the per-lease user")
		own, err := os.ReadFile(filepath.Join(dir, "own.kubeconfig"))
		require.NoError(t, err)
		_, stderr, err := kubectlAs(filepath.Join(dir, "own.kubeconfig"), "-n", "argo", "get", "configmap", "hello")
		require.NoError(t, err, stderr)
		require.Contains(t, string(own), "client-key-data", "the key was added by the recipe")
		csrPEM, err := os.ReadFile(filepath.Join(dir, "csr.pem"))
		require.NoError(t, err)

		body, err := json.Marshal(map[string]string{"namespace": "argo", "credential": "clientCertificate", "csr": string(csrPEM)})
		require.NoError(t, err)
		status, resp := e.postKubeconfig(t, west, string(body))
		require.Equal(t, 422, status, "a key that backs a live lease is refused: %s", resp)
		require.Contains(t, resp, "already backs the live lease")
	})

	identityDir := westIdentityDir(t, e)

	t.Run("tokenbroker get kubeconfig --credential client-certificate makes its key and gets a working kubeconfig", func(t *testing.T) {
		out := filepath.Join(t.TempDir(), "east.kubeconfig")
		_, stderr, err := runErr(tokenbrokerBinary(t), "get", "kubeconfig", "--broker", api, "--identity-dir", identityDir,
			"--namespace", "argo", "--credential", "client-certificate", "--ttl", "30m", "-o", out)
		require.NoError(t, err, stderr)
		require.Contains(t, stderr, "for a client certificate in argo")
		_, stderr, err = kubectlAs(out, "-n", "argo", "get", "configmap", "hello")
		require.NoError(t, err, stderr)
		_, stderr, err = runErr(tokenbrokerBinary(t), "get", "kubeconfig", "--broker", api, "--identity-dir", identityDir,
			"--namespace", "argo", "--credential", "client-certificate", "--service-account", "runner")
		require.Error(t, err)
		require.Contains(t, stderr, "--service-account is for tokens")
	})

	t.Run("the agent keeps a client-certificate kubeconfig in a Secret", func(t *testing.T) {
		ops := fmt.Sprintf("127.0.0.1:%d", freePort(t))
		config := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), fmt.Sprintf(`identity: {dir: %s}
targets:
  - name: east
    broker: %s
    request: {namespace: argo, credential: clientCertificate, ttl: 1h}
    outputs:
      - secret: {namespace: default, name: east-certificate, format: kubeconfig}
opsAddress: %q
kubeconfig: %s
`, identityDir, api, ops, c.KubeconfigPath))
		startProcess(t, tokenbrokerBinary(t), "agent", "--config", config)
		var kubeconfig []byte
		require.Eventually(t, func() bool {
			s, err := c.Client.CoreV1().Secrets("default").Get(ctx, "east-certificate", metav1.GetOptions{})
			if err == nil {
				kubeconfig = s.Data["kubeconfig"]
			}
			return len(kubeconfig) > 0
		}, 20*time.Second, 100*time.Millisecond)
		file := writeFile(t, filepath.Join(t.TempDir(), "kubeconfig"), string(kubeconfig))
		out, stderr, err := kubectlAs(file, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
		require.NoError(t, err, stderr)
		require.Regexp(t, `^tokenbroker:west:[0-9a-f]{32}$`, out)
	})

	t.Run("a CSR for another user, with groups, or with SANs is refused before anything is created", func(t *testing.T) {
		for _, subj := range []string{"/CN=admin", "/CN=tokenbroker:west:0123456789abcdef0123456789abcdef/O=system:masters"} {
			dir := t.TempDir()
			runShell(t, dir, kubectl, filepath.Join(dir, "unused"), fmt.Sprintf(
				"openssl ecparam -name prime256v1 -genkey -noout -out key.pem\nopenssl req -new -key key.pem -subj %q -out csr.pem\n", subj))
			csrPEM, err := os.ReadFile(filepath.Join(dir, "csr.pem"))
			require.NoError(t, err)
			body, err := json.Marshal(map[string]string{"namespace": "argo", "credential": "clientCertificate", "csr": string(csrPEM)})
			require.NoError(t, err)
			status, resp := e.postKubeconfig(t, west, string(body))
			require.Equal(t, 400, status, "%s: %s", subj, resp)
			require.Contains(t, resp, `"field":"csr"`)
		}
	})

	t.Run("the broker approved nothing it did not create, and its ServiceAccount may not", func(t *testing.T) {
		csr, err := c.Client.CertificatesV1().CertificateSigningRequests().Get(ctx, "not-the-brokers", metav1.GetOptions{})
		require.NoError(t, err)
		require.Empty(t, csr.Status.Conditions, "still pending")
		_, stderr, err := runErr(kubectl, "--kubeconfig", brokerKubeconfig, "certificate", "approve", "not-the-brokers")
		require.Error(t, err)
		require.Contains(t, stderr, "tokenbroker may approve only the CertificateSigningRequests it created itself")
	})
}

// westIdentityDir is an identity directory for west as "tokenbroker
// enroll" writes it (tls.crt, tls.key, ca.crt), for the CLI and the agent.
func westIdentityDir(t *testing.T, e *brokerEnv) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "west-identity")
	require.NoError(t, os.Mkdir(dir, 0o700))
	for src, dst := range map[string]string{filepath.Join(e.dir, "west.crt"): "tls.crt", filepath.Join(e.dir, "west.key"): "tls.key", e.ca: "ca.crt"} {
		b, err := os.ReadFile(src)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, dst), b, 0o600))
	}
	return dir
}

// copyPeerFiles puts west's certificate and key and the broker's CA into
// dir under the names docs/api.md uses.
func copyPeerFiles(t *testing.T, e *brokerEnv, dir string) {
	t.Helper()
	for src, dst := range map[string]string{filepath.Join(e.dir, "west.crt"): "west.crt", filepath.Join(e.dir, "west.key"): "west.key", e.ca: "ca.crt"} {
		b, err := os.ReadFile(src)
		require.NoError(t, err)
		writeFile(t, filepath.Join(dir, dst), string(b))
	}
}

// TestClientCertificatesWithoutASigner asks a broker in a cluster whose
// kube-controller-manager does not sign (as on EKS) for a certificate: the
// answer is a clear 504, and no lease, RoleBinding or CSR is left behind.
func TestClientCertificatesWithoutASigner(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	setUpTarget(t, c)
	e := newBrokerEnv(t, c, "--credentials", "token,clientCertificate", "--signing-timeout", "2s")
	writeFile(t, e.policy, certPolicy(c))
	e.launch(t)
	start := time.Now()
	status, body := e.postKubeconfig(t, filepath.Join(e.dir, "west"), `{"namespace":"argo","credential":"clientCertificate"}`)
	require.Equal(t, 504, status, body)
	require.Contains(t, body, "did not sign the certificate in time")
	require.Contains(t, body, "urn:tokenbroker:problem:timeout")
	require.Less(t, time.Since(start), 10*time.Second)

	secrets, err := c.Client.CoreV1().Secrets("argo").List(ctx, metav1.ListOptions{LabelSelector: "tokenbroker.io/kind=lease"})
	require.NoError(t, err)
	require.Empty(t, secrets.Items, "no lease left")
	rbs, err := c.Client.RbacV1().RoleBindings("argo").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/managed-by=tokenbroker"})
	require.NoError(t, err)
	require.Empty(t, rbs.Items, "no RoleBinding left")
	csrs, err := c.Client.CertificatesV1().CertificateSigningRequests().List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/managed-by=tokenbroker"})
	require.NoError(t, err)
	require.Empty(t, csrs.Items, "no CSR left")
}
