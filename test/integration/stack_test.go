package integration

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const (
	trustDomain = "it.tokenbroker.test"
	// brokerNamespace is the broker's own namespace: used join tokens and
	// the revocation ConfigMap.
	brokerNamespace = "tokenbroker"
	// reloadInterval is how often the stack's files are looked at; shorter
	// than production's second so that the tests are quick.
	reloadInterval = 200 * time.Millisecond
)

// stack is a broker running in this process against a real kube-apiserver,
// reached over real (mutual) TLS, started by server.Run, the composition
// root "tokenbroker serve" runs: reloading server certificate, client-CA
// bundle and policy, the revocation list watched in the API, a signing CA,
// the enrollment listener, lease GC and the audit log (a file).
type stack struct {
	cluster *testcluster.Cluster
	broker  *broker.Broker
	url     string
	// enrollURL is the enrollment listener's base URL, gatewayURL the
	// lease gateway's ("" without one).
	enrollURL, gatewayURL string
	ca                    *pki.CA
	dir                   string
	logs                  *observer.ObservedLogs
	reg                   prometheus.Gatherer
	// auditLog is the broker's audit log file.
	auditLog string

	serverCert, serverKey string
	// clientCAFile is the client-CA bundle file the broker follows; it
	// starts out holding ca's bundle.
	clientCAFile string
	policyFile   string
	// caCertFile and caKeyFile are the signing CA's files the broker
	// follows; they start out holding ca.
	caCertFile, caKeyFile string
	// previousCAFile is the --previous-ca-cert-file the broker follows; it
	// starts out holding ca (the signing CA itself, which changes nothing),
	// so that a CA rotation names the old CA there.
	previousCAFile string
	// stop stops the broker (once; the test's cleanup calls it too).
	stop func()
}

// stackOption changes how startStack builds a stack.
type stackOption func(*stackConfig)

type stackConfig struct {
	ca            *pki.CA
	maxLiveLeases int
	kube          *rest.Config
	// publishCTB is serve's --publish-cluster-trust-bundle.
	publishCTB string
	// gateway turns the lease gateway on, on a free port of 127.0.0.1.
	gateway bool
	// signClusterCAs is serve's --sign-cluster-cas.
	signClusterCAs bool
}

// withSignClusterCAs sets serve's --sign-cluster-cas.
func withSignClusterCAs() stackOption { return func(c *stackConfig) { c.signClusterCAs = true } }

// withGateway turns the lease gateway on (serve --gateway-address and
// --gateway-url).
func withGateway() stackOption { return func(c *stackConfig) { c.gateway = true } }

