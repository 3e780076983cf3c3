package integration

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/serializer/cbor"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	applycorev1 "k8s.io/client-go/applyconfigurations/core/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/auditjoin"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const gatewayGrants = `
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
        access: gateway
      - namespaces: [argo]
        serviceAccounts: [direct-runner]
`

// gatewayAuditPolicy logs every request's metadata, so that the test can
// find the gateway's forwarded requests in the API server's audit log.
const gatewayAuditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
`

// setUpGateway starts a cluster with an audit log and a broker with the
// lease gateway; runner in argo may read and write ConfigMaps there.
func setUpGateway(t *testing.T, opts ...testcluster.Option) (*stack, *http.Client) {
	t.Helper()
	c := testcluster.Start(t, append([]testcluster.Option{testcluster.WithAuditPolicy(gatewayAuditPolicy)}, opts...)...)
	ctx := context.Background()
	ensureNamespace(t, c, "argo")
	for _, sa := range []string{"runner", "direct-runner"} {
		_, err := c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	rule := rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list", "watch", "create", "patch", "update", "delete"}}
	user, _ := testcluster.ServiceAccountUser("argo", "runner")
	grantTo(t, c, "runner-configmaps", user, rule)
	s := startStack(t, c, gatewayGrants, withGateway())
	return s, s.client(t, "west")
}

// gatewayClient is a client-go clientset from a gateway lease's kubeconfig,
// as a consumer loads it.
func gatewayClient(t *testing.T, kubeconfig string) (*kubernetes.Clientset, *rest.Config) {
	t.Helper()
	cfg, err := clientcmd.RESTConfigFromKubeConfig([]byte(kubeconfig))
	require.NoError(t, err)
	cfg.Timeout = 30 * time.Second
	cs, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	return cs, cfg
}

func TestAGatewayLeaseServesClientGoAndEndsItsWatchesAtRevocation(t *testing.T) {
	s, west := setUpGateway(t)
	ctx := context.Background()

	resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	require.Equal(t, apiv1.AccessGateway, resp.Access, "the grant's mode, the request naming none")
	require.Equal(t, apiv1.CredentialClientCertificate, resp.Credential)
	require.Empty(t, resp.Token, "no Kubernetes token leaves the broker")
	require.NotContains(t, resp.Kubeconfig, "token:")
	cs, cfg := gatewayClient(t, resp.Kubeconfig)
	require.Equal(t, s.gatewayURL, cfg.Host, "the kubeconfig points at the gateway")

	// Discovery, create, server-side apply, chunked LIST: as the SA.
	_, err := cs.Discovery().ServerVersion()
	require.NoError(t, err)
	for i := range 5 {
		_, err := cs.CoreV1().ConfigMaps("argo").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("cm-%d", i)}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	applied, err := cs.CoreV1().ConfigMaps("argo").Apply(ctx, applycorev1.ConfigMap("applied", "argo").WithData(map[string]string{"k": "v"}),
		metav1.ApplyOptions{FieldManager: "gateway-test"})
	require.NoError(t, err)
	require.Equal(t, "v", applied.Data["k"])
	page, err := cs.CoreV1().ConfigMaps("argo").List(ctx, metav1.ListOptions{Limit: 2})
	require.NoError(t, err)
	require.Len(t, page.Items, 2)
	require.NotEmpty(t, page.Continue, "the LIST is chunked through the gateway")
	page2, err := cs.CoreV1().ConfigMaps("argo").List(ctx, metav1.ListOptions{Limit: 2, Continue: page.Continue})
	require.NoError(t, err)
	require.Len(t, page2.Items, 2)
	// The ServiceAccount's RBAC applies: no Secrets.
	_, err = cs.CoreV1().Secrets("argo").List(ctx, metav1.ListOptions{})
	require.True(t, apierrors.IsForbidden(err), "the API server decides as the ServiceAccount: %v", err)
	require.Contains(t, err.Error(), "system:serviceaccount:argo:runner")

	// An informer syncs through the gateway, and a raw watch streams events.
	factory := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace("argo"))
	inf := factory.Core().V1().ConfigMaps().Informer()
	stop := make(chan struct{})
	defer close(stop)
	factory.Start(stop)
	require.True(t, cache.WaitForCacheSync(stop, inf.HasSynced))
	w, err := cs.CoreV1().ConfigMaps("argo").Watch(ctx, metav1.ListOptions{ResourceVersion: page.ResourceVersion})
	require.NoError(t, err)
	defer w.Stop()
	_, err = cs.CoreV1().ConfigMaps("argo").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "watched"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	waitEvent(t, w, "watched")
	require.Positive(t, s.gatewayConns(t), "the gateway holds the lease's connections")

	// Revoke: the open watch ends at once, and the next request is refused.
	status, body := do(t, west, http.MethodDelete, s.url+"/v1/leases/"+resp.LeaseID, nil, nil)
	require.Equal(t, http.StatusNoContent, status, string(body))
	revoked := time.Now()
	select {
	case <-drain(w):
	case <-time.After(5 * time.Second):
		t.Fatal("the watch went on after its lease was revoked")
	}
	closedIn := time.Since(revoked)
	t.Logf("the open watch ended %s after the DELETE answered", closedIn.Round(time.Millisecond))
	require.Less(t, closedIn, time.Second)
	_, err = cs.CoreV1().ConfigMaps("argo").Get(ctx, "cm-0", metav1.GetOptions{})
	require.Error(t, err, "a revoked lease's request is refused")
	require.True(t, apierrors.IsUnauthorized(err), "refused as unauthorized: %v", err)
	require.Contains(t, err.Error(), "the lease is revoked or expired")
	require.Eventually(t, func() bool { return s.gatewayConns(t) == 0 }, 5*time.Second, 10*time.Millisecond, "every connection of the lease is closed")

	// The trail: every forwarded request is audited by lease, and the API
	// server's audit log has it under the Audit-ID the broker recorded,
	// with the lease in its user agent.
	events := readAudit(t, s.auditLog)
	var forwarded []map[string]any
	closes := 0
	for _, ev := range events {
		switch ev["action"] {
		case "gateway_request":
			if ev["lease_id"] == resp.LeaseID && ev["decision"] == "allow" {
				forwarded = append(forwarded, ev)
			}
		case "gateway_close":
			if ev["lease_id"] == resp.LeaseID {
				closes++
			}
		}
	}
	require.GreaterOrEqual(t, len(forwarded), 10)
	require.GreaterOrEqual(t, closes, 1)
	auditID, _ := forwarded[1]["api_audit_id"].(string)
	require.NotEmpty(t, auditID)
	require.Eventually(t, func() bool {
		for _, ev := range readAudit(t, s.cluster.AuditLogPath()) {
			if ev["auditID"] == auditID {
				user, _ := ev["user"].(map[string]any)
				return user["username"] == "system:serviceaccount:argo:runner" &&
					strings.Contains(fmt.Sprint(ev["userAgent"]), "tokenbroker-lease/"+resp.LeaseID)
			}
		}
		return false
	}, 10*time.Second, 100*time.Millisecond, "the API server's audit log names the forwarded request by the broker's audit id")

	// "tokenbroker audit" joins them: the API server's events of the
	// gateway's requests, to the lease.
	idx := auditjoin.NewIndex()
	bl, err := os.Open(s.auditLog)
	require.NoError(t, err)
	defer bl.Close()
	_, err = idx.ReadBrokerLog(bl)
	require.NoError(t, err)
	al, err := os.Open(s.cluster.AuditLogPath())
	require.NoError(t, err)
	defer al.Close()
	joined := 0
	st, err := auditjoin.Join(al, idx, auditjoin.Filter{LeaseID: resp.LeaseID}, func(r auditjoin.Row) error {
		require.Equal(t, "system:serviceaccount:argo:runner", r.Username)
		joined++
		return nil
	})
	require.NoError(t, err)
	require.GreaterOrEqual(t, joined, 10, "every forwarded request the API server logged joins its lease")
	require.Equal(t, joined, st.Gateway)
}

