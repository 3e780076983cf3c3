package testcluster

import (
	"context"
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

const (
	// ServiceCIDR is the --service-cluster-ip-range of every cluster.
	ServiceCIDR = "10.0.0.0/24"

	apiServerLogFile = "kube-apiserver.log"
	auditPolicyFile  = "audit-policy.yaml"
	auditLogFile     = "audit.log"
	kubeconfigName   = "testcluster"

	// clientQPS and clientBurst keep client-go's rate limiter out of the
	// way of tests that make many requests.
	clientQPS   = 1000
	clientBurst = 2000

	pollInterval    = 50 * time.Millisecond
	probeTimeout    = 5 * time.Second
	portBindRetries = 3
)

// Cluster is a running control plane. Its exported fields are set by Run
// and must not be changed.
type Cluster struct {
	// URL is the API server's address, https://127.0.0.1:<port>. It stays
	// the same across StopAPIServer/StartAPIServer.
	URL string
	// CAData is the PEM of the cluster CA: it signs the API server's serving
	// certificate and is the API server's client CA.
	CAData []byte
	// Config authenticates as a cluster admin (group system:masters), with
	// client-side rate limits high enough not to throttle tests. Callers
	// that change it should change a rest.CopyConfig of it.
	Config *rest.Config
	// Client is a clientset for Config.
	Client kubernetes.Interface
	// KubeconfigPath is an admin kubeconfig file (credentials embedded).
	KubeconfigPath string
	// Dir holds the cluster's certificates, keys, etcd data and logs. Stop
	// removes it.
	Dir string
	// ServiceAccountIssuer is the iss claim of service account tokens.
	ServiceAccountIssuer string
	// APIAudiences are the audiences the API server accepts by default.
	APIAudiences []string
	// StartDuration is how long Run took, binaries excluded.
	StartDuration time.Duration

	opts   options
	etcd   *embeddedEtcd
	apiBin string
	kcmBin string
	port   int

	mu        sync.Mutex // guards apiserver and kcm
	apiserver *process
	kcm       *process
	node      *Node // set by startNode as soon as there is something to clean up

	// Node is the cluster's node with WithNode, nil without.
	Node *Node

	stopOnce sync.Once
	stopErr  error
}

// Start starts a cluster for a test and registers its Stop with t.Cleanup.
// It fails the test if the cluster cannot be started.
func Start(t testing.TB, opts ...Option) *Cluster {
	t.Helper()
	c, err := Run(t.Context(), opts...)
	if err != nil {
		t.Fatalf("start test cluster: %v", err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Errorf("stop test cluster: %v", err)
		}
	})
	t.Logf("test cluster %s ready in %s (dir %s)", c.URL, c.StartDuration.Round(time.Millisecond), c.Dir)
	return c
}

// Run starts a cluster and returns once it is ready: every /readyz check
// passes (so the RBAC bootstrap roles exist) and the default namespace
// exists. ctx bounds the start only; the cluster runs until Stop. On error
// everything that was started is stopped and removed again.
//
// Missing binaries are built first (see Binary), which the start timeout
// does not cover.
func Run(ctx context.Context, opts ...Option) (*Cluster, error) {
	o := newOptions(opts)
	if err := o.validate(); err != nil {
		return nil, err
	}
	c := &Cluster{
		opts:                 o,
		ServiceAccountIssuer: o.issuer,
		APIAudiences:         o.audiences,
	}
	var err error
	if c.apiBin, err = Binary(ctx, o.binDir, KubeAPIServer); err != nil {
		return nil, err
	}
	if o.controllerManager {
		if c.kcmBin, err = Binary(ctx, o.binDir, KubeControllerManager); err != nil {
			return nil, err
		}
	}
	var node *Node
	if o.node {
		reapStaleNodes()
		if _, err := checkNodeHost(); err != nil {
			return nil, err
		}
		if node, err = c.nodeBinaries(ctx); err != nil {
			return nil, err
		}
		if _, err := NodeImage(ctx, o.binDir); err != nil {
			return nil, err
		}
	}

	begin := time.Now()
	ctx, cancel := context.WithTimeout(ctx, o.startTimeout)
	defer cancel()
	if err := c.start(ctx, node); err != nil {
		if stopErr := c.teardown(); stopErr != nil {
			err = errors.Join(err, fmt.Errorf("clean up: %w", stopErr))
		}
		return nil, err
	}
	c.StartDuration = time.Since(begin)
	return c, nil
}

