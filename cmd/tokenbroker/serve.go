package main

import (
	"context"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"
	"go.uber.org/zap"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/limits"
	"github.com/tokenbroker/tokenbroker/issuers/clientcert"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
	"github.com/tokenbroker/tokenbroker/server/gateway"
)

// serveConfig is the typed configuration of "tokenbroker serve": the
// broker's options plus what only the command knows.
type serveConfig struct {
	server.Options
	Kubeconfig string
	Log        logConfig
}

// defaultNamespace is the broker's namespace when neither --namespace nor
// POD_NAMESPACE (the downward API) says otherwise.
const defaultNamespace = "tokenbroker"

func newServeCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the broker: the mTLS API and the operations listener",
		Long: `Run the broker in the target cluster.

Peers call the API on --listen-address over mutual TLS (TLS 1.3, client
certificate required, identity from its spiffe:// URI SAN). /healthz, /readyz
and /metrics are served on --ops-address without TLS, for probes and scraping.

With --ca-cert-file and --ca-key-file the broker also issues client
certificates: renewal on the mTLS listener (POST /v1/certificates with the
current certificate) and, if --enroll-address is set, enrollment of new
clusters with a single-use join token on a second TLS listener that asks for
no client certificate and serves only POST /v1/certificates and
GET /v1/trust-bundle. Used join tokens and the revocation deny list
(ConfigMap tokenbroker-revocations) live in --namespace.

Only the signing CA (and, during a rotation, the CA of --previous-ca-cert-file)
verifies join tokens and renews client certificates; the other CAs of
--client-ca-file authenticate peers, nothing more. Only peers in the policy
renew. A join token must name this broker in its aud (pki join-token
--audience): --broker-name, by default the policy's cluster.name. Tokens that
name no broker, as releases before audiences made them, are refused unless
--accept-unbound-join-tokens.

With --sign-cluster-cas a cluster that asks (clusterCACSR) also gets its own
CA at enrollment and renewal, signed by the signing CA: the intermediate of the
cluster's pod certificates (fleet CA -> cluster CA -> pod certificate). The
signing CA must allow a CA below it (pki init --cluster-cas).

The server certificate and key, the client CA bundle and the policy file are
reloaded when they change; a bad new file is refused and the old one kept.

Every flag can also be set as an environment variable TOKENBROKER_<FLAG>
(upper case, dashes as underscores) or as a key in the --config YAML file.`,
		Example: `  tokenbroker serve --tls-cert-file tls.crt --tls-key-file tls.key \
    --client-ca-file ca.crt --policy-file policy.yaml

  # with enrollment and renewal
  tokenbroker serve --tls-cert-file tls.crt --tls-key-file tls.key \
    --client-ca-file bundle.crt --policy-file policy.yaml \
    --ca-cert-file ca.crt --ca-key-file ca.key --enroll-address :8444`,
		Args: cobra.NoArgs,
		RunE: runE(newViper, serveConfigFrom, func(cmd *cobra.Command, cfg serveConfig) error {
			return withLogger(cfg.Log, func(log *zap.Logger) error { return runServe(cmd.Context(), cfg, log) })
		}),
	}
	cmd.Flags().AddFlagSet(serveFlags())
	return cmd
}

// The broker's client-side limit for its Kubernetes client. Each issuance
// makes two API calls, so this allows about 1000 issuances a second: far
// above what the API server of a small cluster takes (make bench measured
// about 1000 lease+token pairs a second on 2 cores), so that the API
// server's priority and fairness, which sees every client, does the
// throttling, and the client limit only stops a runaway loop. At 200 QPS,
// make bench showed the broker capped at about 110 issuances a second.
const (
	defaultKubeQPS   = 2000
	defaultKubeBurst = 4000
)