func TestAGatewayCertificateIsGoodAtTheGatewayOnly(t *testing.T) {
	s, west := setUpGateway(t)
	ctx := context.Background()
	resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessGateway})
	_, cfg := gatewayClient(t, resp.Kubeconfig)

	// At the API server, the lease certificate is nobody.
	direct := rest.CopyConfig(cfg)
	direct.Host, direct.CAData = s.cluster.URL, s.cluster.CAData
	dcs, err := kubernetes.NewForConfig(direct)
	require.NoError(t, err)
	_, err = dcs.CoreV1().ConfigMaps("argo").List(ctx, metav1.ListOptions{})
	require.True(t, apierrors.IsUnauthorized(err), "the API server does not know the lease certificate: %v", err)

	// At the broker's API, it fails the handshake: it chains to the client
	// CA (the signing CA is in the bundle), but names no peer, so that a
	// connection of it would be one that no per-identity cap counts.
	refused := func() float64 {
		return counter(t, s.reg, "tokenbroker_tls_handshake_failures_total", map[string]string{"listener": "api", "reason": "lease_certificate"})
	}
	openAPI := func() float64 {
		return counter(t, s.reg, "tokenbroker_connections_open", map[string]string{"listener": "api"})
	}
	leaseClient := s.clientWith(t, cfg.CertData, cfg.KeyData, s.ca.CertPool())
	_, _, err = tryDo(leaseClient, http.MethodGet, s.url+"/v1/whoami", "", nil, nil)
	require.Error(t, err, "a lease certificate gets no answer from the broker's API")
	require.Eventually(t, func() bool { return refused() == 1 }, 10*time.Second, 10*time.Millisecond, "counted by its reason")

	// However many connections its holder opens, and keeps open on its
	// side (here more than one address's cap: kept by the broker, they
	// would lock every peer of this address out), none stays open at the
	// broker, and a peer is served meanwhile.
	status, body := do(t, west, http.MethodGet, s.url+"/v1/leases", nil, nil)
	require.Equal(t, http.StatusOK, status, string(body))
	peerConns := openAPI()
	pair, err := tls.X509KeyPair(cfg.CertData, cfg.KeyData)
	require.NoError(t, err)
	// More than server.DefaultMaxConnsPerIP (512), the stack's cap per
	// client address.
	const attempts = 520
	for i := range attempts {
		conn, err := tls.Dial("tcp", strings.TrimPrefix(s.url, "https://"), &tls.Config{
			RootCAs: s.ca.CertPool(), MinVersion: tls.VersionTLS13, Certificates: []tls.Certificate{pair},
		})
		// In TLS 1.3 the client's handshake is over before the broker has
		// looked at its certificate: the refusal is what it reads first.
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err = conn.Read(make([]byte, 1))
		require.ErrorContains(t, err, "bad certificate", "attempt %d", i)
		if i%64 == 0 {
			status, body := do(t, west, http.MethodGet, s.url+"/v1/leases", nil, nil)
			require.Equal(t, http.StatusOK, status, string(body))
		}
	}
	require.Eventually(t, func() bool { return refused() == attempts+1 }, 10*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return openAPI() <= peerConns }, 10*time.Second, 10*time.Millisecond,
		"only the peer's connections are open")
	fresh := s.client(t, "west")
	status, body = do(t, fresh, http.MethodGet, s.url+"/v1/leases", nil, nil)
	require.Equal(t, http.StatusOK, status, "a peer's new connection from the same address: %s", body)
	require.Zero(t, counter(t, s.reg, "tokenbroker_connections_refused_total", map[string]string{"listener": "api"}), "no cap was reached")

	// At the gateway, a peer's certificate, a certificate from another
	// CA and no certificate fail the handshake.
	peer, err := s.ca.IssueClient(pki.ClientOptions{Identity: identity(t, "west")})
	require.NoError(t, err)
	other, err := pki.NewCA(pki.CAOptions{CommonName: "not the broker"})
	require.NoError(t, err)
	forged := signForgedLease(t, other, resp)
	for name, certKey := range map[string][2][]byte{
		"a peer certificate":                {peer.CertPEM, peer.KeyPEM},
		"a lease certificate of another CA": forged,
	} {
		t.Run(name, func(t *testing.T) {
			err := gatewayHandshake(t, s, certKey[0], certKey[1])
			require.Error(t, err, "the gateway verifies lease certificates against its own CA only")
		})
	}
	require.Error(t, gatewayHandshake(t, s, nil, nil), "no certificate, no connection")

	// A direct grant gets no gateway lease, and the gateway grant no token.
	status, body = do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs", apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "direct-runner", Access: apiv1.AccessGateway}, nil)
	require.Equal(t, http.StatusForbidden, status, string(body))
	status, body = do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs", apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessDirect}, nil)
	require.Equal(t, http.StatusForbidden, status, string(body))
	direct2 := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "direct-runner"})
	require.Equal(t, apiv1.AccessDirect, direct2.Access)
	require.NotEmpty(t, direct2.Token)
}

