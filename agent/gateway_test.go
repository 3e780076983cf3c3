package agent

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/kubeconfig"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/issuers"
	"github.com/tokenbroker/tokenbroker/pki"
)

// The lease gateway of the tests: its URL and the CA of its serving
// certificate, which a gateway kubeconfig names instead of the API
// server's.
const gatewayServer = "https://gateway.east.example.com:8445"

// gatewayBroker answers gateway requests as the broker does (broker.issue
// with access gateway): a lease certificate signed for the CSR's key by its
// CA, in a kubeconfig its own builder writes with the gateway's URL and
// CA and no key. It refuses WhoAmI, which a gateway request needs not ask,
// and records the requests and revocations.
type gatewayBroker struct {
	t      *testing.T
	ca     *pki.CA
	gwCA   []byte
	now    func() time.Time
	ttl    time.Duration
	answer string // the access mode it answers; default the one asked for

	mu      sync.Mutex
	reqs    []apiv1.KubeconfigRequest
	revoked []string
}

func newGatewayBroker(t *testing.T, now func() time.Time) *gatewayBroker {
	t.Helper()
	ca, err := pki.NewCA(pki.CAOptions{})
	require.NoError(t, err)
	gw, err := pki.NewCA(pki.CAOptions{})
	require.NoError(t, err)
	return &gatewayBroker{t: t, ca: ca, gwCA: gw.BundlePEM(), now: now, ttl: time.Hour}
}

func (b *gatewayBroker) WhoAmI(context.Context) (*apiv1.WhoAmI, error) {
	b.t.Error("a gateway request asked WhoAmI: its CSR's subject does not matter")
	return nil, errors.New("not asked")
}

func (b *gatewayBroker) Kubeconfig(_ context.Context, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reqs = append(b.reqs, req)
	csr, err := pki.ParseLeaseCSRPEM([]byte(req.CSR))
	if err != nil {
		return nil, err
	}
	id := leaseID(len(b.reqs))
	kp, err := b.ca.SignLease(csr.PublicKey, pki.LeaseName{Namespace: req.Namespace, ServiceAccount: req.ServiceAccount, ID: id,
		UID: "0b6f3c52-1d2e-4f3a-9b7c-5e6d7f8a9b0c", Peer: "spiffe://oc.example/cluster/west"}, b.now().Add(b.ttl))
	if err != nil {
		return nil, err
	}
	kc, err := kubeconfig.Build(policy.ClusterSpec{Name: "east", Server: gatewayServer, CAData: string(b.gwCA)}, req.Namespace, req.ServiceAccount,
		issuers.Credential{CertificatePEM: kp.CertPEM, NotBefore: kp.Cert.NotBefore, ExpiresAt: kp.Cert.NotAfter})
	if err != nil {
		return nil, err
	}
	access := b.answer
	if access == "" {
		access = req.Access
	}
	return &apiv1.KubeconfigResponse{LeaseID: id, Kubeconfig: string(kc), Credential: apiv1.CredentialClientCertificate,
		ExpiresAt: b.now().Add(b.ttl), GrantedTTL: b.ttl.String(), Access: access}, nil
}

func (b *gatewayBroker) RevokeLease(_ context.Context, id string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.revoked = append(b.revoked, id)
	return nil
}

// gatewayRequest is a gateway target's request.
var gatewayRequest = config.RequestConfig{Namespace: "argo", ServiceAccount: "runner", TTL: "1h", Access: apiv1.AccessGateway}

// gatewayCredential fetches a gateway credential from a gatewayBroker.
func gatewayCredential(t *testing.T) (*Credential, *gatewayBroker) {
	t.Helper()
	b := newGatewayBroker(t, func() time.Time { return t0 })
	c, err := Fetch(context.Background(), b, gatewayRequest, func() time.Time { return t0 })
	require.NoError(t, err)
	return c, b
}

