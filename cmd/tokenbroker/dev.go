package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
)

// devConfig is the typed configuration of "tokenbroker dev".
type devConfig struct {
	Kubeconfig    string
	Dir           string
	ListenAddress string
	OpsAddress    string
	Kubectl       string
	Log           logConfig
}

const (
	devTrustDomain = "dev.tokenbroker.local"
	devPeer        = "west"
	devNamespace   = "demo"
	devSA          = "demo"
)

func newDevCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run a broker against a local cluster with a dev PKI and a demo policy",
		Long: `Set up everything a demo needs and run the broker in the foreground:

  - a dev PKI in --dir (CA, server certificate for 127.0.0.1/localhost, and a
    client certificate for the peer spiffe://` + devTrustDomain + `/cluster/` + devPeer + `),
  - the namespace "` + devNamespace + `" with the ServiceAccount "` + devSA + `", allowed to read
    ConfigMaps, Pods and Services there, and a ConfigMap to look at,
  - a policy that lets the peer "` + devPeer + `" obtain kubeconfigs for it,

then print a curl command and a kubectl command that work as printed.
"make dev" starts a local cluster and runs this command against it.
Ctrl-C stops the broker.`,
		Example: `  # what "make dev" runs, once bin/localcluster has started a cluster
  tokenbroker dev --dir .dev --kubeconfig .dev/admin.kubeconfig

  # on other ports
  tokenbroker dev --kubeconfig admin.kubeconfig --listen-address 127.0.0.1:18443 --ops-address 127.0.0.1:19090`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			v, err := newViper(cmd)
			if err != nil {
				return err
			}
			cfg := devConfig{
				Kubeconfig:    v.GetString("kubeconfig"),
				Dir:           v.GetString("dir"),
				ListenAddress: v.GetString("listen-address"),
				OpsAddress:    v.GetString("ops-address"),
				Kubectl:       v.GetString("kubectl"),
				Log:           logConfigFrom(v),
			}
			return withLogger(cfg.Log, func(log *zap.Logger) error {
				return runDev(cmd.Context(), cfg, log, cmd.OutOrStdout())
			})
		},
	}
	fs := cmd.Flags()
	fs.String("kubeconfig", "", "admin kubeconfig of the local cluster (default $KUBECONFIG)")
	fs.String("dir", ".dev", "directory for the dev PKI, policy and fetched kubeconfigs")
	fs.String("listen-address", "127.0.0.1:8443", "address of the mutual-TLS API listener")
	fs.String("ops-address", "127.0.0.1:9090", "address of the operations listener")
	fs.String("kubectl", "", "kubectl to show in the printed command (default: kubectl on PATH, else bin/kubectl)")
	addLogFlags(fs, "console")
	cmd.Flags().String("config", "", "YAML config file whose keys are these flag names")
	return cmd
}

func runDev(ctx context.Context, cfg devConfig, log *zap.Logger, out io.Writer) error {
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	admin, err := restConfig(cfg.Kubeconfig, "")
	if err != nil {
		return fmt.Errorf("--kubeconfig (or $KUBECONFIG) must name the local cluster's admin kubeconfig: %w", err)
	}
	client, err := kubernetes.NewForConfig(admin)
	if err != nil {
		return fmt.Errorf("create Kubernetes client: %w", err)
	}
	if err := devObjects(ctx, client); err != nil {
		return err
	}
	files, err := devPKI(dir, cfg.ListenAddress)
	if err != nil {
		return err
	}
	clusterCA, err := clusterCAData(admin)
	if err != nil {
		return err
	}
	policyFile := filepath.Join(dir, "policy.yaml")
	if err := writeDevPolicy(policyFile, admin.Host, clusterCA); err != nil {
		return err
	}

	opts := server.Options{
		ListenAddress: cfg.ListenAddress,
		OpsAddress:    cfg.OpsAddress,
		TLSCertFile:   files.serverCert,
		TLSKeyFile:    files.serverKey,
		ClientCAFile:  files.caCert,
		PolicyFile:    policyFile,
		// The local cluster's default namespace always exists; the
		// revocation ConfigMap is looked for there.
		Namespace:     metav1.NamespaceDefault,
		ClientCertTTL: pki.DefaultClientLifetime,
		Kube:          admin,
		KubeQPS:       defaultKubeQPS,
		KubeBurst:     defaultKubeBurst,
		GCInterval:    time.Minute,
		MaxBodyBytes:  server.DefaultMaxBodyBytes,
		Credentials:   []string{apiv1.CredentialToken},
		// Stdout is for the commands printed below; audit events go
		// with the log.
		AuditLog: server.AuditStderr,
		Build:    currentBuild().server(),
		Logger:   log,
	}
	kubectl := cfg.Kubectl
	if kubectl == "" {
		kubectl = findKubectl()
	}
	opts.Started = func(s server.Started) {
		printDevCommands(out, dir, files, s.API.String(), s.Ops.String(), kubectl)
	}
	return server.Run(ctx, opts)
}

type devFiles struct{ caCert, caKey, serverCert, serverKey, clientCert, clientKey string }