// freeAddress is a free port of 127.0.0.1 at the time of the call, for a
// listener whose URL must be known before it starts.
func freeAddress(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// withPublishedTrustBundle sets serve's --publish-cluster-trust-bundle.
func withPublishedTrustBundle(signer string) stackOption {
	return func(c *stackConfig) { c.publishCTB = signer }
}

// withMaxLiveLeases sets serve's --max-live-leases.
func withMaxLiveLeases(n int) stackOption { return func(c *stackConfig) { c.maxLiveLeases = n } }

// withKube makes the broker reach the API server with kube rather than as
// the cluster's admin (e.g. impersonating its ServiceAccount).
func withKube(kube *rest.Config) stackOption { return func(c *stackConfig) { c.kube = kube } }

// withCA makes the stack sign with (and trust) ca, so that two stacks are
// two replicas of one broker.
func withCA(ca *pki.CA) stackOption { return func(c *stackConfig) { c.ca = ca } }

func startStack(t *testing.T, c *testcluster.Cluster, pol string, opts ...stackOption) *stack {
	t.Helper()
	var sc stackConfig
	for _, o := range opts {
		o(&sc)
	}
	dir := t.TempDir()
	ca := sc.ca
	if ca == nil {
		var err error
		ca, err = pki.NewCA(pki.CAOptions{CommonName: "integration CA"})
		require.NoError(t, err)
	}
	s := &stack{
		cluster: c, ca: ca, dir: dir,
		serverCert: filepath.Join(dir, "server.crt"), serverKey: filepath.Join(dir, "server.key"),
		clientCAFile: filepath.Join(dir, "client-ca.crt"),
		policyFile:   filepath.Join(dir, "policy.yaml"),
		auditLog:     filepath.Join(dir, "audit.jsonl"),
	}
	s.rotateServerCertificate(t, ca)
	require.NoError(t, os.WriteFile(s.clientCAFile, ca.BundlePEM(), 0o644))

	caFile := filepath.Join(dir, "cluster-ca.crt")
	require.NoError(t, os.WriteFile(caFile, c.CAData, 0o644))
	s.writePolicy(t, pol)
	ensureNamespace(t, c, brokerNamespace)
	caCert, caKey := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
	require.NoError(t, ca.WriteFiles(caCert, caKey))
	s.caCertFile, s.caKeyFile = caCert, caKey
	s.previousCAFile = filepath.Join(dir, "previous-ca.crt")
	require.NoError(t, os.WriteFile(s.previousCAFile, ca.CertPEM(), 0o644))

	kube := c.Config
	if sc.kube != nil {
		kube = sc.kube
	}
	var gatewayAddr string
	if sc.gateway {
		gatewayAddr = freeAddress(t)
		s.gatewayURL = "https://" + gatewayAddr
	}
	core, logs := observer.New(zap.DebugLevel)
	started := make(chan server.Started, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		// The composition root "tokenbroker serve" runs, with GC and the
		// audit log as shipped; only the files are quicker to reload.
		done <- server.Run(ctx, server.Options{
			ListenAddress:             "127.0.0.1:0",
			EnrollAddress:             "127.0.0.1:0",
			OpsAddress:                "127.0.0.1:0",
			TLSCertFile:               s.serverCert,
			TLSKeyFile:                s.serverKey,
			ClientCAFile:              s.clientCAFile,
			CACertFile:                caCert,
			CAKeyFile:                 caKey,
			PreviousCACertFile:        s.previousCAFile,
			ClientCertTTL:             pki.DefaultClientLifetime,
			SignClusterCAs:            sc.signClusterCAs,
			PolicyFile:                s.policyFile,
			Namespace:                 brokerNamespace,
			Kube:                      kube,
			KubeQPS:                   1000,
			KubeBurst:                 2000,
			GCInterval:                time.Minute,
			MaxLiveLeases:             sc.maxLiveLeases,
			ReloadInterval:            reloadInterval,
			MaxBodyBytes:              server.DefaultMaxBodyBytes,
			Credentials:               []string{apiv1.CredentialToken},
			AuditLog:                  s.auditLog,
			PublishClusterTrustBundle: sc.publishCTB,
			GatewayAddress:            gatewayAddr,
			GatewayURL:                s.gatewayURL,
			Logger:                    zap.New(core),
			Started:                   func(st server.Started) { started <- st },
		})
	}()
	s.stop = sync.OnceFunc(func() {
		cancel()
		require.NoError(t, <-done)
	})
	t.Cleanup(s.stop)
	var st server.Started
	select {
	case st = <-started:
	case err := <-done:
		done <- err // for the cleanup, which would otherwise wait for ever
		t.Fatalf("the broker did not start: %v", err)
	}
	s.broker, s.logs, s.reg = st.Broker, logs, st.Metrics
	s.url = "https://" + st.API.String()
	s.enrollURL = "https://" + st.Enroll.String()
	return s
}

// noLimits lifts the per-peer limits, which these tests of other things
// (load, races of enrollments) would reach; test/e2e/limits_test.go tests
// the limits.
const noLimits = "limits: {issuancesPerMinute: 1000000, burst: 1000000, renewalsPerMinute: 1000000, maxLiveLeases: 1000000, enrollmentsPerMinute: 1000000, leaseReadsPerMinute: 1000000, leaseReadsInFlight: 1000000}\n"

// writePolicy writes the policy file: the cluster section, the limits
// lifted unless doc sets some, then doc.
func (s *stack) writePolicy(t *testing.T, doc string) {
	t.Helper()
	if !strings.Contains(doc, "limits:") {
		doc = noLimits + doc
	}
	full := fmt.Sprintf("cluster: {name: east, server: %q, caFile: cluster-ca.crt}\n%s", s.cluster.URL, doc)
	writeFileAtomic(t, s.policyFile, []byte(full))
}

// rotateServerCertificate issues a new server certificate from ca and
// writes it over the served files, as cert-manager would.
func (s *stack) rotateServerCertificate(t *testing.T, ca *pki.CA) *pki.KeyPair {
	t.Helper()
	kp, err := ca.IssueServer(pki.ServerOptions{IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}})
	require.NoError(t, err)
	require.NoError(t, kp.WriteFiles(s.serverCert, s.serverKey))
	return kp
}