// requireGatewayKubeconfig checks that client-go's own loader makes of a
// kubeconfig a client of the gateway with the certificate and key of c.
func requireGatewayKubeconfig(t *testing.T, c *Credential, b *gatewayBroker, kc []byte, what string) {
	t.Helper()
	cfg, err := clientcmd.Load(kc)
	require.NoError(t, err, what)
	rc, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err, what)
	requireGatewayREST(t, c, b, rc, what)
}

func requireGatewayREST(t *testing.T, c *Credential, b *gatewayBroker, rc *rest.Config, what string) {
	t.Helper()
	require.Equal(t, gatewayServer, rc.Host, what)
	require.Equal(t, b.gwCA, rc.CAData, "%s: the gateway's CA", what)
	require.Empty(t, rc.BearerToken, what)
	require.Equal(t, c.CertData, rc.CertData, what)
	require.Equal(t, c.KeyData, rc.KeyData, what)
	_, err := tls.X509KeyPair(rc.CertData, rc.KeyData)
	require.NoError(t, err, "%s: the certificate and key are a pair", what)
}

// A gateway request sends a CSR of a key made here, asks no WhoAmI, and
// gets a credential whose server and CA are the gateway's and whose key
// is the agent's own.
func TestAGatewayKeyIsMadeHereAndTheCredentialPointsAtTheGateway(t *testing.T) {
	t.Parallel()
	c, b := gatewayCredential(t)

	require.Len(t, b.reqs, 1)
	got := b.reqs[0]
	require.Equal(t, apiv1.AccessGateway, got.Access)
	require.Equal(t, "runner", got.ServiceAccount)
	require.Empty(t, got.Credential, "a gateway lease is a token grant's")
	require.NotContains(t, got.CSR, "PRIVATE KEY")
	csr, err := pki.ParseLeaseCSRPEM([]byte(got.CSR))
	require.NoError(t, err)

	require.Equal(t, apiv1.AccessGateway, c.Access)
	require.Equal(t, apiv1.CredentialClientCertificate, c.Kind())
	require.Empty(t, c.Token)
	require.Equal(t, gatewayServer, c.Server)
	require.Equal(t, b.gwCA, c.CAData)
	pair, err := tls.X509KeyPair(c.CertData, c.KeyData)
	require.NoError(t, err, "the kubeconfig got the agent's key for the certificate")
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	require.NoError(t, err)
	require.True(t, pki.IsLeaseCertificate(leaf))
	require.Equal(t, csr.PublicKey, leaf.PublicKey, "the certificate is for the CSR's key")
	require.Equal(t, apiv1.AccessGateway, c.Response().Access, "get kubeconfig --format json says so")
	requireGatewayKubeconfig(t, c, b, c.Kubeconfig, "the credential's kubeconfig")
}

// A broker that answers another mode than the one asked for would have
// the outputs point consumers elsewhere than the configuration says.
func TestAnAnswerOfAnotherAccessModeIsRefused(t *testing.T) {
	t.Parallel()
	b := newGatewayBroker(t, time.Now)
	b.answer = apiv1.AccessDirect
	_, err := Fetch(context.Background(), b, gatewayRequest, time.Now)
	require.ErrorIs(t, err, ErrBadAnswer)
	require.ErrorContains(t, err, "access gateway was asked for, and the broker answered direct")
}