// devPKI keeps an existing dev CA (so a browser or script that trusts it
// keeps working) and issues fresh leaf certificates on every start.
func devPKI(dir, listen string) (devFiles, error) {
	f := devFiles{
		caCert: filepath.Join(dir, "ca.crt"), caKey: filepath.Join(dir, "ca.key"),
		serverCert: filepath.Join(dir, "server.crt"), serverKey: filepath.Join(dir, "server.key"),
		clientCert: filepath.Join(dir, devPeer+".crt"), clientKey: filepath.Join(dir, devPeer+".key"),
	}
	ca, err := pki.LoadCA(f.caCert, f.caKey)
	if errors.Is(err, os.ErrNotExist) {
		ca, err = pki.NewCA(pki.CAOptions{CommonName: "tokenbroker dev CA"})
		if err == nil {
			err = ca.WriteFiles(f.caCert, f.caKey)
		}
	}
	if err != nil {
		return f, fmt.Errorf("dev CA: %w", err)
	}
	ips := []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}
	if host, _, err := net.SplitHostPort(listen); err == nil {
		if ip := net.ParseIP(host); ip != nil && !ip.IsUnspecified() && !ip.IsLoopback() {
			ips = append(ips, ip)
		}
	}
	srv, err := ca.IssueServer(pki.ServerOptions{DNSNames: []string{"localhost"}, IPAddresses: ips})
	if err != nil {
		return f, fmt.Errorf("dev server certificate: %w", err)
	}
	if err := srv.WriteFiles(f.serverCert, f.serverKey); err != nil {
		return f, err
	}
	id, err := pki.ClusterIdentity(devTrustDomain, devPeer)
	if err != nil {
		return f, err
	}
	cli, err := ca.IssueClient(pki.ClientOptions{Identity: id})
	if err != nil {
		return f, fmt.Errorf("dev client certificate: %w", err)
	}
	return f, cli.WriteFiles(f.clientCert, f.clientKey)
}

func clusterCAData(rc *rest.Config) ([]byte, error) {
	if len(rc.CAData) > 0 {
		return rc.CAData, nil
	}
	if rc.CAFile != "" {
		return os.ReadFile(rc.CAFile)
	}
	return nil, errors.New("the admin kubeconfig has no certificate-authority; the dev broker needs the cluster's CA")
}

func writeDevPolicy(path, server string, clusterCA []byte) error {
	caFile := filepath.Join(filepath.Dir(path), "cluster-ca.crt")
	if err := os.WriteFile(caFile, clusterCA, 0o644); err != nil {
		return err
	}
	policy := fmt.Sprintf(`# Demo policy written by "tokenbroker dev"; see docs/policy.md.
cluster:
  name: dev
  server: %s
  caFile: cluster-ca.crt
ttl: {default: 1h, max: 24h}
peers:
  - name: %s
    identity: spiffe://%s/cluster/%s
    grants:
      - namespaces: [%s]
        serviceAccounts: [%s]
        maxTTL: 2h
`, server, devPeer, devTrustDomain, devPeer, devNamespace, devSA)
	return os.WriteFile(path, []byte(policy), 0o644)
}

// devObjects creates the demo namespace, ServiceAccount, a read-only
// binding and a ConfigMap; existing objects are left as they are.
func devObjects(ctx context.Context, c kubernetes.Interface) error {
	create := func(what string, err error) error {
		if err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("create %s: %w", what, err)
		}
		return nil
	}
	opts := metav1.CreateOptions{}
	_, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: devNamespace}}, opts)
	if err := create("namespace", err); err != nil {
		return err
	}
	_, err = c.CoreV1().ServiceAccounts(devNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: devSA}}, opts)
	if err := create("ServiceAccount", err); err != nil {
		return err
	}
	// An explicit Role rather than the aggregated "view" ClusterRole, whose
	// rules only exist where the controller manager aggregates them.
	_, err = c.RbacV1().Roles(devNamespace).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: devSA + "-view"},
		Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{""},
			Resources: []string{"configmaps", "pods", "services"},
			Verbs:     []string{"get", "list", "watch"},
		}},
	}, opts)
	if err := create("Role", err); err != nil {
		return err
	}
	_, err = c.RbacV1().RoleBindings(devNamespace).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: devSA + "-view"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: devSA + "-view"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: devSA, Namespace: devNamespace}},
	}, opts)
	if err := create("RoleBinding", err); err != nil {
		return err
	}
	_, err = c.CoreV1().ConfigMaps(devNamespace).Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "hello"},
		Data:       map[string]string{"greeting": "hello from the target cluster"},
	}, opts)
	return create("ConfigMap", err)
}

func findKubectl() string {
	if p, err := exec.LookPath("kubectl"); err == nil {
		return p
	}
	if exe, err := os.Executable(); err == nil {
		if p := filepath.Join(filepath.Dir(exe), "kubectl"); fileExists(p) {
			return p
		}
	}
	return "kubectl"
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func printDevCommands(out io.Writer, dir string, f devFiles, api, ops, kubectl string) {
	kc := filepath.Join(dir, "kubeconfig")
	body := fmt.Sprintf(`{"namespace":"%s","serviceAccount":"%s","ttl":"1h"}`, devNamespace, devSA)
	var b strings.Builder
	fmt.Fprintf(&b, "\ntokenbroker dev is ready: the broker listens on https://%s (ops on http://%s).\n\n", api, ops)
	fmt.Fprintf(&b, "Ask it for a kubeconfig (as the peer %q):\n\n", devPeer)
	fmt.Fprintf(&b, "  curl -sS --fail-with-body --cert %s --key %s --cacert %s -H 'Content-Type: application/json' -H 'Accept: application/yaml' -d '%s' https://%s/v1/kubeconfigs -o %s\n\n",
		f.clientCert, f.clientKey, f.caCert, body, api, kc)
	fmt.Fprintf(&b, "Use it:\n\n  %s --kubeconfig %s get configmaps\n\n", kubectl, kc)
	fmt.Fprintf(&b, "See who you are to the broker:\n\n  curl -sS --cert %s --key %s --cacert %s https://%s/v1/whoami\n\n", f.clientCert, f.clientKey, f.caCert, api)
	b.WriteString("Ctrl-C stops the broker and the local cluster.\n")
	_, _ = io.WriteString(out, b.String())
}
