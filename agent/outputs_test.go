package agent

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/golden")

// The golden files' input is a kubeconfig the broker's own builder wrote:
// broker/kubeconfig/testdata/*.golden, which TestTheGoldenKubeconfigIsWhatTheBrokerBuilds
// (in broker) keeps equal to buildKubeconfig's output. Regenerate both
// with: go test ./broker -run TestTheGoldenKubeconfig -update && go test ./agent -update
const (
	brokerGolden         = "../broker/kubeconfig/testdata/kubeconfig.golden"
	brokerGoldenSNIProxy = "../broker/kubeconfig/testdata/kubeconfig-sni-proxy.golden"
)

// goldenCredential is the fixed input of the golden files.
func goldenCredential(t *testing.T) *Credential {
	t.Helper()
	return goldenCredentialFrom(t, brokerGolden)
}

func goldenCredentialFrom(t *testing.T, kubeconfigFile string) *Credential {
	t.Helper()
	resp := goldenResponse(t, kubeconfigFile)
	c, err := credentialFromResponse(&resp, time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	require.NoError(t, err)
	return c
}

func goldenResponse(t *testing.T, kubeconfigFile string) apiv1KubeconfigResponse {
	t.Helper()
	kc, err := os.ReadFile(kubeconfigFile)
	require.NoError(t, err)
	return apiv1KubeconfigResponse{
		LeaseID:      "k7b3xq2mzw4rd5tn6vy2abcdef",
		Kubeconfig:   string(kc),
		Token:        "eyJhbGciOiJSUzI1NiJ9.eyJpYXQiOjE4OTM1NTk0NDV9.c2ln",
		ExpiresAt:    time.Date(2030, 1, 2, 15, 4, 5, 0, time.UTC),
		RequestedTTL: "12h",
		GrantedTTL:   "12h0m0s",
	}
}

var goldenMeta = outputMeta{target: "east", request: "sha256:0123456789abcdef"}

func checkGolden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", "golden", name)
	if *update {
		require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
		require.NoError(t, os.WriteFile(path, got, 0o644))
	}
	want, err := os.ReadFile(path)
	require.NoError(t, err, "run go test ./agent -update to create it")
	require.Equal(t, string(want), string(got), "%s differs; if intended, run go test ./agent -update", path)
}

// The request digest is recorded on every output: the same target must
// give the same digest in every release, or an upgrade would rewrite every
// output (and make Argo CD rebuild every cluster's cache).
func TestARequestDigestStaysTheSameAcrossReleases(t *testing.T) {
	t.Parallel()
	const broker = "https://east.example.com:8443"
	require.Equal(t, "sha256:90552f052d1ce2e3", requestDigest(broker, config.RequestConfig{
		Namespace: "argo", ServiceAccount: "runner", TTL: "2h", MinTTL: "1h", Audiences: []string{"a"}, Access: apiv1.AccessGateway}))
	require.Equal(t, "sha256:e6dece3c42580662", requestDigest(broker, config.RequestConfig{Namespace: "argo", ServiceAccount: "runner"}))
}

func TestEverySecretFormatMatchesItsGoldenFile(t *testing.T) {
	for _, format := range []string{config.FormatAdmiralty, config.FormatArgoCD, config.FormatFlux, config.FormatKubeconfig} {
		t.Run(format, func(t *testing.T) {
			s, err := renderSecret(config.SecretOutput{
				Namespace:   "admiralty",
				Name:        "east",
				Format:      format,
				Labels:      map[string]string{"team": "platform"},
				Annotations: map[string]string{"example.com/owner": "ops"},
			}, goldenMeta, goldenCredential(t))
			require.NoError(t, err)
			checkGolden(t, "secret-"+format+".yaml", readableSecret(t, s))
		})
	}
	// Behind an SNI router and a proxy, with the Argo CD options: what
	// Argo CD reads as tlsClientConfig.serverName and proxyUrl.
	shard := int64(1)
	s, err := renderSecret(config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD,
		ArgoCD: &config.ArgoCDOptions{Project: "team-a", Namespaces: []string{"argo"}, Shard: &shard}},
		goldenMeta, goldenCredentialFrom(t, brokerGoldenSNIProxy))
	require.NoError(t, err)
	checkGolden(t, "secret-argocd-sni-proxy.yaml", readableSecret(t, s))
}