func (c *Cluster) start(ctx context.Context, node *Node) error {
	dir, err := os.MkdirTemp("", "testcluster-")
	if err != nil {
		return fmt.Errorf("create cluster directory: %w", err)
	}
	c.Dir = dir

	pki, err := writePKI(dir)
	if err != nil {
		return fmt.Errorf("create cluster PKI: %w", err)
	}
	c.CAData = pki.caCert
	if c.opts.auditPolicy != "" {
		if err := os.WriteFile(filepath.Join(dir, auditPolicyFile), []byte(c.opts.auditPolicy), 0o600); err != nil {
			return fmt.Errorf("write audit policy: %w", err)
		}
	}

	if c.etcd, err = startEtcd(ctx, dir, c.opts.etcdFsync); err != nil {
		return err
	}

	// The API server must bind a port we choose (clients need it before it
	// starts, and it must survive a restart). A free port can be taken by
	// someone else before the API server binds it: then try another one.
	for attempt := 1; ; attempt++ {
		if c.port, err = freePort(); err != nil {
			return err
		}
		c.URL = "https://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(c.port))
		if err := c.setUpClients(pki); err != nil {
			return err
		}
		if node != nil {
			if err := c.writeNodePKI(pki.ca, c.URL); err != nil {
				return fmt.Errorf("create node PKI: %w", err)
			}
		}
		err = c.startAPIServer(ctx)
		if err == nil {
			break
		}
		if !errors.Is(err, errPortInUse) || attempt == portBindRetries {
			return err
		}
	}
	if err := c.waitForNamespace(ctx, "default"); err != nil {
		return err
	}
	if c.opts.controllerManager {
		if err := c.startControllerManager(ctx); err != nil {
			return err
		}
	}
	if node != nil {
		if err := c.startNode(ctx, node); err != nil {
			return err
		}
		c.Node = node
	}
	return nil
}

// setUpClients builds Config, Client and the kubeconfig file for c.URL.
func (c *Cluster) setUpClients(pki *pkiMaterial) error {
	c.Config = &rest.Config{
		Host: c.URL,
		TLSClientConfig: rest.TLSClientConfig{
			CAData:   pki.caCert,
			CertData: pki.adminCert,
			KeyData:  pki.adminKey,
		},
		QPS:   clientQPS,
		Burst: clientBurst,
	}
	client, err := kubernetes.NewForConfig(c.Config)
	if err != nil {
		return fmt.Errorf("create admin client: %w", err)
	}
	c.Client = client

	kc := clientcmdapi.NewConfig()
	kc.Clusters[kubeconfigName] = &clientcmdapi.Cluster{Server: c.URL, CertificateAuthorityData: pki.caCert}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: pki.adminCert, ClientKeyData: pki.adminKey}
	kc.Contexts["admin@"+kubeconfigName] = &clientcmdapi.Context{Cluster: kubeconfigName, AuthInfo: "admin", Namespace: "default"}
	kc.CurrentContext = "admin@" + kubeconfigName
	c.KubeconfigPath = filepath.Join(c.Dir, kubeconfigFile)
	if err := clientcmd.WriteToFile(*kc, c.KubeconfigPath); err != nil {
		return fmt.Errorf("write admin kubeconfig: %w", err)
	}
	return nil
}

// TokenConfig returns a rest.Config that authenticates with a bearer token
// only (no admin credentials), for acting as a ServiceAccount.
func (c *Cluster) TokenConfig(token string) *rest.Config {
	return &rest.Config{
		Host:            c.URL,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.CAData},
		QPS:             clientQPS,
		Burst:           clientBurst,
	}
}

// ClientCertConfig returns a rest.Config that authenticates with the given
// PEM client certificate and key only, e.g. one issued through a
// CertificateSigningRequest.
func (c *Cluster) ClientCertConfig(certPEM, keyPEM []byte) *rest.Config {
	return &rest.Config{
		Host: c.URL,
		TLSClientConfig: rest.TLSClientConfig{
			CAData:   c.CAData,
			CertData: certPEM,
			KeyData:  keyPEM,
		},
		QPS:   clientQPS,
		Burst: clientBurst,
	}
}

// APIServerLogPath is the kube-apiserver's log file (in Dir, so gone after
// Stop).
func (c *Cluster) APIServerLogPath() string {
	return filepath.Join(c.Dir, apiServerLogFile)
}

// AuditLogPath is the API server's audit log (JSON lines of
// audit.k8s.io/v1 events) when the cluster runs WithAuditPolicy, "" if
// not. It is in Dir, so gone after Stop.
func (c *Cluster) AuditLogPath() string {
	if c.opts.auditPolicy == "" {
		return ""
	}
	return filepath.Join(c.Dir, auditLogFile)
}

