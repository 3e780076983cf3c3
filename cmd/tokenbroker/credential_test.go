package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientauthv1 "k8s.io/client-go/pkg/apis/clientauthentication/v1"
	clientauthv1beta1 "k8s.io/client-go/pkg/apis/clientauthentication/v1beta1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/tokenbroker/tokenbroker/agent/execcred"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// credBroker is a broker stand-in over mutual TLS that issues numbered
// tokens (POST /v1/kubeconfigs) and revokes leases (DELETE
// /v1/leases/{id}), and an identity directory it trusts.
type credBroker struct {
	url, identityDir string
	mu               sync.Mutex
	issued           int
	revoked          []string
	// execs counts POST /v1/kubeconfigs?format=exec, namespaces the
	// namespaces asked for.
	execs      int
	namespaces []string
	// ca signs gateway lease certificates; reqs are the requests of
	// POST /v1/kubeconfigs that issued.
	ca   *pki.CA
	reqs []apiv1.KubeconfigRequest
}

// The lease gateway of credBroker: a gateway request gets a kubeconfig
// that names it (its URL and the CA of its serving certificate).
const credGatewayServer = "https://gateway.east.example.com:8445"

var credGatewayCA = func() []byte {
	ca, err := pki.NewCA(pki.CAOptions{})
	if err != nil {
		panic(err)
	}
	return ca.BundlePEM()
}()

// credTestCA is a PEM certificate for the kubeconfig's cluster; nothing
// connects to it.
var credTestCA = func() []byte {
	ca, err := pki.NewCA(pki.CAOptions{})
	if err != nil {
		panic(err)
	}
	return ca.BundlePEM()
}()

func newCredBroker(t *testing.T) *credBroker {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{})
	require.NoError(t, err)
	server, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	serverCert, err := server.TLSCertificate()
	require.NoError(t, err)
	b := &credBroker{ca: ca}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.mu.Lock()
		defer b.mu.Unlock()
		if id, ok := strings.CutPrefix(r.URL.Path, "/v1/leases/"); ok && r.Method == http.MethodDelete {
			b.revoked = append(b.revoked, id)
			w.WriteHeader(http.StatusNoContent)
			return
		}
		var req apiv1.KubeconfigRequest
		if r.URL.Path != "/v1/kubeconfigs" || json.NewDecoder(r.Body).Decode(&req) != nil {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		b.namespaces = append(b.namespaces, req.Namespace)
		if r.URL.Query().Get("format") == "exec" {
			b.execs++
			cfg := testClientcmdConfig(req.Namespace, "")
			if req.Access == apiv1.AccessGateway {
				cfg.Clusters["east"] = &clientcmdapi.Cluster{Server: credGatewayServer, CertificateAuthorityData: credGatewayCA}
			}
			cfg.AuthInfos["runner@east"] = &clientcmdapi.AuthInfo{Exec: &clientcmdapi.ExecConfig{Command: "tokenbroker", APIVersion: execcred.APIVersionV1}}
			kc, _ := clientcmd.Write(*cfg)
			w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
			_ = json.NewEncoder(w).Encode(apiv1.ExecKubeconfigResponse{Kubeconfig: string(kc)})
			return
		}
		b.issued++
		b.reqs = append(b.reqs, req)
		id := fmt.Sprintf("abcdefghijklmnopqrstuvwx%c%c", 'a'+b.issued/26, 'a'+b.issued%26)
		token := fmt.Sprintf("tok-%d-SECRET", b.issued)
		cfg := testClientcmdConfig(req.Namespace, token)
		if req.Access == apiv1.AccessGateway {
			// As the broker answers a gateway request with a CSR: a lease
			// certificate for the CSR's key, no key, no token.
			csr, err := pki.ParseLeaseCSRPEM([]byte(req.CSR))
			if err != nil {
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			kp, err := b.ca.SignLease(csr.PublicKey, pki.LeaseName{Namespace: req.Namespace, ServiceAccount: req.ServiceAccount, ID: id,
				UID: "0b6f3c52-1d2e-4f3a-9b7c-5e6d7f8a9b0c", Peer: "spiffe://oc.example/cluster/west"}, time.Now().Add(time.Hour))
			if err != nil {
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			token = ""
			cfg.Clusters["east"] = &clientcmdapi.Cluster{Server: credGatewayServer, CertificateAuthorityData: credGatewayCA}
			cfg.AuthInfos["runner@east"] = &clientcmdapi.AuthInfo{ClientCertificateData: kp.CertPEM}
		}
		kc, err := clientcmd.Write(*cfg)
		if err != nil {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(apiv1.KubeconfigResponse{
			LeaseID:    id,
			Kubeconfig: string(kc),
			Token:      token,
			ExpiresAt:  time.Now().Add(time.Hour).UTC().Truncate(time.Second),
			GrantedTTL: "1h0m0s",
			Access:     req.Access,
		})
	}))
	srv.TLS = &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{serverCert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    ca.CertPool(),
	}
	srv.StartTLS()
	t.Cleanup(srv.Close)
	b.url = srv.URL
	b.identityDir = t.TempDir()
	kp, err := ca.IssueClient(pki.ClientOptions{Identity: "spiffe://oc.example/cluster/west"})
	require.NoError(t, err)
	require.NoError(t, kp.WriteFiles(filepath.Join(b.identityDir, "tls.crt"), filepath.Join(b.identityDir, "tls.key")))
	require.NoError(t, os.WriteFile(filepath.Join(b.identityDir, "ca.crt"), ca.BundlePEM(), 0o644))
	return b
}