func TestAGatewayLeaseWithTheCallersKey(t *testing.T) {
	s, west := setUpGateway(t)
	csrPEM, keyPEM, err := pki.NewCSR(identity(t, "west"), nil)
	require.NoError(t, err)
	resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", CSR: string(csrPEM)})
	require.NotContains(t, resp.Kubeconfig, "client-key-data", "the key never left the caller")
	// The caller adds its key (kubectl config set-credentials --client-key).
	kc, err := clientcmd.Load([]byte(resp.Kubeconfig))
	require.NoError(t, err)
	for _, ai := range kc.AuthInfos {
		ai.ClientKeyData = keyPEM
	}
	cfg, err := clientcmd.NewDefaultClientConfig(*kc, nil).ClientConfig()
	require.NoError(t, err)
	cs, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	_, err = cs.CoreV1().ConfigMaps("argo").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)

	// A CSR whose signature does not verify makes nothing.
	bad := strings.Replace(string(csrPEM), "\n", "\nAAAA", 2)
	status, body := do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs", apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", CSR: bad}, nil)
	require.Equal(t, http.StatusBadRequest, status, string(body))
}

// signForgedLease is a lease certificate for resp's lease from another
// CA: everything right but the signer.
func signForgedLease(t *testing.T, ca *pki.CA, resp apiv1.KubeconfigResponse) [2][]byte {
	t.Helper()
	pub, keyPEM, err := ca.NewLeaseKey()
	require.NoError(t, err)
	cfg, err := clientcmd.RESTConfigFromKubeConfig([]byte(resp.Kubeconfig))
	require.NoError(t, err)
	certs, err := pki.ParseCertificatesPEM(cfg.CertData)
	require.NoError(t, err)
	n, err := pki.ParseLeaseURN(certs[0].URIs[0].String())
	require.NoError(t, err)
	n.Peer = certs[0].Subject.Organization[0]
	kp, err := ca.SignLease(pub, n, time.Now().Add(time.Hour))
	require.NoError(t, err)
	return [2][]byte{kp.CertPEM, keyPEM}
}

