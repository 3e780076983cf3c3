package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"github.com/spf13/viper"
	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/issuers/tokenrequest"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
)

// serveConfig is the typed configuration of "tokenbroker serve".
type serveConfig struct {
	ListenAddress string
	OpsAddress    string
	TLSCertFile   string
	TLSKeyFile    string
	ClientCAFile  string
	PolicyFile    string
	Kubeconfig    string
	KubeQPS       float32
	KubeBurst     int
	GCInterval    time.Duration
	MaxBodyBytes  int64
	Credentials   []string
	Log           logConfig
}

func newServeCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run the broker: the mTLS API and the operations listener",
		Long: `Run the broker in the target cluster.

Peers call the API on --listen-address over mutual TLS (TLS 1.3, client
certificate required, identity from its spiffe:// URI SAN). /healthz, /readyz
and /metrics are served on --ops-address without TLS, for probes and scraping.

Every flag can also be set as an environment variable TOKENBROKER_<FLAG>
(upper case, dashes as underscores) or as a key in the --config YAML file.`,
		Example: `  tokenbroker serve --tls-cert-file tls.crt --tls-key-file tls.key \
    --client-ca-file ca.crt --policy-file policy.yaml`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			v, err := newViper(cmd)
			if err != nil {
				return err
			}
			cfg, err := serveConfigFrom(v)
			if err != nil {
				return err
			}
			log, err := newLogger(cfg.Log)
			if err != nil {
				return err
			}
			defer func() { _ = log.Sync() }()
			return runServe(cmd.Context(), cfg, log, nil)
		},
	}
	addServeFlags(cmd)
	addLogFlags(cmd.Flags(), "json")
	cmd.Flags().String("config", "", "YAML config file whose keys are these flag names")
	return cmd
}

func addServeFlags(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.String("listen-address", ":8443", "address of the mutual-TLS API listener")
	fs.String("ops-address", ":9090", "address of the operations listener (/healthz, /readyz, /metrics)")
	fs.String("tls-cert-file", "", "server certificate (PEM); reloaded when it changes")
	fs.String("tls-key-file", "", "server private key (PEM); reloaded when it changes")
	fs.String("client-ca-file", "", "CA bundle that verifies peer client certificates")
	fs.String("policy-file", "", "policy file (YAML): the cluster, TTL limits, peers and grants")
	fs.String("kubeconfig", "", "kubeconfig of the broker's own identity; empty means in-cluster")
	fs.Float32("kube-qps", 200, "client-side rate limit for the broker's Kubernetes client (requests per second)")
	fs.Int("kube-burst", 400, "client-side burst for the broker's Kubernetes client")
	fs.Duration("gc-interval", time.Minute, "how often expired lease Secrets are deleted")
	fs.Int64("max-body-bytes", server.DefaultMaxBodyBytes, "largest request body accepted")
	fs.StringSlice("credentials", []string{apiv1.CredentialToken}, "credential kinds this broker issues (token)")
}

func serveConfigFrom(v *viper.Viper) (serveConfig, error) {
	cfg := serveConfig{
		ListenAddress: v.GetString("listen-address"),
		OpsAddress:    v.GetString("ops-address"),
		TLSCertFile:   v.GetString("tls-cert-file"),
		TLSKeyFile:    v.GetString("tls-key-file"),
		ClientCAFile:  v.GetString("client-ca-file"),
		PolicyFile:    v.GetString("policy-file"),
		Kubeconfig:    v.GetString("kubeconfig"),
		KubeQPS:       float32(v.GetFloat64("kube-qps")),
		KubeBurst:     v.GetInt("kube-burst"),
		GCInterval:    v.GetDuration("gc-interval"),
		MaxBodyBytes:  v.GetInt64("max-body-bytes"),
		Credentials:   v.GetStringSlice("credentials"),
		Log:           logConfigFrom(v),
	}
	var errs []error
	for flag, val := range map[string]string{
		"tls-cert-file": cfg.TLSCertFile, "tls-key-file": cfg.TLSKeyFile,
		"client-ca-file": cfg.ClientCAFile, "policy-file": cfg.PolicyFile,
	} {
		if val == "" {
			errs = append(errs, fmt.Errorf("--%s is required", flag))
		}
	}
	if cfg.KubeQPS <= 0 || cfg.KubeBurst <= 0 {
		errs = append(errs, errors.New("--kube-qps and --kube-burst must be positive"))
	}
	if cfg.GCInterval < time.Second {
		errs = append(errs, errors.New("--gc-interval must be at least 1s"))
	}
	if cfg.MaxBodyBytes <= 0 {
		errs = append(errs, errors.New("--max-body-bytes must be positive"))
	}
	return cfg, errors.Join(errs...)
}

