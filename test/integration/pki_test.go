package integration

import (
	"context"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// prepareCluster gives a cluster what the grants name: the namespace argo
// with the ServiceAccount runner.
func prepareCluster(t *testing.T, c *testcluster.Cluster) {
	t.Helper()
	ensureNamespace(t, c, "argo")
	_, err := c.Client.CoreV1().ServiceAccounts("argo").Create(context.Background(), &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
}

// enrolled is what a joining cluster holds after enrolling.
type enrolled struct {
	resp   apiv1.CertificateResponse
	keyPEM []byte
}

// enroll sends a CSR for identity with token to the enrollment listener,
// from a client with no certificate that verifies the broker with roots.
func (s *stack) enroll(t *testing.T, token, identity string, roots *x509.CertPool) (int, *enrolled, error) {
	t.Helper()
	csr, key, err := pki.NewCSR(identity, nil)
	require.NoError(t, err)
	c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: pki.ClientTLSConfig(roots, nil)}}
	defer c.CloseIdleConnections()
	var e enrolled
	status, _, err := tryDo(c, http.MethodPost, s.enrollURL+"/v1/certificates", token, apiv1.CertificateRequest{CSR: string(csr)}, &e.resp)
	e.keyPEM = key
	return status, &e, err
}

func joinToken(t *testing.T, ca *pki.CA, identity string) string {
	t.Helper()
	// Every stack's policy names its cluster east: the broker's name.
	tok, _, err := ca.IssueJoinToken(pki.JoinTokenOptions{Identity: identity, Audiences: []string{"east"}})
	require.NoError(t, err)
	return tok
}

// counter returns the value of a counter of reg with the given labels, 0 if
// it has not been counted yet.
func counter(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	v, _ := metricValue(t, reg, name, labels)
	return v
}

// metricValue returns the value of the first counter or gauge of reg named
// name whose labels include labels, and whether there is one.
func metricValue(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metrics:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
					continue metrics
				}
			}
			if m.GetGauge() != nil {
				return m.GetGauge().GetValue(), true
			}
			return m.GetCounter().GetValue(), true
		}
	}
	return 0, false
}

func reloads(t *testing.T, s *stack, config, result string) float64 {
	t.Helper()
	return counter(t, s.reg, "tokenbroker_config_reloads_total", map[string]string{"config": config, "result": result})
}

// TestPKILifecycle runs the certificate life of a cluster against a real
// API server: enrollment across replicas, renewal, rotation of the server
// certificate under load, CA rotation and policy reload. The subtests share
// one cluster and run in parallel, each with its own broker(s).
func TestPKILifecycle(t *testing.T) {
	t.Parallel()
	c := testcluster.Start(t)
	prepareCluster(t, c)

	t.Run("a join token used at one replica is refused at another, and the certificate renews", func(t *testing.T) {
		t.Parallel()
		testJoinTokenAcrossReplicas(t, c)
	})
	t.Run("a rotated server certificate is picked up under load with no failed request", func(t *testing.T) {
		t.Parallel()
		testServerCertificateRotationUnderLoad(t, c)
	})
	t.Run("a CA rotation needs no restart", func(t *testing.T) {
		t.Parallel()
		testCARotation(t, c)
	})
	t.Run("a bad policy file is refused and counted, a good one picked up", func(t *testing.T) {
		t.Parallel()
		testPolicyReload(t, c)
	})
}