// gatewayHandshake dials the gateway with the certificate and key (none if
// nil) and sends one request, returning the first error.
func gatewayHandshake(t *testing.T, s *stack, certPEM, keyPEM []byte) error {
	t.Helper()
	cfg := &tls.Config{RootCAs: s.ca.CertPool(), MinVersion: tls.VersionTLS13}
	if certPEM != nil {
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		require.NoError(t, err)
		cfg.Certificates = []tls.Certificate{pair}
	}
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: cfg}}
	resp, err := c.Get(s.gatewayURL + "/version")
	if err != nil {
		return err
	}
	resp.Body.Close()
	return fmt.Errorf("answered %d", resp.StatusCode)
}

// gatewayConns is the gateway's open connections, of every peer, as
// its metric tells.
func (s *stack) gatewayConns(t *testing.T) float64 {
	t.Helper()
	return s.gauge(t, "tokenbroker_gateway_connections")
}

// waitEvent waits for the watch's event of the object named name.
func waitEvent(t *testing.T, w watch.Interface, name string) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 0, 10*time.Second, true, func(context.Context) (bool, error) {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				return false, errors.New("the watch ended")
			}
			m, err := metaName(ev.Object)
			return err == nil && m == name, nil
		case <-time.After(100 * time.Millisecond):
			return false, nil
		}
	})
	require.NoError(t, err)
}

func metaName(obj any) (string, error) {
	if o, ok := obj.(metav1.Object); ok {
		return o.GetName(), nil
	}
	return "", fmt.Errorf("%T has no name", obj)
}

// drain returns a channel closed once the watch's result channel is,
// having discarded its events.
func drain(w watch.Interface) <-chan struct{} {
	out := make(chan struct{})
	go func() {
		defer close(out)
		for range w.ResultChan() {
		}
	}()
	return out
}

// readAudit reads a JSON-lines audit log.
func readAudit(t *testing.T, path string) []map[string]any {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	var out []map[string]any
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 1<<20), 16<<20)
	for sc.Scan() {
		var ev map[string]any
		if json.Unmarshal(sc.Bytes(), &ev) == nil {
			out = append(out, ev)
		}
	}
	require.NoError(t, sc.Err())
	return out
}

