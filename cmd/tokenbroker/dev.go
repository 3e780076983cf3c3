package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/viper"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

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

func newDevCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run a broker against a local cluster with a dev PKI and a demo policy",
		Long: `Set up everything a demo needs and run the broker in the foreground:

  - a dev PKI in --dir (CA, server certificate for 127.0.0.1/localhost, and a
    client certificate for the peer spiffe://` + server.DevTrustDomain + `/cluster/` + server.DevPeer + `),
  - the namespace "` + server.DevNamespace + `" with the ServiceAccount "` + server.DevServiceAccount + `", allowed to read
    ConfigMaps, Pods and Services there, and a ConfigMap to look at,
  - a policy that lets the peer "` + server.DevPeer + `" obtain kubeconfigs for it,

then print a curl command and a kubectl command that work as printed.
"make dev" starts a local cluster and runs this command against it.
Ctrl-C stops the broker.`,
		Example: `  # what "make dev" runs, once bin/localcluster has started a cluster
  tokenbroker dev --dir .dev --kubeconfig .dev/admin.kubeconfig

  # on other ports
  tokenbroker dev --kubeconfig admin.kubeconfig --listen-address 127.0.0.1:18443 --ops-address 127.0.0.1:19090`,
		Args: cobra.NoArgs,
		RunE: runE(newViper, devConfigFrom, func(cmd *cobra.Command, cfg devConfig) error {
			return withLogger(cfg.Log, func(log *zap.Logger) error { return runDev(cmd.Context(), cfg, log, cmd.OutOrStdout()) })
		}),
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

func devConfigFrom(v *viper.Viper) (devConfig, error) {
	return devConfig{
		Kubeconfig:    v.GetString("kubeconfig"),
		Dir:           v.GetString("dir"),
		ListenAddress: v.GetString("listen-address"),
		OpsAddress:    v.GetString("ops-address"),
		Kubectl:       v.GetString("kubectl"),
		Log:           logConfigFrom(v),
	}, nil
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
	files, policyFile, err := server.PrepareDev(ctx, client, admin, dir, cfg.ListenAddress)
	if err != nil {
		return err
	}

	opts := server.Options{
		ListenAddress: cfg.ListenAddress,
		OpsAddress:    cfg.OpsAddress,
		TLSCertFile:   files.ServerCert,
		TLSKeyFile:    files.ServerKey,
		ClientCAFile:  files.CACert,
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
		Credentials:   []string{apiv1.CredentialToken, apiv1.CredentialClientCertificate},
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

func printDevCommands(out io.Writer, dir string, f server.DevFiles, api, ops, kubectl string) {
	kc := filepath.Join(dir, "kubeconfig")
	body := fmt.Sprintf(`{"namespace":"%s","serviceAccount":"%s","ttl":"1h"}`, server.DevNamespace, server.DevServiceAccount)
	var b strings.Builder
	fmt.Fprintf(&b, "\ntokenbroker dev is ready: the broker listens on https://%s (ops on http://%s).\n\n", api, ops)
	fmt.Fprintf(&b, "Ask it for a kubeconfig (as the peer %q):\n\n", server.DevPeer)
	fmt.Fprintf(&b, "  curl -sS --fail-with-body --cert %s --key %s --cacert %s -H 'Content-Type: application/json' -H 'Accept: application/yaml' -d '%s' https://%s/v1/kubeconfigs -o %s\n\n",
		f.ClientCert, f.ClientKey, f.CACert, body, api, kc)
	fmt.Fprintf(&b, "Use it:\n\n  %s --kubeconfig %s get configmaps\n\n", kubectl, kc)
	certKC := filepath.Join(dir, "cert.kubeconfig")
	certBody := fmt.Sprintf(`{"namespace":"%s","credential":"clientCertificate","ttl":"1h"}`, server.DevNamespace)
	fmt.Fprintf(&b, "Or a client certificate for a per-lease user with the Role %s, revoked with its lease (needs a cluster that signs: make dev runs kube-controller-manager):\n\n", server.DevRole)
	fmt.Fprintf(&b, "  curl -sS --fail-with-body --cert %s --key %s --cacert %s -H 'Content-Type: application/json' -H 'Accept: application/yaml' -d '%s' https://%s/v1/kubeconfigs -o %s\n\n",
		f.ClientCert, f.ClientKey, f.CACert, certBody, api, certKC)
	fmt.Fprintf(&b, "  %s --kubeconfig %s auth whoami\n\n", kubectl, certKC)
	fmt.Fprintf(&b, "See who you are to the broker:\n\n  curl -sS --cert %s --key %s --cacert %s https://%s/v1/whoami\n\n", f.ClientCert, f.ClientKey, f.CACert, api)
	b.WriteString("Ctrl-C stops the broker and the local cluster.\n")
	_, _ = io.WriteString(out, b.String())
}