func (b *credBroker) counts() (issued int, revoked []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.issued, append([]string(nil), b.revoked...)
}

// testClientcmdConfig is the broker's kubeconfig for a token.
func testClientcmdConfig(namespace, token string) *clientcmdapi.Config {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["east"] = &clientcmdapi.Cluster{Server: "https://east.example.com:6443", CertificateAuthorityData: credTestCA, TLSServerName: "api.east"}
	cfg.AuthInfos["runner@east"] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "east", AuthInfo: "runner@east", Namespace: namespace}
	cfg.CurrentContext = "c"
	return cfg
}

// runCredentialCommand runs "tokenbroker credential" in this process and
// returns its standard output, and the one line main would print on
// failure.
func runCredentialCommand(t *testing.T, args ...string) (stdout, errLine string) {
	t.Helper()
	cmd := newCredentialCommand()
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(args)
	if err := cmd.ExecuteContext(context.Background()); err != nil {
		line := errorLine(err)
		require.NotContains(t, line, "\n", "one line")
		require.NotContains(t, line, "SECRET")
		return out.String(), line
	}
	require.Empty(t, errOut.String(), "nothing on stderr when it works: kubectl would show it")
	return out.String(), ""
}

func (b *credBroker) args(extra ...string) []string {
	return append([]string{"--broker", b.url, "--identity-dir", b.identityDir, "--namespace", "argo", "--service-account", "runner"}, extra...)
}

func TestCredentialAnswersWithAnExecCredentialAndCachesIt(t *testing.T) {
	t.Parallel()
	b := newCredBroker(t)
	cache := filepath.Join(t.TempDir(), "cache")
	before := time.Now()
	out, errLine := runCredentialCommand(t, b.args("--cache-dir", cache)...)
	require.Empty(t, errLine)
	var cred clientauthv1.ExecCredential
	require.NoError(t, json.Unmarshal([]byte(out), &cred))
	require.Equal(t, execcred.APIVersionV1, cred.APIVersion, "without KUBERNETES_EXEC_INFO the answer is v1")
	require.Equal(t, "ExecCredential", cred.Kind)
	require.Equal(t, "tok-1-SECRET", cred.Status.Token)
	require.WithinDuration(t, before.Add(time.Duration(0.66*float64(time.Hour))), cred.Status.ExpirationTimestamp.Time, 5*time.Second,
		"the expiration is the refresh point, 0.66 of the hour granted")

	again, errLine := runCredentialCommand(t, b.args("--cache-dir", cache)...)
	require.Empty(t, errLine)
	require.Equal(t, out, again)
	issued, _ := b.counts()
	require.Equal(t, 1, issued, "the second invocation read the cache")
	st, err := os.Stat(cache)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), st.Mode().Perm())

	other, errLine := runCredentialCommand(t, b.args("--cache-dir", cache, "--ttl", "2h", "--refresh-fraction", "0.5")...)
	require.Empty(t, errLine)
	require.Contains(t, other, "tok-2-SECRET", "another request is another entry")
}