// serveFlags are serve's flags, which are also the keys of its config
// file ("config validate --kind serve" checks a file against them).
func serveFlags() *pflag.FlagSet {
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	addLogFlags(fs, "json")
	fs.String("config", "", "YAML config file whose keys are these flag names")
	fs.String("listen-address", ":8443", "address of the mutual-TLS API listener")
	fs.String("enroll-address", "", "address of the enrollment listener (join tokens, no client certificate); empty disables it; needs --ca-cert-file")
	fs.String("gateway-address", "", "address of the lease gateway's listener (lease certificates only), which grants with access: gateway need; empty disables it; needs --ca-cert-file and --gateway-url")
	fs.String("gateway-url", "", "the lease gateway's https URL as clients reach it (https://host:port), the server of every gateway kubeconfig")
	// Charts before the gateway's tokens were bound to the lease Secret
	// pass these: accepted, with a warning, so that such a chart still
	// starts the broker.
	fs.String("gateway-pod-name", "", "")
	fs.String("gateway-pod-uid", "", "")
	_ = fs.MarkDeprecated("gateway-pod-name", "the gateway's upstream tokens are bound to each lease Secret; it does nothing")
	_ = fs.MarkDeprecated("gateway-pod-uid", "the gateway's upstream tokens are bound to each lease Secret; it does nothing")
	fs.Int("gateway-max-conns-per-lease", gateway.DefaultMaxConnsPerLease, "open gateway connections of one lease; one more is closed after its handshake")
	fs.Int("gateway-max-conns-per-peer", gateway.DefaultMaxConnsPerPeer, "open gateway connections of all leases of one peer")
	fs.Int("gateway-max-requests-per-lease", gateway.DefaultMaxRequestsPerLease, "gateway requests under way (watches and streams included) of one lease; one more is answered 429 with Retry-After")
	fs.Int("gateway-max-requests-per-peer", gateway.DefaultMaxRequestsPerPeer, "gateway requests under way of all leases of one peer")
	fs.String("ops-address", ":9090", "address of the operations listener (/healthz, /readyz, /metrics)")
	fs.String("tls-cert-file", "", "server certificate (PEM); reloaded when it changes")
	fs.String("tls-key-file", "", "server private key (PEM); reloaded when it changes")
	fs.String("client-ca-file", "", "CA bundle that verifies peer client certificates, served as the trust bundle; reloaded when it changes")
	fs.String("ca-cert-file", "", "certificate (chain) of the CA that signs enrolled and renewed client certificates and join tokens; empty disables both")
	fs.String("ca-key-file", "", "private key of that CA (PEM)")
	fs.String("previous-ca-cert-file", "", "during a rotation of the signing CA, the certificate of the CA being replaced: its join tokens still verify and the client certificates it issued still renew; unset it to end the overlap (other CAs of --client-ca-file never admit or renew peers)")
	fs.StringSlice("broker-name", nil, "name this broker answers to in a join token's aud (pki join-token --audience), repeatable; default the policy's cluster.name")
	fs.Bool("accept-unbound-join-tokens", false, "also accept join tokens that name no broker (made without pki join-token --audience, as before audiences existed): any broker of the CA takes those, so a token can be replayed at another broker")
	fs.Duration("client-cert-ttl", pki.DefaultClientLifetime, "lifetime of issued client certificates unless the policy sets peers[].certificateTTL")
	fs.Bool("sign-cluster-cas", false, "at enrollment and renewal, also sign the cluster's CA when the request asks (clusterCACSR): an intermediate for the cluster's pod certificates, with the client certificate's identity and lifetime; the signing CA must allow a CA below it (pki init --cluster-cas); off: such requests are refused (422)")
	fs.String("policy-file", "", "policy file (YAML): the cluster, TTL limits, peers and grants; reloaded when it changes")
	fs.String("namespace", "", "the broker's own namespace (used join tokens, revocation ConfigMap); default $POD_NAMESPACE, else "+defaultNamespace)
	fs.String("kubeconfig", "", "kubeconfig of the broker's own identity; default $KUBECONFIG, else ~/.kube/config, else in-cluster")
	fs.Float32("kube-qps", defaultKubeQPS, "client-side rate limit for the broker's Kubernetes client (requests per second)")
	fs.Int("kube-burst", defaultKubeBurst, "client-side burst for the broker's Kubernetes client")
	fs.Duration("gc-interval", time.Minute, "how often expired lease Secrets are deleted")
	fs.Int("max-live-leases", limits.DefaultMaxLiveLeasesTotal, "live leases of all peers together, whatever the policy allows each (every lease is a Secret in etcd)")
	fs.Int("lease-pool", lease.DefaultPoolPerNamespace, "unclaimed lease Secrets kept ready per namespace with recent token or gateway lease issuances, so that a TokenRequest and the lease record run at once, and a gateway lease is answered before any API call; 0 turns the pool off")
	fs.Int("lease-pool-max", lease.DefaultPoolMax, "unclaimed lease Secrets kept ready over all namespaces")
	fs.Int64("max-body-bytes", server.DefaultMaxBodyBytes, "largest request body accepted")
	fs.Int("max-conns-per-ip", server.DefaultMaxConnsPerIP, "open connections of one client address on each TLS listener, handshakes included; one more is closed before its handshake (behind a load balancer that hides client addresses, every peer shares one)")
	fs.Int("max-conns-per-identity", server.DefaultMaxConnsPerIdentity, "open connections of one verified peer identity on the mutual-TLS listener; one more is closed after its handshake")
	fs.Int("max-conns", server.DefaultMaxConns, "open connections of all TLS listeners together, handshakes included; one more is closed before its handshake (sized to a 256Mi memory limit: scale it with the limit)")
	fs.Int("max-handshakes", server.DefaultMaxHandshakes, "connections of all TLS listeners still in their TLS handshake; one more is closed before its handshake (sized to a 256Mi memory limit: scale it with the limit)")
	fs.Int("max-handshakes-per-ip", server.DefaultMaxHandshakesPerIP, "connections of one client address in their TLS handshake on each TLS listener; one more is closed before its handshake")
	fs.Duration("handshake-timeout", server.DefaultHandshakeTimeout, "how long a TLS handshake may take before the connection is closed; shorter than the header timeout ("+server.DefaultReadHeaderTimeout.String()+")")
	fs.Bool("pprof", false, "serve net/http/pprof under /debug/pprof/ on the operations listener")
	fs.Duration("shutdown-delay", 0, "on SIGTERM, keep the listeners open this long (readyz 503, keep-alives off) before in-flight requests drain, so that the Service's endpoints stop sending new connections first (the chart sets 5s); with --reuse-port, until a successor serves on the same ports, at most this long")
	fs.Bool("reuse-port", false, "open the listeners with SO_REUSEPORT and only once ready, so that a new broker on the node's network (hostNetwork) listens beside the one it replaces and takes over without a refused connection; set net.ipv4.tcp_migrate_req=1 on the node so that none queued on the old socket is reset")
	fs.StringSlice("credentials", []string{apiv1.CredentialToken}, "credential kinds this broker issues ("+strings.Join(server.CredentialKinds(), ", ")+"); clientCertificate needs the RBAC of deploy/components/client-certificates")
	fs.Duration("signing-timeout", clientcert.DefaultTimeout, "how long to wait for the cluster's signer to issue a client certificate before answering 503")
	fs.String("publish-cluster-trust-bundle", "", `signer name (e.g. tokenbroker.io/east) under which to publish the CAs that anchor this broker's server certificate (those of --client-ca-file, --ca-cert-file and --previous-ca-cert-file that --tls-cert-file verifies to, plus the signing and previous signing CA; never partner CAs) as a ClusterTrustBundle named <signer with / as :>:trust-bundle, kept up to date as the files change; needs Kubernetes 1.37 or later and RBAC to attest for the signer; empty: off`)
	fs.String("audit-log", server.AuditStdout, `where audit events go, one JSON line per decision: "stdout", "stderr" (with the operational log) or a file path (appended to, created 0600, reopened on SIGHUP for logrotate); cannot be turned off`)
	return fs
}