// readableSecret is s as YAML with its data as text (stringData), so that
// a reviewer of a golden file reads what the consumer reads.
func readableSecret(t *testing.T, s *corev1.Secret) []byte {
	t.Helper()
	readable := s.DeepCopy()
	readable.StringData = map[string]string{}
	for k, v := range s.Data {
		readable.StringData[k] = string(v)
	}
	readable.Data = nil
	out, err := yaml.Marshal(readable)
	require.NoError(t, err)
	return out
}

func TestTheFileOutputMatchesItsGoldenFiles(t *testing.T) {
	dir := t.TempDir()
	o := &fileOutput{cfg: config.FileOutput{Path: filepath.Join(dir, "east.kubeconfig")}}
	_, err := o.write(context.Background(), goldenMeta, goldenCredential(t))
	require.NoError(t, err)
	kc, err := os.ReadFile(o.cfg.Path)
	require.NoError(t, err)
	checkGolden(t, "file.kubeconfig", kc)
	meta, err := os.ReadFile(o.cfg.Path + config.MetaSuffix)
	require.NoError(t, err)
	checkGolden(t, "file.kubeconfig.meta", meta)
}

func TestTheArgoCDConfigCarriesTheTokenAndTheCAAsBase64PEM(t *testing.T) {
	t.Parallel()
	c := goldenCredential(t)
	s, err := renderSecret(config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD}, goldenMeta, c)
	require.NoError(t, err)
	require.Equal(t, "cluster", s.Labels["argocd.argoproj.io/secret-type"])
	require.Equal(t, "east", string(s.Data["name"]))
	require.Equal(t, "https://east.example.com:6443", string(s.Data["server"]))
	var cfg struct {
		BearerToken     string `json:"bearerToken"`
		TLSClientConfig struct {
			Insecure bool   `json:"insecure"`
			CAData   string `json:"caData"`
		} `json:"tlsClientConfig"`
	}
	require.NoError(t, json.Unmarshal(s.Data["config"], &cfg))
	require.Equal(t, c.Token, cfg.BearerToken)
	require.False(t, cfg.TLSClientConfig.Insecure)
	pemCA, err := base64.StdEncoding.DecodeString(cfg.TLSClientConfig.CAData)
	require.NoError(t, err)
	require.Equal(t, testCA, string(pemCA), "caData is base64 of the PEM bundle")
}

func TestSecretFormatsUseTheKeysTheirConsumersRead(t *testing.T) {
	t.Parallel()
	c := goldenCredential(t)
	for format, key := range map[string]string{config.FormatAdmiralty: "config", config.FormatFlux: "value", config.FormatKubeconfig: "kubeconfig", config.FormatMultiKueue: "kubeconfig"} {
		s, err := renderSecret(config.SecretOutput{Namespace: "ns", Name: "n", Format: format}, goldenMeta, c)
		require.NoError(t, err)
		require.Equal(t, c.Kubeconfig, s.Data[key], format)
		require.Len(t, s.Data, 1, format)
		require.Equal(t, corev1.SecretTypeOpaque, s.Type)
		require.Equal(t, config.ManagedByAgent, s.Labels[config.LabelManagedBy])
		require.Equal(t, c.LeaseID, s.Annotations[config.AnnotationLeaseID])
		require.Equal(t, "2030-01-02T15:04:05Z", s.Annotations[config.AnnotationExpiresAt])
	}
	flux, err := renderSecret(config.SecretOutput{Namespace: "ns", Name: "n", Format: config.FormatFlux}, goldenMeta, c)
	require.NoError(t, err)
	require.Equal(t, "Enabled", flux.Labels["reconcile.fluxcd.io/watch"])
}

// writeActions returns the create and update actions on Secrets.
func writeActions(cs *fake.Clientset) []string {
	var out []string
	for _, a := range cs.Actions() {
		if a.GetResource().Resource == "secrets" && (a.GetVerb() == "create" || a.GetVerb() == "update") {
			out = append(out, a.GetVerb())
		}
	}
	return out
}