func TestCredentialWithNoCacheAsksTheBrokerEveryTime(t *testing.T) {
	t.Parallel()
	b := newCredBroker(t)
	cache := filepath.Join(t.TempDir(), "cache")
	for range 2 {
		_, errLine := runCredentialCommand(t, b.args("--no-cache", "--cache-dir", cache)...)
		require.Empty(t, errLine)
	}
	issued, _ := b.counts()
	require.Equal(t, 2, issued)
	_, err := os.Stat(cache)
	require.ErrorIs(t, err, os.ErrNotExist, "no cache is made")
}

func TestCredentialAnswersInTheVersionClientGoAsksFor(t *testing.T) {
	b := newCredBroker(t)
	t.Setenv("TOKENBROKER_CACHE_DIR", filepath.Join(t.TempDir(), "cache"))
	t.Setenv(execcred.ExecInfoEnv, `{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1beta1","spec":{"interactive":false}}`)
	out, errLine := runCredentialCommand(t, b.args()...)
	require.Empty(t, errLine)
	var cred clientauthv1beta1.ExecCredential
	require.NoError(t, json.Unmarshal([]byte(out), &cred))
	require.Equal(t, execcred.APIVersionV1beta1, cred.APIVersion)
	require.Equal(t, "tok-1-SECRET", cred.Status.Token)

	t.Setenv(execcred.ExecInfoEnv, `{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1alpha1"}`)
	out, errLine = runCredentialCommand(t, b.args()...)
	require.Empty(t, out)
	require.Contains(t, errLine, `tokenbroker credential: KUBERNETES_EXEC_INFO: apiVersion "client.authentication.k8s.io/v1alpha1" is not supported`)
}

func TestCredentialUsesXDGCacheHome(t *testing.T) {
	b := newCredBroker(t)
	xdg := t.TempDir()
	t.Setenv("XDG_CACHE_HOME", xdg)
	_, errLine := runCredentialCommand(t, b.args()...)
	require.Empty(t, errLine)
	files, err := filepath.Glob(filepath.Join(xdg, "tokenbroker", "*.json"))
	require.NoError(t, err)
	require.Len(t, files, 1)
}

func TestCredentialFailsWithOneClearLine(t *testing.T) {
	t.Parallel()
	b := newCredBroker(t)
	cache := filepath.Join(t.TempDir(), "cache")
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{name: "a broker that is down is named by its URL",
			args: []string{"--broker", "https://127.0.0.1:1", "--identity-dir", b.identityDir, "--namespace", "argo", "--service-account", "runner", "--cache-dir", cache},
			want: []string{"tokenbroker credential: broker https://127.0.0.1:1: ", "connection refused"}},
		{name: "every missing flag is said at once, on one line",
			args: []string{"--refresh-fraction", "1"},
			want: []string{"tokenbroker credential: --broker is required; --identity-dir is required; --namespace is required; --service-account is required; --refresh-fraction must be between 0 and 1, not 1"}},
		{name: "a request the broker would refuse is refused here",
			args: b.args("--ttl", "soon", "--cache-dir", cache),
			want: []string{"tokenbroker credential: ", "request.ttl: must be a duration"}},
		{name: "an unknown flag is the plugin's failure too",
			args: []string{"--tll", "1h"},
			want: []string{"tokenbroker credential: unknown flag: --tll"}},
		{name: "an identity directory without a certificate is said",
			args: []string{"--broker", b.url, "--identity-dir", t.TempDir(), "--namespace", "argo", "--service-account", "runner", "--cache-dir", cache},
			want: []string{"tokenbroker credential: read the client certificate: ", "no such file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			out, errLine := runCredentialCommand(t, tc.args...)
			require.Empty(t, out, "nothing on stdout")
			for _, w := range tc.want {
				require.Contains(t, errLine, w)
			}
		})
	}
}