func testJoinTokenAcrossReplicas(t *testing.T, c *testcluster.Cluster) {
	// The races below enroll 23 times from one address, over the default
	// enrollment bucket (10 a minute), which is not what they test.
	pol := grants + "limits: {enrollmentsPerMinute: 100}\n"
	s1 := startStack(t, c, pol)
	s2 := startStack(t, c, pol, withCA(s1.ca))
	roots := s1.ca.CertPool()
	west := identity(t, "west")

	tok := joinToken(t, s1.ca, west)
	start := time.Now()
	status, first, err := s1.enroll(t, tok, west, roots)
	took := time.Since(start)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, status)
	require.Equal(t, west, first.resp.Identity)
	t.Logf("handshake and enrollment took %s", took.Round(time.Millisecond))

	for name, s := range map[string]*stack{"the other replica": s2, "the same replica": s1} {
		status, _, err := s.enroll(t, tok, west, roots)
		require.NoError(t, err)
		require.Equal(t, http.StatusUnauthorized, status, "a used token at %s", name)
	}

	// Raced at both replicas at once, each token is accepted exactly once.
	for i := range 5 {
		tok := joinToken(t, s1.ca, west)
		var wg sync.WaitGroup
		var created, refused atomic.Int32
		for _, s := range []*stack{s1, s2, s1, s2} {
			wg.Go(func() {
				status, _, err := s.enroll(t, tok, west, roots)
				switch {
				case err != nil:
				case status == http.StatusCreated:
					created.Add(1)
				case status == http.StatusUnauthorized:
					refused.Add(1)
				}
			})
		}
		wg.Wait()
		require.EqualValues(t, 1, created.Load(), "race %d", i)
		require.EqualValues(t, 3, refused.Load(), "race %d", i)
	}

	// The enrolled certificate works at either replica.
	enrolled := s2.clientWith(t, []byte(first.resp.Certificate), first.keyPEM, roots)
	issue(t, s2, enrolled, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})

	// Renewal with it, for a new key, gives a certificate that works too.
	csr, key, err := pki.NewCSR(west, nil)
	require.NoError(t, err)
	var renewed apiv1.CertificateResponse
	status, body := do(t, enrolled, http.MethodPost, s1.url+"/v1/certificates", apiv1.CertificateRequest{CSR: string(csr)}, &renewed)
	require.Equal(t, http.StatusCreated, status, string(body))
	require.NotEqual(t, first.resp.SerialNumber, renewed.SerialNumber)
	renewedClient := s2.clientWith(t, []byte(renewed.Certificate), key, roots)
	resp := issue(t, s2, renewedClient, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	require.True(t, review(t, c.Client, resp.Token).Authenticated)
	var who apiv1.WhoAmI
	status, _ = do(t, renewedClient, http.MethodGet, s1.url+"/v1/whoami", nil, &who)
	require.Equal(t, http.StatusOK, status)
	require.Equal(t, renewed.SerialNumber, who.Certificate.SerialNumber)

	// Renewal for another identity is refused.
	csr, _, err = pki.NewCSR(identity(t, "north"), nil)
	require.NoError(t, err)
	status, _ = do(t, renewedClient, http.MethodPost, s1.url+"/v1/certificates", apiv1.CertificateRequest{CSR: string(csr)}, nil)
	require.Equal(t, http.StatusForbidden, status)

	// Each used token is on record once in the broker's namespace.
	secrets, err := c.Client.CoreV1().Secrets(brokerNamespace).List(context.Background(), metav1.ListOptions{
		LabelSelector: objects.LabelKind + "=" + objects.UsedJoinTokenKind,
	})
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(secrets.Items), 6)
	for _, sec := range secrets.Items {
		require.Equal(t, objects.SecretTypeUsedJoinToken, sec.Type)
	}
}