func serveConfigFrom(v *viper.Viper) (serveConfig, error) {
	cfg := serveConfig{Options: server.Options{
		ListenAddress:              v.GetString("listen-address"),
		EnrollAddress:              v.GetString("enroll-address"),
		GatewayAddress:             v.GetString("gateway-address"),
		GatewayURL:                 v.GetString("gateway-url"),
		GatewayMaxConnsPerLease:    v.GetInt("gateway-max-conns-per-lease"),
		GatewayMaxRequestsPerLease: v.GetInt("gateway-max-requests-per-lease"),
		GatewayMaxRequestsPerPeer:  v.GetInt("gateway-max-requests-per-peer"),
		GatewayMaxConnsPerPeer:     v.GetInt("gateway-max-conns-per-peer"),
		OpsAddress:                 v.GetString("ops-address"),
		TLSCertFile:                v.GetString("tls-cert-file"),
		TLSKeyFile:                 v.GetString("tls-key-file"),
		ClientCAFile:               v.GetString("client-ca-file"),
		CACertFile:                 v.GetString("ca-cert-file"),
		CAKeyFile:                  v.GetString("ca-key-file"),
		PreviousCACertFile:         v.GetString("previous-ca-cert-file"),
		BrokerNames:                v.GetStringSlice("broker-name"),
		AcceptUnboundJoinTokens:    v.GetBool("accept-unbound-join-tokens"),
		ClientCertTTL:              v.GetDuration("client-cert-ttl"),
		SignClusterCAs:             v.GetBool("sign-cluster-cas"),
		PolicyFile:                 v.GetString("policy-file"),
		Namespace:                  namespaceOrDefault(v.GetString("namespace")),
		KubeQPS:                    float32(v.GetFloat64("kube-qps")),
		KubeBurst:                  v.GetInt("kube-burst"),
		GCInterval:                 v.GetDuration("gc-interval"),
		MaxLiveLeases:              v.GetInt("max-live-leases"),
		LeasePool:                  poolSize(v.GetInt("lease-pool")),
		LeasePoolMax:               v.GetInt("lease-pool-max"),
		MaxBodyBytes:               v.GetInt64("max-body-bytes"),
		MaxConnsPerIP:              v.GetInt("max-conns-per-ip"),
		MaxConnsPerIdentity:        v.GetInt("max-conns-per-identity"),
		MaxConns:                   v.GetInt("max-conns"),
		MaxHandshakes:              v.GetInt("max-handshakes"),
		MaxHandshakesPerIP:         v.GetInt("max-handshakes-per-ip"),
		HandshakeTimeout:           v.GetDuration("handshake-timeout"),
		Pprof:                      v.GetBool("pprof"),
		ShutdownDelay:              v.GetDuration("shutdown-delay"),
		ReusePort:                  v.GetBool("reuse-port"),
		Credentials:                v.GetStringSlice("credentials"),
		SigningTimeout:             v.GetDuration("signing-timeout"),
		AuditLog:                   v.GetString("audit-log"),
		PublishClusterTrustBundle:  v.GetString("publish-cluster-trust-bundle"),
	}, Kubeconfig: v.GetString("kubeconfig"), Log: logConfigFrom(v)}
	return cfg, cfg.Validate()
}

// namespaceOrDefault returns ns, else $POD_NAMESPACE, else
// defaultNamespace.
func namespaceOrDefault(ns string) string {
	if ns != "" {
		return ns
	}
	if ns := os.Getenv("POD_NAMESPACE"); ns != "" {
		return ns
	}
	return defaultNamespace
}

// runServe runs the broker as configured; server.Run is its composition
// root.
func runServe(ctx context.Context, cfg serveConfig, log *zap.Logger) error {
	rc, err := restConfig(cfg.Kubeconfig, "")
	if err != nil {
		return err
	}
	opts := cfg.Options
	opts.Kube, opts.Logger = rc, log
	opts.Build = currentBuild().server()
	return server.Run(ctx, opts)
}

// poolSize maps --lease-pool to server.Options.LeasePool, where zero is the
// default and off is negative.
func poolSize(n int) int {
	if n == 0 {
		return -1
	}
	return n
}