func TestCredentialRefusesAWorldReadableCacheFile(t *testing.T) {
	t.Parallel()
	b := newCredBroker(t)
	cache := filepath.Join(t.TempDir(), "cache")
	_, errLine := runCredentialCommand(t, b.args("--cache-dir", cache)...)
	require.Empty(t, errLine)
	files, err := filepath.Glob(filepath.Join(cache, "*.json"))
	require.NoError(t, err)
	require.Len(t, files, 1)
	require.NoError(t, os.Chmod(files[0], 0o644))
	out, errLine := runCredentialCommand(t, b.args("--cache-dir", cache)...)
	require.Empty(t, out)
	require.Equal(t, "tokenbroker credential: unsafe credential cache: the cache file "+files[0]+
		" has mode 0644: group or others could read the credential in it; delete it (rm "+files[0]+"), a new one is made with mode 0600", errLine)
}

func TestErrorLineOfOtherCommandsIsUnchanged(t *testing.T) {
	t.Parallel()
	require.Equal(t, "tokenbroker: boom", errorLine(fmt.Errorf("boom")))
}

func TestGetKubeconfigExecRevokesTheLeaseAndWritesAKubeconfigThatRunsThePlugin(t *testing.T) {
	t.Parallel()
	b := newCredBroker(t)
	file := filepath.Join(t.TempDir(), "east.kubeconfig")
	_, errOut, err := runGet(t, "--exec", "--broker", b.url, "--identity-dir", b.identityDir, "--namespace", "argo",
		"--service-account", "runner", "--ttl", "8h", "--audience", "a", "-o", file)
	require.NoError(t, err)
	issued, revoked := b.counts()
	require.Equal(t, 1, issued)
	require.Len(t, revoked, 1, "the lease that showed the cluster is revoked")
	require.Contains(t, errOut, "exec kubeconfig for argo/runner (the lease "+revoked[0]+" that showed the cluster is revoked); written to "+file)
	require.NotContains(t, errOut, "SECRET")

	data, err := os.ReadFile(file)
	require.NoError(t, err)
	require.NotContains(t, string(data), "SECRET", "no credential in the file")
	cfg, err := clientcmd.Load(data)
	require.NoError(t, err)
	require.NoError(t, clientcmd.Validate(*cfg))
	ctx := cfg.Contexts[cfg.CurrentContext]
	require.Equal(t, "argo", ctx.Namespace)
	require.Equal(t, "api.east", cfg.Clusters[ctx.Cluster].TLSServerName, "the broker's cluster entry")
	exe, err := os.Executable()
	require.NoError(t, err)
	exec := cfg.AuthInfos[ctx.AuthInfo].Exec
	require.Equal(t, exe, exec.Command, "this binary, by its absolute path")
	require.Equal(t, []string{"credential", "--broker", b.url, "--identity-dir", b.identityDir, "--namespace", "argo", "--service-account", "runner",
		"--ttl", "8h", "--audience", "a"}, exec.Args)
	require.Equal(t, execcred.APIVersionV1, exec.APIVersion)
	require.Equal(t, "Never", string(exec.InteractiveMode))
	require.False(t, exec.ProvideClusterInfo)
}

func TestGetKubeconfigExecCommandAndItsChecks(t *testing.T) {
	t.Parallel()
	b := newCredBroker(t)
	out, _, err := runGet(t, "--exec", "--exec-command", "tokenbroker", "--broker", b.url, "--identity-dir", b.identityDir,
		"--namespace", "argo", "--service-account", "runner")
	require.NoError(t, err)
	cfg, err := clientcmd.Load([]byte(out))
	require.NoError(t, err)
	require.Equal(t, "tokenbroker", cfg.AuthInfos[cfg.Contexts[cfg.CurrentContext].AuthInfo].Exec.Command)

	_, _, err = runGet(t, "--exec", "--format", "json", "--exec-command", "x", "--broker", b.url, "--identity-dir", b.identityDir,
		"--namespace", "argo", "--service-account", "runner")
	require.ErrorContains(t, err, "--exec writes a kubeconfig: --format must be kubeconfig")
	_, _, err = runGet(t, "--exec-command", "x", "--broker", b.url, "--identity-dir", b.identityDir, "--namespace", "argo", "--service-account", "runner")
	require.ErrorContains(t, err, "--exec-command is for --exec")
	issued, _ := b.counts()
	require.Equal(t, 1, issued, "the refused invocations asked nothing")
}

