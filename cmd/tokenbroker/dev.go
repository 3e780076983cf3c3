package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
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
	// GatewayAddress is the lease gateway's listener; empty runs none.
	GatewayAddress string
	Kubectl        string
	Log            logConfig
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
  - a policy that lets the peer "` + server.DevPeer + `" obtain kubeconfigs for it, directly
    and through the lease gateway (on --gateway-address, with certificates
    from the dev CA),

then print curl and kubectl commands that work as printed: a kubeconfig
and its use, a gateway kubeconfig, a watch through the gateway and the
revocation that ends it.
"make dev" starts a local cluster and runs this command against it.
Ctrl-C stops the broker.`,
		Example: `  # what "make dev" runs, once bin/localcluster has started a cluster
  tokenbroker dev --dir .dev --kubeconfig .dev/admin.kubeconfig

  # on other ports
  tokenbroker dev --kubeconfig admin.kubeconfig --listen-address 127.0.0.1:18443 --ops-address 127.0.0.1:19090 --gateway-address 127.0.0.1:18445`,
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
	fs.String("gateway-address", "127.0.0.1:8445", "address of the lease gateway's listener (a port other than 0; gateway kubeconfigs name https://<this address>); empty runs no gateway")
	fs.String("kubectl", "", "kubectl to show in the printed command (default: kubectl on PATH, else bin/kubectl)")
	addLogFlags(fs, "console")
	cmd.Flags().String("config", "", "YAML config file whose keys are these flag names")
	return cmd
}

func devConfigFrom(v *viper.Viper) (devConfig, error) {
	return devConfig{
		Kubeconfig:     v.GetString("kubeconfig"),
		Dir:            v.GetString("dir"),
		ListenAddress:  v.GetString("listen-address"),
		OpsAddress:     v.GetString("ops-address"),
		GatewayAddress: v.GetString("gateway-address"),
		Kubectl:        v.GetString("kubectl"),
		Log:            logConfigFrom(v),
	}, nil
}

// devGatewayURL is the URL gateway kubeconfigs name for a gateway
// listening on addr: addr itself, with an unspecified host (":8445",
// "0.0.0.0:8445") reached on loopback. The port must be fixed, since
// the URL is in the broker's options before the listener exists.
func devGatewayURL(addr string) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("--gateway-address: %w", err)
	}
	if n, err := strconv.Atoi(port); err != nil || n <= 0 || n > 65535 {
		return "", fmt.Errorf("--gateway-address %q: needs a port from 1 to 65535: gateway kubeconfigs name it", addr)
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return "https://" + net.JoinHostPort(host, port), nil
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
	var gatewayURL string
	if cfg.GatewayAddress != "" {
		if gatewayURL, err = devGatewayURL(cfg.GatewayAddress); err != nil {
			return err
		}
	}
	files, policyFile, err := server.SetUpDev(ctx, client, admin, server.DevOptions{
		Dir: dir, Listen: []string{cfg.ListenAddress, cfg.GatewayAddress}, Gateway: gatewayURL != "",
	})
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
		// The dev CA signs lease certificates for the gateway (and
		// renews the dev peer's certificate).
		CACertFile:     files.CACert,
		CAKeyFile:      files.CAKey,
		GatewayAddress: cfg.GatewayAddress,
		GatewayURL:     gatewayURL,
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
		printDevCommands(out, devBanner{dir: dir, files: files, api: s.API.String(), ops: s.Ops.String(), gateway: gatewayURL, kubectl: kubectl})
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

// devBanner is what printDevCommands prints commands for: the dev
// directory and PKI, the listeners (gateway is the gateway's URL, empty
// without one) and the kubectl to run.
type devBanner struct {
	dir                        string
	files                      server.DevFiles
	api, ops, gateway, kubectl string
}

// printDevCommands prints the ready banner: every indented line is a
// command that works when pasted as printed (test/e2e/dev_test.go runs
// them through a shell).
func printDevCommands(out io.Writer, d devBanner) {
	f, api, kubectl := d.files, d.api, d.kubectl
	peerTLS := fmt.Sprintf("--cert %s --key %s --cacert %s", f.ClientCert, f.ClientKey, f.CACert)
	// getKubeconfig is the curl that asks for a kubeconfig with body and
	// saves it to file (a problem+json there, and curl failing, on an
	// error), plus extra curl arguments.
	getKubeconfig := func(body, file, extra string) string {
		return fmt.Sprintf("curl -sS --fail-with-body %s -H 'Content-Type: application/json' -H 'Accept: application/yaml' -d '%s' https://%s/v1/kubeconfigs -o %s%s",
			peerTLS, body, api, file, extra)
	}
	kc := filepath.Join(d.dir, "kubeconfig")
	body := fmt.Sprintf(`{"namespace":"%s","serviceAccount":"%s","ttl":"1h"}`, server.DevNamespace, server.DevServiceAccount)
	var b strings.Builder
	fmt.Fprintf(&b, "\ntokenbroker dev is ready: the broker listens on https://%s (ops on http://%s", api, d.ops)
	if d.gateway != "" {
		fmt.Fprintf(&b, ", its lease gateway on %s", d.gateway)
	}
	b.WriteString(").\n\n")
	fmt.Fprintf(&b, "Ask it for a kubeconfig (as the peer %q):\n\n", server.DevPeer)
	fmt.Fprintf(&b, "  %s\n\n", getKubeconfig(body, kc, ""))
	fmt.Fprintf(&b, "Use it:\n\n  %s --kubeconfig %s get configmaps\n\n", kubectl, kc)
	if d.gateway != "" {
		gwKC := filepath.Join(d.dir, "gateway.kubeconfig")
		headers := filepath.Join(d.dir, "gateway.headers")
		gwBody := fmt.Sprintf(`{"namespace":"%s","serviceAccount":"%s","access":"gateway","ttl":"1h"}`, server.DevNamespace, server.DevServiceAccount)
		b.WriteString("Or the same ServiceAccount through the lease gateway: a kubeconfig whose client certificate is good only there, for this one lease (its id goes to the X-Lease-Id header, saved beside it):\n\n")
		fmt.Fprintf(&b, "  %s\n\n", getKubeconfig(gwBody, gwKC, " -D "+headers))
		b.WriteString("Watch through it; then, in another terminal, revoke the lease: the watch ends at once.\n\n")
		fmt.Fprintf(&b, "  %s --kubeconfig %s get configmaps -w\n\n", kubectl, gwKC)
		fmt.Fprintf(&b, "  curl -sS --fail-with-body %s -X DELETE https://%s/v1/leases/$(grep -i '^x-lease-id:' %s | cut -d' ' -f2 | tr -d '\\r')\n\n", peerTLS, api, headers)
	}
	certKC := filepath.Join(d.dir, "cert.kubeconfig")
	certBody := fmt.Sprintf(`{"namespace":"%s","credential":"clientCertificate","ttl":"1h"}`, server.DevNamespace)
	fmt.Fprintf(&b, "Or a client certificate for a per-lease user with the Role %s, revoked with its lease (needs a cluster that signs: make dev runs kube-controller-manager):\n\n", server.DevRole)
	fmt.Fprintf(&b, "  %s\n\n", getKubeconfig(certBody, certKC, ""))
	fmt.Fprintf(&b, "  %s --kubeconfig %s auth whoami\n\n", kubectl, certKC)
	fmt.Fprintf(&b, "See who you are to the broker:\n\n  curl -sS %s https://%s/v1/whoami\n\n", peerTLS, api)
	b.WriteString("Ctrl-C stops the broker and the local cluster.\n")
	_, _ = io.WriteString(out, b.String())
}