// Every consumer format the agent writes carries a gateway credential as
// the certificate and key, with the gateway as the server.
func TestEveryFormatCarriesAGatewayCredentialAsCertificateAndKey(t *testing.T) {
	t.Parallel()
	c, b := gatewayCredential(t)
	meta := outputMeta{target: "east", request: requestDigest("https://east.example.com:8443", gatewayRequest),
		broker: "https://east.example.com:8443", req: gatewayRequest}

	for _, o := range []config.SecretOutput{
		{Namespace: "admiralty", Name: "east", Format: config.FormatAdmiralty},
		{Namespace: "flux-system", Name: "east", Format: config.FormatFlux},
		{Namespace: "kargo", Name: "east", Format: config.FormatKubeconfig, Key: "kubeconfig.yaml"},
		{Namespace: "tools", Name: "east", Format: config.FormatKubeconfig},
		{Namespace: "kueue-system", Name: "east", Format: config.FormatMultiKueue},
	} {
		s, err := renderSecret(o, meta, c)
		require.NoError(t, err, o.Format)
		requireGatewayKubeconfig(t, c, b, s.Data[o.DataKey()], "format "+o.Format)
	}

	// Argo CD: tlsClientConfig.certData and keyData (base64 of the PEM,
	// as Argo CD's []byte fields are in JSON), the gateway as server, no
	// bearer token.
	s, err := renderSecret(config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD}, meta, c)
	require.NoError(t, err)
	require.Equal(t, gatewayServer, string(s.Data[keyArgoServer]))
	var argo argoClusterConfig
	require.NoError(t, json.Unmarshal(s.Data[keyArgoConfig], &argo))
	require.Empty(t, argo.BearerToken)
	require.False(t, argo.TLSClientConfig.Insecure)
	decode := func(s string) []byte {
		b, err := base64.StdEncoding.DecodeString(s)
		require.NoError(t, err)
		return b
	}
	requireGatewayREST(t, c, b, &rest.Config{Host: string(s.Data[keyArgoServer]), TLSClientConfig: rest.TLSClientConfig{
		CAData: decode(argo.TLSClientConfig.CAData), CertData: decode(argo.TLSClientConfig.CertData), KeyData: decode(argo.TLSClientConfig.KeyData),
	}}, "format argocd")

	// A kubeconfig file.
	f := &fileOutput{cfg: config.FileOutput{Path: filepath.Join(t.TempDir(), "east.kubeconfig")}}
	_, err = f.write(context.Background(), meta, c)
	require.NoError(t, err)
	rc, err := clientcmd.BuildConfigFromFlags("", f.cfg.Path)
	require.NoError(t, err)
	requireGatewayREST(t, c, b, rc, "a file output")

	// A token file cannot hold it (the configuration refuses the pair).
	tf := &fileOutput{cfg: config.FileOutput{Path: filepath.Join(t.TempDir(), "east.kubeconfig"), TokenFile: "token"}}
	_, err = tf.write(context.Background(), meta, c)
	require.ErrorContains(t, err, "needs a token")
}

// In Argo CD's exec mode the Secret names the gateway as the server and
// runs the plugin for a gateway credential.
func TestArgoCDExecModeOfAGatewayTargetAsksThePluginForTheGateway(t *testing.T) {
	t.Parallel()
	c, _ := gatewayCredential(t)
	meta := outputMeta{target: "east", broker: "https://east.example.com:8443", req: gatewayRequest}
	s, err := renderSecret(config.SecretOutput{Namespace: "argocd", Name: "east", Format: config.FormatArgoCD, ArgoCD: argoExec}, meta, c)
	require.NoError(t, err)
	require.Equal(t, gatewayServer, string(s.Data[keyArgoServer]))
	var argo argoClusterConfig
	require.NoError(t, json.Unmarshal(s.Data[keyArgoConfig], &argo))
	require.Empty(t, argo.TLSClientConfig.CertData, "no credential in exec mode")
	require.Empty(t, argo.TLSClientConfig.KeyData)
	require.Equal(t, []string{"credential", "--broker", "https://east.example.com:8443", "--identity-dir", "/var/run/tokenbroker/identity",
		"--namespace", "argo", "--service-account", "runner", "--ttl", "1h", "--access", "gateway"}, argo.ExecProviderConfig.Args)
}