// clusterProfileExecInfo is the KUBERNETES_EXEC_INFO client-go gives the
// plugin for a ClusterProfile access provider entry (cluster-inventory-api
// BuildConfigFromCP, provideClusterInfo): the entry's server and CA, and
// its exec extension as spec.cluster.config.
func clusterProfileExecInfo(t *testing.T, server string, ca []byte, target execcred.PluginTarget) string {
	t.Helper()
	cfg, err := json.Marshal(target)
	require.NoError(t, err)
	info, err := json.Marshal(map[string]any{
		"apiVersion": execcred.APIVersionV1, "kind": "ExecCredential",
		"spec": map[string]any{"interactive": false, "cluster": map[string]any{
			"server": server, "certificate-authority-data": ca, "config": json.RawMessage(cfg)}},
	})
	require.NoError(t, err)
	return string(info)
}

func TestCredentialAsAClusterProfileAccessProvider(t *testing.T) {
	b := newCredBroker(t)
	target := execcred.NewPluginTarget(b.url, apiv1.RequestSpec{Namespace: "batch", ServiceAccount: "multikueue", TTL: "1h"})
	identity := []string{"--identity-dir", b.identityDir}

	t.Run("the target comes from spec.cluster.config and the credential is cached", func(t *testing.T) {
		t.Setenv("TOKENBROKER_CACHE_DIR", filepath.Join(t.TempDir(), "cache"))
		t.Setenv(execcred.ExecInfoEnv, clusterProfileExecInfo(t, "https://east.example.com:6443", credTestCA, target))
		out, errLine := runCredentialCommand(t, identity...)
		require.Empty(t, errLine)
		require.Contains(t, out, "SECRET")
		entries, err := os.ReadDir(os.Getenv("TOKENBROKER_CACHE_DIR"))
		require.NoError(t, err)
		require.NotEmpty(t, entries, "cached (hits are execcred's tests: in one process a second run is taken for a refusal)")
		b.mu.Lock()
		defer b.mu.Unlock()
		require.Equal(t, 1, b.issued)
		require.Equal(t, 1, b.execs, "the broker was asked for its cluster before the one issuance")
		require.Equal(t, []string{"batch", "batch"}, b.namespaces, "exec check and issuance")
	})

	for _, tc := range []struct {
		name   string
		server string
		ca     []byte
	}{
		{"a ClusterProfile whose server was changed gets no token and nothing is issued", "https://mallory.example.com:6443", credTestCA},
		{"a ClusterProfile whose CA was changed gets no token and nothing is issued", "https://east.example.com:6443", func() []byte {
			ca, err := pki.NewCA(pki.CAOptions{})
			require.NoError(t, err)
			return ca.BundlePEM()
		}()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("TOKENBROKER_CACHE_DIR", filepath.Join(t.TempDir(), "cache"))
			b.mu.Lock()
			before := b.issued
			b.mu.Unlock()
			t.Setenv(execcred.ExecInfoEnv, clusterProfileExecInfo(t, tc.server, tc.ca, target))
			out, errLine := runCredentialCommand(t, identity...)
			require.Empty(t, out)
			require.Contains(t, errLine, "tokenbroker credential: refused: the credential would go to a cluster the broker does not name")
			issued, _ := b.counts()
			require.Equal(t, before, issued)
		})
	}

	t.Run("a second run for another server gets nothing", func(t *testing.T) {
		t.Setenv("TOKENBROKER_CACHE_DIR", filepath.Join(t.TempDir(), "cache"))
		t.Setenv(execcred.ExecInfoEnv, clusterProfileExecInfo(t, "https://east.example.com:6443", credTestCA, target))
		_, errLine := runCredentialCommand(t, identity...)
		require.Empty(t, errLine)
		t.Setenv(execcred.ExecInfoEnv, clusterProfileExecInfo(t, "https://mallory.example.com:6443", credTestCA, target))
		out, errLine := runCredentialCommand(t, identity...)
		require.Empty(t, out)
		require.Contains(t, errLine, `spec.cluster.server is "https://mallory.example.com:6443", the broker's cluster is "https://east.example.com:6443"`)
	})

	t.Run("a target flag beside the ClusterProfile's target is an error", func(t *testing.T) {
		t.Setenv("TOKENBROKER_CACHE_DIR", filepath.Join(t.TempDir(), "cache"))
		t.Setenv(execcred.ExecInfoEnv, clusterProfileExecInfo(t, "https://east.example.com:6443", credTestCA, target))
		_, errLine := runCredentialCommand(t, append(identity, "--namespace", "other")...)
		require.Contains(t, errLine, "--namespace: the target is the ClusterProfile's (spec.cluster.config)")
	})

	t.Run("provideClusterInfo with flags is guarded too", func(t *testing.T) {
		t.Setenv("TOKENBROKER_CACHE_DIR", filepath.Join(t.TempDir(), "cache"))
		t.Setenv(execcred.ExecInfoEnv, `{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","spec":{"cluster":{"server":"https://mallory.example.com:6443"}}}`)
		_, errLine := runCredentialCommand(t, b.args()...)
		require.Contains(t, errLine, "refused")
	})
}