func testServerCertificateRotationUnderLoad(t *testing.T, c *testcluster.Cluster) {
	const total, workers, rotateAt = 1000, 8, 200
	s := startStack(t, c, grants)
	kp, err := s.ca.IssueClient(pki.ClientOptions{Identity: identity(t, "west")})
	require.NoError(t, err)
	keepAlive := s.clientWith(t, kp.CertPEM, kp.KeyPEM, s.ca.CertPool())
	var dials atomic.Int64
	tr := keepAlive.Transport.(*http.Transport)
	tr.MaxIdleConnsPerHost = workers
	// Without a cap the transport may race a new dial against a connection
	// coming back to the pool under CPU pressure; the cap makes any extra
	// dial mean that the server closed a kept-alive connection.
	tr.MaxConnsPerHost = workers
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}
	fresh := s.clientWith(t, kp.CertPEM, kp.KeyPEM, s.ca.CertPool())
	fresh.Transport.(*http.Transport).DisableKeepAlives = true

	oldSerial := serverSerial(t, s, fresh)
	var (
		next      atomic.Int64
		failures  atomic.Int64
		sawNew    atomic.Bool
		mu        sync.Mutex
		seen      = map[string]int{}
		firstErr  error
		rotateNow = make(chan struct{})
	)
	start := time.Now()
	var wg sync.WaitGroup
	for w := range workers {
		client := keepAlive
		if w%2 == 1 {
			client = fresh
		}
		wg.Go(func() {
			for {
				i := next.Add(1)
				// Past total, the load goes on until a new connection has
				// seen the new certificate: under CPU pressure the
				// reloader's poll may come after the 1000th request.
				if i > total && (sawNew.Load() || time.Since(start) > time.Minute) {
					return
				}
				if i == rotateAt {
					close(rotateNow)
				}
				resp, err := client.Get(s.url + "/v1/whoami")
				if err != nil || resp.StatusCode != http.StatusOK {
					failures.Add(1)
					mu.Lock()
					if firstErr == nil {
						firstErr = fmt.Errorf("request %d: %v %v", i, err, resp)
					}
					mu.Unlock()
					if resp != nil {
						_ = resp.Body.Close()
					}
					continue
				}
				if client == fresh {
					serial := resp.TLS.PeerCertificates[0].SerialNumber.Text(16)
					mu.Lock()
					seen[serial]++
					mu.Unlock()
					if serial != oldSerial {
						sawNew.Store(true)
					}
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
			}
		})
	}
	<-rotateNow
	newKP := s.rotateServerCertificate(t, s.ca)
	wg.Wait()
	took := time.Since(start)
	require.Zero(t, failures.Load(), "first failure: %v", firstErr)
	newSerial := newKP.Cert.SerialNumber.Text(16)
	t.Logf("%d requests in %s, %d failed; %d kept-alive connections; new connections saw server serials %v (old %s, new %s)",
		max(next.Load()-workers, total), took.Round(time.Millisecond), failures.Load(), dials.Load(), seen, oldSerial, newSerial)
	require.LessOrEqual(t, dials.Load(), int64(workers), "the keep-alive half of the load kept its connections")
	require.Positive(t, seen[oldSerial], "new connections before the rotation saw the old certificate")
	require.Positive(t, seen[newSerial], "new connections after the rotation saw the new certificate")
	require.Equal(t, newSerial, serverSerial(t, s, fresh))
	require.GreaterOrEqual(t, reloads(t, s, metrics.ConfigServerCertificate, "success"), 1.0)
}

// serverSerial returns the serial of the certificate a new connection sees.
func serverSerial(t *testing.T, s *stack, fresh *http.Client) string {
	t.Helper()
	resp, err := fresh.Get(s.url + "/v1/whoami")
	require.NoError(t, err)
	defer resp.Body.Close()
	return resp.TLS.PeerCertificates[0].SerialNumber.Text(16)
}