// The ClusterProfile entry of a gateway target names the gateway (its URL
// and CA) and tells the plugin to ask for a gateway credential.
func TestTheAccessProviderEntryOfAGatewayTargetNamesTheGateway(t *testing.T) {
	t.Parallel()
	c, b := gatewayCredential(t)
	meta := outputMeta{target: "east", broker: "https://east.example.com:8443", req: gatewayRequest}
	e, err := accessProvider(meta, c)
	require.NoError(t, err)
	cluster := e["cluster"].(map[string]any)
	require.Equal(t, gatewayServer, cluster["server"])
	require.Equal(t, base64.StdEncoding.EncodeToString(b.gwCA), cluster["certificate-authority-data"])
	require.Equal(t, []any{map[string]any{"name": apiv1.ExecExtensionKey, "extension": map[string]any{
		"apiVersion": apiv1.PluginTargetAPIVersion, "kind": apiv1.PluginTargetKind,
		"broker": "https://east.example.com:8443", "namespace": "argo", "serviceAccount": "runner", "ttl": "1h", "access": "gateway",
	}}}, cluster["extensions"])
	require.NotContains(t, cluster, "client-certificate-data", "no credential in a ClusterProfile")

	// A new lease of the same gateway renders the same entry: no write.
	next, err := Fetch(context.Background(), b, gatewayRequest, func() time.Time { return t0 })
	require.NoError(t, err)
	require.NotEqual(t, c.CertData, next.CertData)
	again, err := accessProvider(meta, next)
	require.NoError(t, err)
	require.Equal(t, e, again)
}

// A gateway target's refresher schedules from the lease's life as any
// other (nothing reads a token), writes the certificate and key to a
// Secret and a file, and a restarted agent adopts what they hold.
func TestAGatewayTargetIsRefreshedWrittenAndAdoptedAfterARestart(t *testing.T) {
	t.Parallel()
	cs := fake.NewClientset()
	secret := &secretOutput{cfg: config.SecretOutput{Namespace: "flux-system", Name: "east", Format: config.FormatFlux}, secrets: cs.CoreV1()}
	file := &fileOutput{cfg: config.FileOutput{Path: filepath.Join(t.TempDir(), "east.kubeconfig")}}
	f := newRefresherFixture(t, config.RefreshConfig{}, secret, file)
	gb := newGatewayBroker(t, f.clock.Now)
	f.r.api, f.r.req = gb, gatewayRequest
	f.r.meta.request = requestDigest("https://east.example.com:8443", gatewayRequest)
	ctx := context.Background()

	wake := f.r.step(ctx)
	require.True(t, f.r.status().ready())
	require.Equal(t, t0.Add(40*time.Minute), wake, "2/3 of the hour, no jitter")
	first := f.r.cur
	require.Equal(t, apiv1.AccessGateway, first.Access)
	s, err := cs.CoreV1().Secrets("flux-system").Get(ctx, "east", metav1.GetOptions{})
	require.NoError(t, err)
	requireGatewayKubeconfig(t, first, gb, s.Data["value"], "the flux Secret")

	// A restart: a new refresher over the same outputs adopts the lease.
	g := newRefresherFixture(t, config.RefreshConfig{}, secret, file)
	g.clock.SetTime(t0.Add(10 * time.Minute))
	g.r.api, g.r.req, g.r.meta = gb, gatewayRequest, f.r.meta
	wake = g.r.step(ctx)
	require.Equal(t, t0.Add(40*time.Minute), wake, "scheduled from the adopted lease")
	require.Len(t, gb.reqs, 1, "nothing fetched at the restart")
	require.Equal(t, first.LeaseID, g.r.cur.LeaseID)
	require.Equal(t, first.KeyData, g.r.cur.KeyData, "the key is read back from the outputs")

	// At the refresh point: a new lease, a new key, the old lease revoked
	// after the grace.
	g.clock.SetTime(t0.Add(40 * time.Minute))
	g.r.step(ctx)
	require.Len(t, gb.reqs, 2)
	second := g.r.cur
	require.NotEqual(t, first.KeyData, second.KeyData, "every lease has a key of its own")
	requireGatewayKubeconfig(t, second, gb, mustRead(t, file.cfg.Path), "the file after the refresh")
	g.clock.SetTime(t0.Add(41 * time.Minute))
	g.r.step(ctx)
	require.Equal(t, []string{first.LeaseID}, gb.revoked)
}

// mustRead reads a file the test wrote.
func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	st, err := (&fileOutput{cfg: config.FileOutput{Path: path}}).read(context.Background())
	require.NoError(t, err)
	require.NotNil(t, st)
	return st.kubeconfig
}