// writeFileAtomic replaces a file in one rename, as Kubernetes volume
// updates and editors that save safely do.
func writeFileAtomic(t *testing.T, name string, data []byte) {
	t.Helper()
	tmp := name + ".tmp"
	require.NoError(t, os.WriteFile(tmp, data, 0o644))
	require.NoError(t, os.Rename(tmp, name))
}

func ensureNamespace(t *testing.T, c *testcluster.Cluster, name string) {
	t.Helper()
	_, err := c.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if !apierrors.IsAlreadyExists(err) {
		require.NoError(t, err)
	}
}

// identity returns the cluster identity of name in the test trust domain.
func identity(t *testing.T, name string) string {
	t.Helper()
	id, err := pki.ClusterIdentity(trustDomain, name)
	require.NoError(t, err)
	return id
}

// client returns an HTTP client presenting a certificate for the cluster
// identity name, with the production TLS client profile.
func (s *stack) client(t *testing.T, name string) *http.Client {
	t.Helper()
	return s.clientFrom(t, s.ca, name, s.ca.CertPool())
}

// clientFrom is client with a certificate from ca, verifying the broker
// with roots.
func (s *stack) clientFrom(t *testing.T, ca *pki.CA, name string, roots *x509.CertPool) *http.Client {
	t.Helper()
	kp, err := ca.IssueClient(pki.ClientOptions{Identity: identity(t, name)})
	require.NoError(t, err)
	return s.clientWith(t, kp.CertPEM, kp.KeyPEM, roots)
}

// clientWith is an HTTP client presenting the given certificate and key.
func (s *stack) clientWith(t *testing.T, certPEM, keyPEM []byte, roots *x509.CertPool) *http.Client {
	t.Helper()
	f, err := os.CreateTemp(s.dir, "client-*.crt")
	require.NoError(t, err)
	require.NoError(t, f.Close())
	certFile, keyFile := f.Name(), f.Name()+".key"
	require.NoError(t, os.WriteFile(certFile, certPEM, 0o644))
	require.NoError(t, os.WriteFile(keyFile, keyPEM, 0o600))
	r, err := pki.NewCertReloader(certFile, keyFile)
	require.NoError(t, err)
	return &http.Client{
		Timeout:   30 * time.Second,
		Transport: &http.Transport{TLSClientConfig: pki.ClientTLSConfig(roots, r)},
	}
}

// do sends a JSON request and decodes the answer into out (if not nil). It
// returns the status and the raw body.
func do(t *testing.T, c *http.Client, method, url string, in, out any) (int, []byte) {
	t.Helper()
	status, body, err := tryDo(c, method, url, "", in, out)
	require.NoError(t, err)
	return status, body
}

// tryDo is do that returns transport errors, with an optional bearer
// token.
func tryDo(c *http.Client, method, url, bearer string, in, out any) (int, []byte, error) {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return 0, nil, err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, url, body)
	if err != nil {
		return 0, nil, err
	}
	if in != nil {
		req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
	}
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, err
	}
	if out != nil && resp.StatusCode < 300 {
		if err := json.Unmarshal(raw, out); err != nil {
			return 0, nil, fmt.Errorf("decode %s: %w", raw, err)
		}
	}
	return resp.StatusCode, raw, nil
}

func zapNop() *zap.Logger { return zap.NewNop() }

func jsonBody(t *testing.T, v any) io.Reader {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return bytes.NewReader(b)
}