func testCARotation(t *testing.T, c *testcluster.Cluster) {
	s := startStack(t, c, grants)
	oldCA := s.ca
	newCA, err := pki.NewCA(pki.CAOptions{CommonName: "integration CA 2"})
	require.NoError(t, err)
	// Clients verify the broker with both CAs throughout; that part of a
	// rotation is theirs.
	roots := x509.NewCertPool()
	roots.AddCert(oldCA.Certificate())
	roots.AddCert(newCA.Certificate())
	oldClient := s.clientFrom(t, oldCA, "west", roots)
	newClient := s.clientFrom(t, newCA, "north", roots)
	whoami := func(c *http.Client) (int, error) {
		status, _, err := tryDo(c, http.MethodGet, s.url+"/v1/whoami", "", nil, nil)
		return status, err
	}

	status, err := whoami(oldClient)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status)
	_, err = whoami(newClient)
	require.Error(t, err, "a client of the new CA is refused before the bundle holds it")

	// Step 1: the bundle holds the old and the new CA.
	writeFileAtomic(t, s.clientCAFile, append(oldCA.BundlePEM(), newCA.BundlePEM()...))
	require.Eventually(t, func() bool {
		status, err := whoami(newClient)
		return err == nil && status == http.StatusOK
	}, 5*time.Second, 50*time.Millisecond, "clients of the new CA are accepted without a restart")
	status, err = whoami(oldClient)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status, "clients of the old CA still are")
	var tb apiv1.TrustBundle
	st, _ := do(t, newClient, http.MethodGet, s.url+"/v1/trust-bundle", nil, &tb)
	require.Equal(t, http.StatusOK, st)
	require.Equal(t, []string{pki.Fingerprint(oldCA.Certificate()), pki.Fingerprint(newCA.Certificate())}, tb.Fingerprints)

	// Step 2: the broker's own certificate comes from the new CA.
	s.rotateServerCertificate(t, newCA)

	// Step 2b: the signing CA moves to the new CA, without a restart.
	testSigningCARotation(t, s, oldCA, newCA, oldClient, roots)
	oldToken := joinToken(t, oldCA, identity(t, "east2"))

	// Step 3: the old CA leaves the bundle, and is no longer named the
	// previous signing CA. Its clients are refused on new connections
	// (handshake) and on kept-alive ones (401).
	writeFileAtomic(t, s.previousCAFile, newCA.BundlePEM())
	writeFileAtomic(t, s.clientCAFile, newCA.BundlePEM())
	freshOld := s.clientFrom(t, oldCA, "south", roots)
	require.Eventually(t, func() bool {
		status, err := whoami(oldClient)
		return err == nil && status == http.StatusUnauthorized
	}, 5*time.Second, 50*time.Millisecond, "a kept-alive client of the removed CA is refused")
	_, err = whoami(freshOld)
	require.Error(t, err, "a new connection with a certificate of the removed CA fails the handshake")
	status, err = whoami(newClient)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status)
	require.GreaterOrEqual(t, reloads(t, s, metrics.ConfigClientCA, "success"), 2.0)
	// The previous-CA file is looked at when a join token is verified, at
	// most every reloadInterval: probe with throwaway tokens of the old CA
	// until one is refused, then the token kept for this check must be too.
	probes := 0
	require.Eventually(t, func() bool {
		probes++
		name := fmt.Sprintf("probe%d", probes)
		status, _, err := s.enroll(t, joinToken(t, oldCA, identity(t, name)), identity(t, name), roots)
		return err == nil && status == http.StatusUnauthorized
	}, 5*time.Second, 100*time.Millisecond, "the old CA's join tokens are refused once it is no longer the previous CA")
	status, _, err = s.enroll(t, oldToken, identity(t, "east2"), roots)
	require.NoError(t, err)
	require.Equal(t, http.StatusUnauthorized, status, "a join token of the old CA ends with its naming as the previous CA")

	// A bundle file that is broken is refused and the bundle in force kept.
	writeFileAtomic(t, s.clientCAFile, []byte("not a bundle"))
	require.Eventually(t, func() bool {
		_, _ = whoami(newClient) // handshakes look at the file
		_, _ = whoami(s.clientFrom(t, newCA, "north", roots))
		return reloads(t, s, metrics.ConfigClientCA, "failure") >= 1
	}, 5*time.Second, 50*time.Millisecond)
	status, err = whoami(s.clientFrom(t, newCA, "north", roots))
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, status)
}