// With --access gateway the plugin sends a CSR of a key it made, and
// answers with the lease certificate and that key, no token; the cache
// keeps a gateway credential apart from a direct one.
func TestCredentialWithAccessGatewayAnswersWithACertificateAndItsKey(t *testing.T) {
	t.Parallel()
	b := newCredBroker(t)
	cache := filepath.Join(t.TempDir(), "cache")
	out, errLine := runCredentialCommand(t, b.args("--cache-dir", cache, "--access", "gateway")...)
	require.Empty(t, errLine)
	var cred clientauthv1.ExecCredential
	require.NoError(t, json.Unmarshal([]byte(out), &cred))
	require.Empty(t, cred.Status.Token)
	_, err := tls.X509KeyPair([]byte(cred.Status.ClientCertificateData), []byte(cred.Status.ClientKeyData))
	require.NoError(t, err, "the lease certificate and the key made here")
	b.mu.Lock()
	got := b.reqs[0]
	b.mu.Unlock()
	require.Equal(t, apiv1.AccessGateway, got.Access)
	require.NotEmpty(t, got.CSR)
	require.NotContains(t, got.CSR, "PRIVATE KEY", "the key never leaves")

	again, errLine := runCredentialCommand(t, b.args("--cache-dir", cache, "--access", "gateway")...)
	require.Empty(t, errLine)
	require.Equal(t, out, again, "cached")
	direct, errLine := runCredentialCommand(t, b.args("--cache-dir", cache)...)
	require.Empty(t, errLine)
	require.Contains(t, direct, "tok-2-SECRET", "a direct request is another entry")

	_, errLine = runCredentialCommand(t, b.args("--cache-dir", cache, "--access", "gateway", "--audience", "vault")...)
	require.Contains(t, errLine, "request.audiences: must be empty with access gateway")
	_, errLine = runCredentialCommand(t, b.args("--cache-dir", cache, "--access", "tunnel")...)
	require.Contains(t, errLine, `request.access: must be "direct" or "gateway"`)
}