func TestASecretIsWrittenOnlyWhenItsContentChanges(t *testing.T) {
	t.Parallel()
	cs := fake.NewClientset()
	o := &secretOutput{cfg: config.SecretOutput{Namespace: "admiralty", Name: "east", Format: config.FormatAdmiralty}, secrets: cs.CoreV1()}
	ctx := context.Background()
	c := goldenCredential(t)

	wrote, err := o.write(ctx, goldenMeta, c)
	require.NoError(t, err)
	require.True(t, wrote)
	require.Equal(t, []string{"create"}, writeActions(cs))

	wrote, err = o.write(ctx, goldenMeta, c)
	require.NoError(t, err)
	require.False(t, wrote)
	require.Equal(t, []string{"create"}, writeActions(cs), "an identical Secret is never written again")

	next := nextCredential(c)
	wrote, err = o.write(ctx, goldenMeta, next)
	require.NoError(t, err)
	require.True(t, wrote)
	require.Equal(t, []string{"create", "update"}, writeActions(cs))

	st, err := o.read(ctx)
	require.NoError(t, err)
	require.Equal(t, next.LeaseID, st.leaseID)
	require.Equal(t, next.ExpiresAt, st.expiresAt)
	require.Equal(t, next.ObtainedAt, st.obtainedAt)
	require.Equal(t, "east", st.target)
	require.Equal(t, next.Kubeconfig, st.kubeconfig)
}

func TestASecretTheAgentDoesNotManageIsNeverTakenOver(t *testing.T) {
	t.Parallel()
	foreign := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: "admiralty", Name: "east", Labels: map[string]string{"app": "mine"}},
		Data:       map[string][]byte{"config": []byte("hand-made")},
	}
	cs := fake.NewClientset(foreign)
	o := &secretOutput{cfg: config.SecretOutput{Namespace: "admiralty", Name: "east", Format: config.FormatAdmiralty}, secrets: cs.CoreV1()}
	_, err := o.write(context.Background(), goldenMeta, goldenCredential(t))
	require.ErrorIs(t, err, ErrForeignSecret)
	require.Empty(t, writeActions(cs))
	_, err = o.read(context.Background())
	require.ErrorIs(t, err, ErrForeignSecret)

	// Through a refresher: the failure is counted, other outputs still get
	// the credential.
	other := &memOutput{name: "other"}
	f := newRefresherFixture(t, config.RefreshConfig{}, o, other)
	f.r.step(context.Background())
	require.Equal(t, 1.0, counter(t, f, "writes", "east", "secret:admiralty/east", "failed"))
	require.Equal(t, 1.0, counter(t, f, "refresh", "east", "failure"))
	logged := f.logs.FilterMessage("cannot write an output; it keeps what it holds").All()
	require.Len(t, logged, 1, "the refusal is logged")
	require.Contains(t, logged[0].ContextMap()["error"], "set adopt: true on the output to take it over", "the log line names the way out")
	require.Equal(t, leaseID(1), other.lease())
	s, err := cs.CoreV1().Secrets("admiralty").Get(context.Background(), "east", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, "hand-made", string(s.Data["config"]))
}

func TestAFailedSecretWriteIsReportedAndCounted(t *testing.T) {
	t.Parallel()
	cs := fake.NewClientset()
	cs.PrependReactor("create", "secrets", func(k8stesting.Action) (bool, runtimeObject, error) {
		return true, nil, errors.New("etcd on fire")
	})
	o := &secretOutput{cfg: config.SecretOutput{Namespace: "flux-system", Name: "east", Format: config.FormatFlux}, secrets: cs.CoreV1()}
	f := newRefresherFixture(t, config.RefreshConfig{}, o)
	f.r.step(context.Background())
	require.Equal(t, 1.0, counter(t, f, "writes", "east", "secret:flux-system/east", "failed"))
	require.False(t, f.r.status().ready())
}