// StopAPIServer stops the kube-apiserver process alone (SIGTERM, then SIGKILL
// after the stop timeout), keeping etcd and its data, so that a test can see
// what its code does while the API server is down. StartAPIServer brings it
// back on the same URL. Stopping a stopped API server does nothing.
func (c *Cluster) StopAPIServer() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.apiserver == nil {
		return nil
	}
	err := c.apiserver.stop(c.opts.stopTimeout)
	c.apiserver = nil
	if err != nil {
		return fmt.Errorf("stop kube-apiserver: %w", err)
	}
	return nil
}

// StartAPIServer starts the kube-apiserver again after StopAPIServer, on the
// same port with the same certificates and data, and waits until it is
// ready. Config, Client and every token stay valid. It fails if the API
// server is running, or if the port was taken meanwhile.
func (c *Cluster) StartAPIServer(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, c.opts.startTimeout)
	defer cancel()
	return c.startAPIServer(ctx)
}

// RestartAPIServer is StopAPIServer followed by StartAPIServer.
func (c *Cluster) RestartAPIServer(ctx context.Context) error {
	if err := c.StopAPIServer(); err != nil {
		return err
	}
	return c.StartAPIServer(ctx)
}

// Stop stops the controller manager, the API server and etcd, and removes
// Dir. It is safe to call more than once; later calls return the first
// call's result.
func (c *Cluster) Stop() error {
	c.stopOnce.Do(func() { c.stopErr = c.teardown() })
	return c.stopErr
}

// teardown stops whatever has been started and removes the directory.
func (c *Cluster) teardown() error {
	var errs []error
	if c.node != nil {
		if err := c.node.stop(c.opts.stopTimeout); err != nil {
			errs = append(errs, fmt.Errorf("stop node: %w", err))
		}
		c.node = nil
	}
	c.mu.Lock()
	if c.kcm != nil {
		if err := c.kcm.stop(c.opts.stopTimeout); err != nil {
			errs = append(errs, fmt.Errorf("stop kube-controller-manager: %w", err))
		}
		c.kcm = nil
	}
	if c.apiserver != nil {
		if err := c.apiserver.stop(c.opts.stopTimeout); err != nil {
			errs = append(errs, fmt.Errorf("stop kube-apiserver: %w", err))
		}
		c.apiserver = nil
	}
	c.mu.Unlock()
	if c.etcd != nil {
		c.etcd.close()
		c.etcd = nil
	}
	if c.Dir != "" {
		if err := os.RemoveAll(c.Dir); err != nil {
			errs = append(errs, fmt.Errorf("remove cluster directory: %w", err))
		}
	}
	return errors.Join(errs...)
}

// errPortInUse marks an API server that could not bind its port.
var errPortInUse = errors.New("port already in use")

func (c *Cluster) apiServerArgs() []string {
	file := func(name string) string { return filepath.Join(c.Dir, name) }
	args := []string{
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		// Since 1.37 the API server refuses to publish a loopback address
		// as the kubernetes Service's endpoint; there is no node to reach
		// it from, so publish none.
		"--endpoint-reconciler-type=none",
		"--secure-port=" + strconv.Itoa(c.port),
		"--cert-dir=" + file("apiserver-certs"),
		"--tls-cert-file=" + file(servingCertFile),
		"--tls-private-key-file=" + file(servingKeyFile),
		"--client-ca-file=" + file(caCertFile),
		"--etcd-servers=" + c.etcd.url,
		"--service-cluster-ip-range=" + ServiceCIDR,
		"--service-account-issuer=" + c.opts.issuer,
		"--service-account-key-file=" + file(saPublicKeyFile),
		"--service-account-signing-key-file=" + file(saPrivateKeyFile),
		"--api-audiences=" + strings.Join(c.opts.audiences, ","),
		c.authorizationMode(),
		// Not needed by tests, and each costs start time or CPU.
		"--enable-priority-and-fairness=false",
		fmt.Sprintf("--profiling=%t", c.opts.profiling),
		"--enable-logs-handler=false",
		// Without a grace period for watches, an open watch (a broker's
		// informer) holds the API server's graceful shutdown until the
		// stop timeout kills it; with one, watches are ended and
		// StopAPIServer returns in about a second.
		"--shutdown-watch-termination-grace-period=2s",
	}
	if c.opts.node {
		args = append(args, c.nodeAPIServerArgs()...)
	}
	if c.opts.maxTokenExpiration > 0 {
		args = append(args, "--service-account-max-token-expiration="+c.opts.maxTokenExpiration.String())
	}
	if c.opts.auditPolicy != "" {
		args = append(args, "--audit-policy-file="+file(auditPolicyFile), "--audit-log-path="+c.AuditLogPath(),
			"--audit-log-format=json", "--audit-log-mode=blocking", "--audit-log-maxsize=0")
	}
	if c.opts.minRequestTimeout > 0 {
		args = append(args, "--min-request-timeout="+strconv.Itoa(int(c.opts.minRequestTimeout/time.Second)))
	}
	return append(args, c.opts.apiServerArgs...)
}