// A peer put on the deny list loses its gateway leases' open watches
// within the gateway's sweep, and every new request at once; protobuf,
// as client-go's informers in controllers speak it, passes meanwhile.
func TestAPeerOnTheDenyListLosesItsGatewayWatches(t *testing.T) {
	s, west := setUpGateway(t)
	ctx := context.Background()
	resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessGateway})
	_, cfg := gatewayClient(t, resp.Kubeconfig)
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	cfg.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	cs, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	_, err = cs.CoreV1().ConfigMaps("argo").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "proto"}, Data: map[string]string{"k": "v"}}, metav1.CreateOptions{})
	require.NoError(t, err, "protobuf passes the gateway")
	got, err := cs.CoreV1().ConfigMaps("argo").Get(ctx, "proto", metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, "v", got.Data["k"])
	w, err := cs.CoreV1().ConfigMaps("argo").Watch(ctx, metav1.ListOptions{ResourceVersion: got.ResourceVersion})
	require.NoError(t, err)
	defer w.Stop()
	_, err = cs.CoreV1().ConfigMaps("argo").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "watched"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	waitEvent(t, w, "watched")

	// Written by the code behind "tokenbroker pki revoke --identity".
	added, err := enrollment.AddRevocation(ctx, s.cluster.Client.CoreV1().ConfigMaps(brokerNamespace), enrollment.RevokeIdentity, identity(t, "west"), "integration test", time.Now())
	require.NoError(t, err)
	require.True(t, added)
	written := time.Now()
	select {
	case <-drain(w):
	case <-time.After(10 * time.Second):
		t.Fatal("the denied peer's watch went on")
	}
	t.Logf("the denied peer's watch ended %s after the deny list's write", time.Since(written).Round(time.Millisecond))
	_, err = cs.CoreV1().ConfigMaps("argo").Get(ctx, "proto", metav1.GetOptions{})
	require.True(t, apierrors.IsForbidden(err), "refused as forbidden: %v", err)
}

// The gateway does not look at bodies: whatever encoding the API server
// serves (JSON, protobuf, CBOR, YAML), the gateway answers alike, for the
// same ServiceAccount: byte for byte, or the same object for CBOR.
func TestTheGatewayAnswersEveryEncodingAsTheAPIServerDoes(t *testing.T) {
	// CBOR is served behind a feature gate (off by default in 1.37).
	s, west := setUpGateway(t, testcluster.WithAPIServerArgs("--feature-gates=CBORServingAndStorage=true"))
	ctx := context.Background()
	resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessGateway})
	_, gwCfg := gatewayClient(t, resp.Kubeconfig)
	_, err := s.cluster.Client.CoreV1().ConfigMaps("argo").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "enc"}, Data: map[string]string{"k": "v"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	secs := int64(600)
	tr, err := s.cluster.Client.CoreV1().ServiceAccounts("argo").CreateToken(ctx, "runner", &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &secs}}, metav1.CreateOptions{})
	require.NoError(t, err)
	directCfg := &rest.Config{Host: s.cluster.URL, BearerToken: tr.Status.Token, TLSClientConfig: rest.TLSClientConfig{CAData: s.cluster.CAData}}
	get := func(cfg *rest.Config, accept string) (int, string, []byte) {
		t.Helper()
		rt, err := rest.TransportFor(cfg)
		require.NoError(t, err)
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, cfg.Host+"/api/v1/namespaces/argo/configmaps/enc", nil)
		require.NoError(t, err)
		req.Header.Set("Accept", accept)
		res, err := (&http.Client{Transport: rt, Timeout: 10 * time.Second}).Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		body, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res.StatusCode, res.Header.Get("Content-Type"), body
	}
	for _, accept := range []string{"application/json", "application/vnd.kubernetes.protobuf", "application/cbor", "application/yaml"} {
		t.Run(accept, func(t *testing.T) {
			dStatus, dType, dBody := get(directCfg, accept)
			gStatus, gType, gBody := get(gwCfg, accept)
			t.Logf("the API server answers %s with %d %s", accept, dStatus, dType)
			require.Equal(t, dStatus, gStatus)
			require.Equal(t, dType, gType)
			if accept != "application/cbor" {
				require.Equal(t, dBody, gBody)
				return
			}
			// The API server's CBOR encoder orders map keys as it pleases:
			// the same object, decoded.
			dec := cbor.NewSerializer(scheme.Scheme, scheme.Scheme)
			d, _, err := dec.Decode(dBody, nil, nil)
			require.NoError(t, err)
			g, _, err := dec.Decode(gBody, nil, nil)
			require.NoError(t, err)
			require.Equal(t, d, g)
		})
	}
}