func TestAFileIsWrittenAtomicallyWithMode0600OnlyWhenItChanges(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "east.kubeconfig")
	o := &fileOutput{cfg: config.FileOutput{Path: path}}
	ctx := context.Background()
	c := goldenCredential(t)

	wrote, err := o.write(ctx, goldenMeta, c)
	require.NoError(t, err)
	require.True(t, wrote)
	for _, p := range []string{path, path + config.MetaSuffix} {
		st, err := os.Stat(p)
		require.NoError(t, err)
		require.Equal(t, os.FileMode(0o600), st.Mode().Perm(), p)
	}
	before, err := os.Stat(path)
	require.NoError(t, err)

	wrote, err = o.write(ctx, goldenMeta, c)
	require.NoError(t, err)
	require.False(t, wrote)
	after, err := os.Stat(path)
	require.NoError(t, err)
	require.True(t, os.SameFile(before, after) && before.ModTime().Equal(after.ModTime()), "an unchanged file is not replaced")

	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 2, "no temporary file is left behind")

	st, err := o.read(ctx)
	require.NoError(t, err)
	require.Equal(t, c.LeaseID, st.leaseID)
	require.Equal(t, c.Kubeconfig, st.kubeconfig)

	// A mode someone loosened is tightened again.
	require.NoError(t, os.Chmod(path, 0o644))
	wrote, err = WriteKubeconfigFile(path, c.Kubeconfig)
	require.NoError(t, err)
	require.True(t, wrote)
	fi, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
}

func TestAFileOutputInAMissingDirectoryFails(t *testing.T) {
	t.Parallel()
	o := &fileOutput{cfg: config.FileOutput{Path: filepath.Join(t.TempDir(), "no-such-volume", "east.kubeconfig")}}
	_, err := o.write(context.Background(), goldenMeta, goldenCredential(t))
	require.Error(t, err)
}

func TestACredentialNeverPrintsItsSecrets(t *testing.T) {
	t.Parallel()
	c := goldenCredential(t)
	for _, s := range []string{c.String(), c.GoString()} {
		require.NotContains(t, s, c.Token)
		require.Contains(t, s, c.LeaseID)
	}
}

// certCredential is a client-certificate credential as the broker's
// kubeconfig carries it (client-certificate-data, client-key-data).
func certCredential(t *testing.T) *Credential {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["east"] = &clientcmdapi.Cluster{Server: "https://east.example.com:6443", CertificateAuthorityData: []byte(testCA)}
	cfg.AuthInfos["runner@east"] = &clientcmdapi.AuthInfo{ClientCertificateData: []byte("CERT PEM"), ClientKeyData: []byte("KEY PEM")}
	cfg.Contexts["ctx"] = &clientcmdapi.Context{Cluster: "east", AuthInfo: "runner@east", Namespace: "argo"}
	cfg.CurrentContext = "ctx"
	kc, err := clientcmd.Write(*cfg)
	require.NoError(t, err)
	c, err := credentialFromResponse(&apiv1.KubeconfigResponse{
		LeaseID: "k7b3xq2mzw4rd5tn6vy2abcdef", Kubeconfig: string(kc), Credential: apiv1.CredentialClientCertificate,
		ExpiresAt: time.Date(2030, 1, 2, 15, 4, 5, 0, time.UTC),
	}, time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	require.NoError(t, err)
	return c
}

func TestAClientCertificateCredentialReachesEveryFormat(t *testing.T) {
	t.Parallel()
	c := certCredential(t)
	require.Equal(t, apiv1.CredentialClientCertificate, c.Kind())
	require.Equal(t, []byte("CERT PEM"), c.CertData)
	require.NotContains(t, c.String(), "KEY PEM")

	s, err := renderSecret(config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD}, goldenMeta, c)
	require.NoError(t, err)
	var cfg map[string]any
	require.NoError(t, json.Unmarshal(s.Data["config"], &cfg))
	require.NotContains(t, cfg, "bearerToken", "no empty token next to the certificate")
	tls := cfg["tlsClientConfig"].(map[string]any)
	require.Equal(t, base64.StdEncoding.EncodeToString([]byte("CERT PEM")), tls["certData"])
	require.Equal(t, base64.StdEncoding.EncodeToString([]byte("KEY PEM")), tls["keyData"])

	for _, format := range []string{config.FormatAdmiralty, config.FormatFlux, config.FormatKubeconfig} {
		s, err := renderSecret(config.SecretOutput{Namespace: "ns", Name: "east", Format: format}, goldenMeta, c)
		require.NoError(t, err, format)
		found := false
		for _, v := range s.Data {
			found = found || string(v) == string(c.Kubeconfig)
		}
		require.True(t, found, "%s carries the kubeconfig as the broker built it", format)
	}
}