// kubeRESTConfig loads the broker's own Kubernetes credentials and lifts
// client-go's default client-side limit (5 QPS, burst 10), which would
// otherwise throttle a broker to a handful of issuances a second.
func kubeRESTConfig(kubeconfig string, qps float32, burst int) (*rest.Config, error) {
	var rc *rest.Config
	var err error
	if kubeconfig == "" {
		rc, err = rest.InClusterConfig()
	} else {
		rc, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if err != nil {
		return nil, fmt.Errorf("load Kubernetes client config: %w", err)
	}
	rc.QPS, rc.Burst = qps, burst
	rc.UserAgent = "tokenbroker/" + version
	return rc, nil
}

// runServe is the composition root of the broker. ready, if not nil, is
// called once both listeners accept connections.
func runServe(ctx context.Context, cfg serveConfig, log *zap.Logger, ready func(api, ops string)) error {
	policy, err := broker.LoadPolicyFile(cfg.PolicyFile)
	if err != nil {
		return err
	}
	rc, err := kubeRESTConfig(cfg.Kubeconfig, cfg.KubeQPS, cfg.KubeBurst)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return fmt.Errorf("create Kubernetes client: %w", err)
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics, err := broker.NewMetrics(reg)
	if err != nil {
		return fmt.Errorf("register metrics: %w", err)
	}

	// Issuers are chosen explicitly; an unknown kind fails closed.
	iss := map[string]broker.Issuer{}
	for _, kind := range cfg.Credentials {
		switch kind {
		case apiv1.CredentialToken:
			iss[kind] = tokenrequest.New(client.CoreV1())
		default:
			return fmt.Errorf("--credentials: unknown or unsupported credential kind %q", kind)
		}
	}

	b, err := broker.New(broker.Config{
		Secrets:        client.CoreV1(),
		Issuers:        iss,
		Policy:         broker.NewPolicyStore(policy),
		Logger:         log.Named("broker"),
		Metrics:        metrics,
		APIServerReady: broker.APIServerReadyz(client.Discovery().RESTClient()),
	})
	if err != nil {
		return err
	}

	certs, err := pki.NewCertReloader(cfg.TLSCertFile, cfg.TLSKeyFile, pki.WithReloadCallback(func(err error) {
		if err != nil {
			log.Error("server certificate reload failed; keeping the previous one", zap.Error(err))
		} else {
			log.Info("server certificate reloaded")
		}
	}))
	if err != nil {
		return fmt.Errorf("load server certificate: %w", err)
	}
	clientCAs, err := pki.LoadCertPool(cfg.ClientCAFile)
	if err != nil {
		return fmt.Errorf("load client CA bundle: %w", err)
	}

	srv, err := server.New(server.Config{
		Addr:         cfg.ListenAddress,
		OpsAddr:      cfg.OpsAddress,
		TLSConfig:    pki.ServerTLSConfig(certs, clientCAs),
		MaxBodyBytes: cfg.MaxBodyBytes,
		Logger:       log.Named("http"),
		Registerer:   reg,
		Gatherer:     reg,
		Broker:       b,
	})
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go b.RunGC(ctx, cfg.GCInterval)
	go func() {
		select {
		case <-srv.Listening():
			log.Info("broker listening",
				zap.String("api", srv.Addr().String()),
				zap.String("ops", srv.OpsAddr().String()),
				zap.String("cluster", policy.Cluster.Name),
				zap.Int("peers", len(policy.Peers)))
			if ready != nil {
				ready(srv.Addr().String(), srv.OpsAddr().String())
			}
		case <-ctx.Done():
		}
	}()
	return srv.Run(ctx)
}