// testSigningCARotation replaces the signing CA's files of s (signing
// oldCA, trusting both CAs) with a broken file, then with newCA: the broken
// one is refused and counted while oldCA signs on; then renewals and
// enrollments get certificates of newCA, and join tokens of both CAs
// verify while both are in the bundle.
func testSigningCARotation(t *testing.T, s *stack, oldCA, newCA *pki.CA, client *http.Client, roots *x509.CertPool) {
	t.Helper()
	renew := func() *x509.Certificate {
		t.Helper()
		csr, _, err := pki.NewCSR(identity(t, "west"), nil)
		require.NoError(t, err)
		var renewed apiv1.CertificateResponse
		status, body := do(t, client, http.MethodPost, s.url+"/v1/certificates", apiv1.CertificateRequest{CSR: string(csr)}, &renewed)
		require.Equal(t, http.StatusCreated, status, string(body))
		certs, err := pki.ParseCertificatesPEM([]byte(renewed.Certificate))
		require.NoError(t, err)
		return certs[0]
	}
	signedBy := func(c *x509.Certificate, ca *pki.CA) bool { return c.CheckSignatureFrom(ca.Certificate()) == nil }
	oldToken := joinToken(t, oldCA, identity(t, "east1"))
	require.True(t, signedBy(renew(), oldCA))

	// A broken CA file: refused, counted, the old CA signs on. (Each
	// scrape looks at the files too, through the CA expiry metric; renewals
	// are rate-limited, so the test polls the metrics.)
	writeFileAtomic(t, s.caCertFile, []byte("not a CA"))
	require.Eventually(t, func() bool { return reloads(t, s, metrics.ConfigCA, "failure") >= 1 },
		5*time.Second, 10*time.Millisecond, "a broken CA file is refused and counted")
	require.True(t, signedBy(renew(), oldCA))
	require.NotEmpty(t, s.logs.FilterMessage("reload refused; keeping the previous one").FilterField(zap.String("config", metrics.ConfigCA)).All())

	// The new CA's files: picked up at the next look.
	start := time.Now()
	require.NoError(t, newCA.ReplaceFiles(s.caCertFile, s.caKeyFile))
	require.Eventually(t, func() bool { return reloads(t, s, metrics.ConfigCA, "success") >= 1 },
		5*time.Second, 10*time.Millisecond, "the new CA is taken without a restart")
	t.Logf("new signing CA in service %s after its files were written", time.Since(start).Round(time.Millisecond))
	require.True(t, signedBy(renew(), newCA), "renewals are signed by the new CA; a certificate of the old CA renews while it is named the previous CA")
	require.Empty(t, s.logs.FilterMessageSnippet("the signing CA is not in the client-CA bundle").All(), "the new CA is in the bundle")

	// Join tokens of both CAs enroll during the overlap, and the
	// certificates come from the new CA and work.
	for name, tok := range map[string]string{"east1": oldToken, "north": joinToken(t, newCA, identity(t, "north"))} {
		status, e, err := s.enroll(t, tok, identity(t, name), roots)
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, status, name)
		certs, err := pki.ParseCertificatesPEM([]byte(e.resp.Certificate))
		require.NoError(t, err)
		require.True(t, signedBy(certs[0], newCA), name)
		require.Contains(t, e.resp.CABundle, string(oldCA.BundlePEM()), "the bundle still holds the old CA")
		require.Contains(t, e.resp.CABundle, string(newCA.BundlePEM()))
		enrolled := s.clientWith(t, []byte(e.resp.Certificate), e.keyPEM, roots)
		status, _, err = tryDo(enrolled, http.MethodGet, s.url+"/v1/whoami", "", nil, nil)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, status, name)
	}
	expiry := counterOrGauge(t, s.reg, "tokenbroker_certificate_expiry_timestamp_seconds", map[string]string{"certificate": metrics.CertificateCA})
	require.Equal(t, float64(newCA.Certificate().NotAfter.Unix()), expiry, "the CA expiry metric follows the reload")
}

// counterOrGauge returns the value of a counter or gauge of reg with the
// given labels, and fails the test if there is none.
func counterOrGauge(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	v, ok := metricValue(t, reg, name, labels)
	if !ok {
		t.Fatalf("no %s%v", name, labels)
	}
	return v
}

func testPolicyReload(t *testing.T, c *testcluster.Cluster) {
	s := startStack(t, c, grants)
	west, south := s.client(t, "west"), s.client(t, "south")
	req := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"}
	issue(t, s, west, req)
	status, _ := do(t, south, http.MethodPost, s.url+"/v1/kubeconfigs", req, nil)
	require.Equal(t, http.StatusForbidden, status)

	writeFileAtomic(t, s.policyFile, []byte("peers: [\n"))
	require.Eventually(t, func() bool { return reloads(t, s, metrics.ConfigPolicy, "failure") == 1 },
		5*time.Second, 50*time.Millisecond, "the bad file is refused and counted")
	issue(t, s, west, req) // the old policy is still in force
	require.Equal(t, 1, s.logs.FilterMessage("policy reload refused; keeping the policy in force").Len())

	s.writePolicy(t, grants+`
  - name: south
    identity: spiffe://it.tokenbroker.test/cluster/south
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
`)
	require.Eventually(t, func() bool {
		status, _, err := tryDo(south, http.MethodPost, s.url+"/v1/kubeconfigs", "", req, nil)
		return err == nil && status == http.StatusCreated
	}, 5*time.Second, 50*time.Millisecond, "the good file is picked up")
	require.Equal(t, 1.0, reloads(t, s, metrics.ConfigPolicy, "success"))
	require.Equal(t, 1.0, reloads(t, s, metrics.ConfigPolicy, "failure"))
}