// A ClusterProfile entry of a gateway target names the gateway and says
// access gateway: the plugin asks for a gateway credential, which the
// guard lets go to the gateway (the cluster the broker names for it) and
// nowhere else, the API server included.
func TestCredentialAsTheAccessProviderOfAGatewayTarget(t *testing.T) {
	b := newCredBroker(t)
	target := execcred.NewPluginTarget(b.url, apiv1.RequestSpec{Namespace: "batch", ServiceAccount: "multikueue", TTL: "1h", Access: apiv1.AccessGateway})
	identity := []string{"--identity-dir", b.identityDir}

	t.Run("the gateway gets a gateway credential", func(t *testing.T) {
		t.Setenv("TOKENBROKER_CACHE_DIR", filepath.Join(t.TempDir(), "cache"))
		t.Setenv(execcred.ExecInfoEnv, clusterProfileExecInfo(t, credGatewayServer, credGatewayCA, target))
		out, errLine := runCredentialCommand(t, identity...)
		require.Empty(t, errLine)
		var cred clientauthv1.ExecCredential
		require.NoError(t, json.Unmarshal([]byte(out), &cred))
		require.Empty(t, cred.Status.Token)
		require.NotEmpty(t, cred.Status.ClientKeyData)
		b.mu.Lock()
		defer b.mu.Unlock()
		require.Equal(t, apiv1.AccessGateway, b.reqs[len(b.reqs)-1].Access)
	})

	t.Run("the API server named instead gets nothing and nothing is issued", func(t *testing.T) {
		t.Setenv("TOKENBROKER_CACHE_DIR", filepath.Join(t.TempDir(), "cache"))
		before, _ := b.counts()
		t.Setenv(execcred.ExecInfoEnv, clusterProfileExecInfo(t, "https://east.example.com:6443", credTestCA, target))
		out, errLine := runCredentialCommand(t, identity...)
		require.Empty(t, out)
		require.Contains(t, errLine, `refused: the credential would go to a cluster the broker does not name: spec.cluster.server is "https://east.example.com:6443", the broker's cluster is "`+credGatewayServer+`"`)
		issued, _ := b.counts()
		require.Equal(t, before, issued)
	})

	t.Run("--access beside the ClusterProfile's target is an error", func(t *testing.T) {
		t.Setenv("TOKENBROKER_CACHE_DIR", filepath.Join(t.TempDir(), "cache"))
		t.Setenv(execcred.ExecInfoEnv, clusterProfileExecInfo(t, credGatewayServer, credGatewayCA, target))
		_, errLine := runCredentialCommand(t, append(identity, "--access", "direct")...)
		require.Contains(t, errLine, "--access: the target is the ClusterProfile's (spec.cluster.config)")
	})
}

// get kubeconfig --exec --access gateway writes a kubeconfig that points
// at the gateway and runs the plugin for a gateway credential.
func TestGetKubeconfigExecForTheGateway(t *testing.T) {
	t.Parallel()
	b := newCredBroker(t)
	out, errOut, err := runGet(t, "--exec", "--exec-command", "tokenbroker", "--broker", b.url, "--identity-dir", b.identityDir,
		"--namespace", "argo", "--service-account", "runner", "--access", "gateway")
	require.NoError(t, err)
	require.Contains(t, errOut, "exec kubeconfig for argo/runner through the lease gateway")
	cfg, err := clientcmd.Load([]byte(out))
	require.NoError(t, err)
	ctx := cfg.Contexts[cfg.CurrentContext]
	require.Equal(t, credGatewayServer, cfg.Clusters[ctx.Cluster].Server)
	require.Equal(t, credGatewayCA, cfg.Clusters[ctx.Cluster].CertificateAuthorityData)
	args := cfg.AuthInfos[ctx.AuthInfo].Exec.Args
	require.Equal(t, []string{"--access", "gateway"}, args[len(args)-2:])
	_, revoked := b.counts()
	require.Len(t, revoked, 1, "the lease that showed the gateway is revoked")
}

// get kubeconfig --access gateway writes the gateway's kubeconfig with
// the lease certificate and the key made here; --format json says the
// lease's mode.
func TestGetKubeconfigForTheGatewayHoldsTheCertificateAndItsKey(t *testing.T) {
	t.Parallel()
	b := newCredBroker(t)
	out, _, err := runGet(t, "--broker", b.url, "--identity-dir", b.identityDir, "--namespace", "argo", "--service-account", "runner", "--access", "gateway")
	require.NoError(t, err)
	cfg, err := clientcmd.Load([]byte(out))
	require.NoError(t, err)
	rc, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err)
	require.Equal(t, credGatewayServer, rc.Host)
	require.Empty(t, rc.BearerToken)
	_, err = tls.X509KeyPair(rc.CertData, rc.KeyData)
	require.NoError(t, err)

	out, _, err = runGet(t, "--broker", b.url, "--identity-dir", b.identityDir, "--namespace", "argo", "--service-account", "runner",
		"--access", "gateway", "--format", "json")
	require.NoError(t, err)
	var resp apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(out), &resp))
	require.Equal(t, apiv1.AccessGateway, resp.Access)
	require.Equal(t, apiv1.CredentialClientCertificate, resp.Credential)
	require.Empty(t, resp.Token)
}