// authorizationMode is RBAC, and Node before it with a node: the kubelet
// then reads and writes only what its own pods need, as on a real
// cluster.
func (c *Cluster) authorizationMode() string {
	if c.opts.node {
		return "--authorization-mode=Node,RBAC"
	}
	return "--authorization-mode=RBAC"
}

// startAPIServer starts the kube-apiserver process and waits for /readyz.
func (c *Cluster) startAPIServer(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.apiserver != nil {
		return errors.New("kube-apiserver is already running")
	}
	p, err := startProcess(KubeAPIServer, c.apiBin, c.apiServerArgs(), c.APIServerLogPath())
	if err != nil {
		return err
	}
	if err := c.waitForReadyz(ctx, p); err != nil {
		return p.notReady(c.opts.stopTimeout, "kube-apiserver not ready", err)
	}
	c.apiserver = p
	return nil
}

// waitForReadyz polls /readyz until it answers 200, p exits or ctx ends.
func (c *Cluster) waitForReadyz(ctx context.Context, p *process) error {
	probe := rest.CopyConfig(c.Config)
	probe.Timeout = probeTimeout
	client, err := kubernetes.NewForConfig(probe)
	if err != nil {
		return fmt.Errorf("create probe client: %w", err)
	}
	var last error
	for {
		if gone, err := p.exited(); gone {
			return fmt.Errorf("process exited: %w", err)
		}
		body, err := client.Discovery().RESTClient().Get().AbsPath("/readyz").Param("verbose", "true").DoRaw(ctx)
		if err == nil {
			return nil
		}
		last = fmt.Errorf("%w: %s", err, failedChecks(body))
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w; last /readyz: %w", ctx.Err(), last)
		case <-time.After(pollInterval):
		}
	}
}

// failedChecks picks the failing lines out of a verbose /readyz body.
func failedChecks(body []byte) string {
	var failed []string
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "[-]") {
			failed = append(failed, strings.TrimPrefix(line, "[-]"))
		}
	}
	return strings.Join(failed, "; ")
}

// waitForNamespace waits until the API server's system namespaces controller
// has created the namespace (it runs after /readyz is green).
func (c *Cluster) waitForNamespace(ctx context.Context, name string) error {
	for {
		_, err := c.Client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for namespace %q: %w (last error: %w)", name, ctx.Err(), err)
		case <-time.After(pollInterval):
		}
	}
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer func() { _ = l.Close() }()
	addr, ok := l.Addr().(*net.TCPAddr)
	if !ok {
		return 0, fmt.Errorf("find a free port: unexpected address %v", l.Addr())
	}
	return addr.Port, nil
}

// RotateServiceAccountKey gives the API server a new service-account
// signing key: it stops the API server, replaces the key pair it signs and
// verifies tokens with (--service-account-signing-key-file and
// --service-account-key-file), and starts it again. With keepOld the old
// public key stays in --service-account-key-file, so tokens signed before
// still authenticate and /openid/v1/jwks lists both keys; without it only
// the new key is trusted and published, as after a key compromise.
func (c *Cluster) RotateServiceAccountKey(ctx context.Context, keepOld bool) error {
	if err := c.StopAPIServer(); err != nil {
		return err
	}
	oldPub, err := os.ReadFile(filepath.Join(c.Dir, saPublicKeyFile))
	if err != nil {
		return fmt.Errorf("read service account public key: %w", err)
	}
	if err := writeServiceAccountKeys(c.Dir); err != nil {
		return err
	}
	if keepOld {
		newPub, err := os.ReadFile(filepath.Join(c.Dir, saPublicKeyFile))
		if err != nil {
			return fmt.Errorf("read service account public key: %w", err)
		}
		if err := writeFile(filepath.Join(c.Dir, saPublicKeyFile), append(newPub, oldPub...), 0o644); err != nil {
			return err
		}
	}
	return c.StartAPIServer(ctx)
}

// ServiceAccountSigningKey returns the private key the API server signs
// service-account tokens with now, for tests that forge tokens the API
// server's own checks would never issue (expired, wrong audience…).
func (c *Cluster) ServiceAccountSigningKey() (crypto.Signer, error) {
	data, err := os.ReadFile(filepath.Join(c.Dir, saPrivateKeyFile))
	if err != nil {
		return nil, fmt.Errorf("read service account key: %w", err)
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, errors.New("service account key: no PEM block")
	}
	key, err := x509.ParsePKCS8PrivateKey(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("parse service account key: %w", err)
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("service account key is a %T", key)
	}
	return signer, nil
}