func TestRevocationIsEnforcedWithin10sOnKeptAliveConnections(t *testing.T) {
	t.Parallel()
	c := testcluster.Start(t)
	s := startStack(t, c, grants)
	ctx := context.Background()
	cms := c.Client.CoreV1().ConfigMaps(brokerNamespace)
	west := identity(t, "west")

	client := s.client(t, "west")
	var reused atomic.Bool
	whoami := func(c *http.Client) int {
		trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused.Store(i.Reused) }}
		req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodGet, s.url+"/v1/whoami", nil)
		require.NoError(t, err)
		resp, err := c.Do(req)
		require.NoError(t, err)
		// Read to the end, so that the connection goes back to the pool.
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusOK, whoami(client))

	// Written by the code behind "tokenbroker pki revoke --identity".
	start := time.Now()
	added, err := enrollment.AddRevocation(ctx, cms, enrollment.RevokeIdentity, west, "integration test", time.Now())
	require.NoError(t, err)
	require.True(t, added)
	require.Eventually(t, func() bool { return whoami(client) == http.StatusUnauthorized }, 10*time.Second, 10*time.Millisecond)
	t.Logf("revoked identity refused %s after the ConfigMap write", time.Since(start).Round(time.Millisecond))
	require.True(t, reused.Load(), "the refusal came on the kept-alive connection")

	// A revoked identity cannot enroll or renew either.
	status, _, err := s.enroll(t, joinToken(t, s.ca, west), west, s.ca.CertPool())
	require.NoError(t, err)
	require.Equal(t, http.StatusUnauthorized, status)
	csr, _, err := pki.NewCSR(west, nil)
	require.NoError(t, err)
	status, _ = do(t, s.client(t, "west"), http.MethodPost, s.url+"/v1/certificates", apiv1.CertificateRequest{CSR: string(csr)}, nil)
	require.Equal(t, http.StatusUnauthorized, status)

	// A serial revokes one certificate of an identity, not the others.
	north1, north2 := s.client(t, "north"), s.client(t, "north")
	require.Equal(t, http.StatusOK, whoami(north1))
	require.Equal(t, http.StatusOK, whoami(north2))
	var who apiv1.WhoAmI
	st, _ := do(t, north1, http.MethodGet, s.url+"/v1/whoami", nil, &who)
	require.Equal(t, http.StatusOK, st)
	start = time.Now()
	_, err = enrollment.AddRevocation(ctx, cms, enrollment.RevokeSerial, strings.ToUpper(who.Certificate.SerialNumber), "", time.Now())
	require.NoError(t, err)
	require.Eventually(t, func() bool { return whoami(north1) == http.StatusUnauthorized }, 10*time.Second, 10*time.Millisecond)
	t.Logf("revoked serial refused %s after the ConfigMap write", time.Since(start).Round(time.Millisecond))
	require.Equal(t, http.StatusOK, whoami(north2))

	// The revocation gauge follows the ConfigMap.
	require.Eventually(t, func() bool {
		mfs, err := s.reg.Gather()
		require.NoError(t, err)
		for _, mf := range mfs {
			if mf.GetName() == "tokenbroker_revocations" {
				return len(mf.GetMetric()) == 2
			}
		}
		return false
	}, 5*time.Second, 50*time.Millisecond)

	// Deleting the deny list lifts it.
	require.NoError(t, cms.Delete(ctx, enrollment.RevocationConfigMap, metav1.DeleteOptions{}))
	require.Eventually(t, func() bool { return whoami(client) == http.StatusOK }, 10*time.Second, 10*time.Millisecond)
}
