package main

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"github.com/spf13/viper"
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/validation"
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
	EnrollAddress string
	OpsAddress    string
	TLSCertFile   string
	TLSKeyFile    string
	ClientCAFile  string
	CACertFile    string
	CAKeyFile     string
	ClientCertTTL time.Duration
	PolicyFile    string
	Namespace     string
	Kubeconfig    string
	KubeQPS       float32
	KubeBurst     int
	GCInterval    time.Duration
	MaxBodyBytes  int64
	Pprof         bool
	Credentials   []string
	AuditLog      string
	Log           logConfig
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
		RunE: func(cmd *cobra.Command, _ []string) error {
			v, err := newViper(cmd)
			if err != nil {
				return err
			}
			cfg, err := serveConfigFrom(v)
			if err != nil {
				return err
			}
			return withLogger(cfg.Log, func(log *zap.Logger) error {
				return runServe(cmd.Context(), cfg, log, nil)
			})
		},
	}
	addServeFlags(cmd)
	addLogFlags(cmd.Flags(), "json")
	cmd.Flags().String("config", "", "YAML config file whose keys are these flag names")
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

func addServeFlags(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.String("listen-address", ":8443", "address of the mutual-TLS API listener")
	fs.String("enroll-address", "", "address of the enrollment listener (join tokens, no client certificate); empty disables it; needs --ca-cert-file")
	fs.String("ops-address", ":9090", "address of the operations listener (/healthz, /readyz, /metrics)")
	fs.String("tls-cert-file", "", "server certificate (PEM); reloaded when it changes")
	fs.String("tls-key-file", "", "server private key (PEM); reloaded when it changes")
	fs.String("client-ca-file", "", "CA bundle that verifies peer client certificates, served as the trust bundle; reloaded when it changes")
	fs.String("ca-cert-file", "", "certificate (chain) of the CA that signs enrolled and renewed client certificates and join tokens; empty disables both")
	fs.String("ca-key-file", "", "private key of that CA (PEM)")
	fs.Duration("client-cert-ttl", pki.DefaultClientLifetime, "lifetime of issued client certificates unless the policy sets peers[].certificateTTL")
	fs.String("policy-file", "", "policy file (YAML): the cluster, TTL limits, peers and grants; reloaded when it changes")
	fs.String("namespace", "", "the broker's own namespace (used join tokens, revocation ConfigMap); default $POD_NAMESPACE, else "+defaultNamespace)
	fs.String("kubeconfig", "", "kubeconfig of the broker's own identity; empty means in-cluster")
	fs.Float32("kube-qps", defaultKubeQPS, "client-side rate limit for the broker's Kubernetes client (requests per second)")
	fs.Int("kube-burst", defaultKubeBurst, "client-side burst for the broker's Kubernetes client")
	fs.Duration("gc-interval", time.Minute, "how often expired lease Secrets are deleted")
	fs.Int64("max-body-bytes", server.DefaultMaxBodyBytes, "largest request body accepted")
	fs.Bool("pprof", false, "serve net/http/pprof under /debug/pprof/ on the operations listener")
	fs.StringSlice("credentials", []string{apiv1.CredentialToken}, "credential kinds this broker issues (token)")
	fs.String("audit-log", auditStdout, `where audit events go, one JSON line per decision: "stdout", "stderr" (with the operational log) or a file path (appended to, created 0600, reopened on SIGHUP for logrotate); cannot be turned off`)
}

// The --audit-log values that are not file paths.
const (
	auditStdout = "stdout"
	auditStderr = "stderr"
)

func serveConfigFrom(v *viper.Viper) (serveConfig, error) {
	cfg := serveConfig{
		ListenAddress: v.GetString("listen-address"),
		EnrollAddress: v.GetString("enroll-address"),
		OpsAddress:    v.GetString("ops-address"),
		TLSCertFile:   v.GetString("tls-cert-file"),
		TLSKeyFile:    v.GetString("tls-key-file"),
		ClientCAFile:  v.GetString("client-ca-file"),
		CACertFile:    v.GetString("ca-cert-file"),
		CAKeyFile:     v.GetString("ca-key-file"),
		ClientCertTTL: v.GetDuration("client-cert-ttl"),
		PolicyFile:    v.GetString("policy-file"),
		Namespace:     namespaceOrDefault(v.GetString("namespace")),
		Kubeconfig:    v.GetString("kubeconfig"),
		KubeQPS:       float32(v.GetFloat64("kube-qps")),
		KubeBurst:     v.GetInt("kube-burst"),
		GCInterval:    v.GetDuration("gc-interval"),
		MaxBodyBytes:  v.GetInt64("max-body-bytes"),
		Pprof:         v.GetBool("pprof"),
		Credentials:   v.GetStringSlice("credentials"),
		AuditLog:      v.GetString("audit-log"),
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
	for _, kind := range cfg.Credentials {
		if kind != apiv1.CredentialToken {
			errs = append(errs, fmt.Errorf("--credentials: unknown or unsupported credential kind %q (this broker issues: %s)", kind, apiv1.CredentialToken))
		}
	}
	if cfg.AuditLog == "" {
		errs = append(errs, errors.New(`--audit-log must be "stdout", "stderr" or a file path`))
	}
	if cfg.MaxBodyBytes <= 0 {
		errs = append(errs, errors.New("--max-body-bytes must be positive"))
	}
	if (cfg.CACertFile == "") != (cfg.CAKeyFile == "") {
		errs = append(errs, errors.New("--ca-cert-file and --ca-key-file go together"))
	}
	if cfg.EnrollAddress != "" && cfg.CACertFile == "" {
		errs = append(errs, errors.New("--enroll-address needs --ca-cert-file and --ca-key-file: enrollment issues certificates"))
	}
	if cfg.ClientCertTTL < broker.MinCertificateTTL || cfg.ClientCertTTL > broker.MaxCertificateTTL {
		errs = append(errs, fmt.Errorf("--client-cert-ttl must be between %s and %s", broker.MinCertificateTTL, broker.MaxCertificateTTL))
	}
	if msgs := validation.IsDNS1123Label(cfg.Namespace); len(msgs) > 0 {
		errs = append(errs, fmt.Errorf("--namespace %q: %s", cfg.Namespace, strings.Join(msgs, "; ")))
	}
	return cfg, errors.Join(errs...)
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
	// Protobuf for the built-in types the broker calls (Secrets,
	// TokenRequest) costs the broker and the API server less CPU than JSON.
	rc.ContentType = "application/vnd.kubernetes.protobuf"
	rc.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	rc.UserAgent = "tokenbroker/" + version
	return rc, nil
}

// runServe is the composition root of the broker. ready, if not nil, is
// called once all listeners accept connections.
func runServe(ctx context.Context, cfg serveConfig, log *zap.Logger, ready func(api, ops string)) error {
	policy, err := broker.LoadPolicyFile(cfg.PolicyFile)
	if err != nil {
		return err
	}
	rc, err := kubeRESTConfig(cfg.Kubeconfig, cfg.KubeQPS, cfg.KubeBurst)
	if err != nil {
		return err
	}
	// API server warnings (such as a shortened token) go to our log in
	// its format, not to stderr through klog.
	rc.WarningHandler = zapWarnings{log.Named("kubernetes")}
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
	build := currentBuild()
	metrics.SetBuildInfo(build.Version, build.revisionLabel(), build.GoVersion)
	auditor, closeAudit, err := openAuditLog(cfg.AuditLog, log)
	if err != nil {
		return err
	}
	defer closeAudit()

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

	certs, err := pki.NewCertReloader(cfg.TLSCertFile, cfg.TLSKeyFile,
		pki.WithReloadCallback(reloadReporter(log, metrics, broker.ConfigServerCertificate, cfg.TLSCertFile)))
	if err != nil {
		return fmt.Errorf("load server certificate: %w", err)
	}
	clientCAs, err := pki.NewPoolReloader(cfg.ClientCAFile,
		pki.WithReloadCallback(reloadReporter(log, metrics, broker.ConfigClientCA, cfg.ClientCAFile)))
	if err != nil {
		return fmt.Errorf("load client CA bundle: %w", err)
	}
	metrics.WatchCertificateExpiry(broker.CertificateServer, func() time.Time { return certs.Leaf().NotAfter })
	metrics.WatchCertificateExpiry(broker.CertificateClientCA, func() time.Time { return earliestNotAfter(clientCAs.Certificates()) })
	// A nil *pki.CA must not become a non-nil interface.
	var ca broker.CertificateAuthority
	if cfg.CACertFile != "" {
		c, err := pki.LoadCA(cfg.CACertFile, cfg.CAKeyFile)
		if err != nil {
			return fmt.Errorf("load signing CA: %w", err)
		}
		ca = c
		metrics.WatchCertificateExpiry(broker.CertificateCA, func() time.Time { return c.Certificate().NotAfter })
		log.Info("issuing client certificates",
			zap.String("ca", pki.Fingerprint(c.Certificate())),
			zap.Duration("default_ttl", cfg.ClientCertTTL))
	}

	store := broker.NewPolicyStore(policy)
	revocations := broker.NewRevocationList(client.CoreV1(), cfg.Namespace, log.Named("revocations"), metrics)
	b, err := broker.New(broker.Config{
		Secrets:        client.CoreV1(),
		Issuers:        iss,
		Policy:         store,
		Logger:         log.Named("broker"),
		Metrics:        metrics,
		APIServerReady: broker.APIServerReadyz(client.Discovery().RESTClient()),
		Namespace:      cfg.Namespace,
		CA:             ca,
		Trust:          clientCAs,
		CertificateTTL: cfg.ClientCertTTL,
		Revocations:    revocations,
		Auditor:        auditor,
	})
	if err != nil {
		return err
	}

	scfg := server.Config{
		Addr:         cfg.ListenAddress,
		OpsAddr:      cfg.OpsAddress,
		TLSConfig:    pki.ServerTLSConfigReloading(certs, clientCAs),
		ClientCAs:    clientCAs,
		MaxBodyBytes: cfg.MaxBodyBytes,
		Pprof:        cfg.Pprof,
		Logger:       log.Named("http"),
		Registerer:   reg,
		Gatherer:     reg,
		Broker:       b,
	}
	if cfg.EnrollAddress != "" {
		scfg.EnrollAddr = cfg.EnrollAddress
		scfg.EnrollTLSConfig = pki.EnrollmentTLSConfig(certs)
	}
	srv, err := server.New(scfg)
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go revocations.Run(ctx)
	go broker.NewPolicyWatcher(cfg.PolicyFile, store, log.Named("policy"), metrics, 0).Run(ctx)
	go b.RunGC(ctx, cfg.GCInterval)
	// Until the deny list is read every caller is refused (fail closed);
	// wait for it a little so that a healthy start serves at once.
	syncCtx, cancelSync := context.WithTimeout(ctx, revocationSyncWait)
	if err := revocations.WaitForSync(syncCtx); err != nil && ctx.Err() == nil {
		log.Warn("revocation list not read yet; every caller is refused until it is",
			zap.String("namespace", cfg.Namespace), zap.Error(err))
	}
	cancelSync()
	go func() {
		select {
		case <-srv.Listening():
			fields := []zap.Field{
				zap.String("api", srv.Addr().String()),
				zap.String("ops", srv.OpsAddr().String()),
				zap.String("cluster", policy.Cluster.Name),
				zap.Int("peers", len(policy.Peers)),
				zap.String("namespace", cfg.Namespace),
			}
			if a := srv.EnrollAddr(); a != nil {
				fields = append(fields, zap.String("enroll", a.String()))
			}
			log.Info("broker listening", fields...)
			if ready != nil {
				ready(srv.Addr().String(), srv.OpsAddr().String())
			}
		case <-ctx.Done():
		}
	}()
	return srv.Run(ctx)
}

// openAuditLog opens the audit sink named by --audit-log; the returned
// function closes a file sink. A file sink is reopened on SIGHUP until it
// is closed, so that logrotate's rename-and-signal rotation loses no event.
func openAuditLog(dest string, log *zap.Logger) (broker.Auditor, func(), error) {
	switch dest {
	case auditStdout:
		return broker.NewAuditLog(os.Stdout), func() {}, nil
	case auditStderr:
		return broker.NewAuditLog(os.Stderr), func() {}, nil
	}
	f, err := openAuditFile(dest)
	if err != nil {
		return nil, nil, err
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-hup:
				if err := f.reopen(); err != nil {
					log.Error("audit log not reopened; still writing to the old file", zap.String("file", dest), zap.Error(err))
					continue
				}
				log.Info("audit log reopened", zap.String("file", dest))
			}
		}
	}()
	return broker.NewAuditLog(f), func() {
		signal.Stop(hup)
		close(stop)
		<-done
		_ = f.close()
	}, nil
}

// auditFile is an audit log file that can be reopened under the same
// name. Each event is one Write with O_APPEND, so a line is never split
// between the old file and the new one.
type auditFile struct {
	path string
	mu   sync.Mutex
	f    *os.File
}

func openAuditFile(path string) (*auditFile, error) {
	a := &auditFile{path: path}
	if err := a.reopen(); err != nil {
		return nil, err
	}
	return a, nil
}

func (a *auditFile) Write(p []byte) (int, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.f.Write(p)
}

// reopen opens the path again (created 0600 if it was moved away) and
// closes the old file; on failure the old file stays in use.
func (a *auditFile) reopen() error {
	f, err := os.OpenFile(a.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("--audit-log: %w", err)
	}
	a.mu.Lock()
	old := a.f
	a.f = f
	a.mu.Unlock()
	if old != nil {
		_ = old.Close()
	}
	return nil
}

func (a *auditFile) close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.f.Close()
}

// earliestNotAfter is the NotAfter of the certificate that expires first,
// or the zero time for none.
func earliestNotAfter(certs []*x509.Certificate) time.Time {
	var t time.Time
	for _, c := range certs {
		if t.IsZero() || c.NotAfter.Before(t) {
			t = c.NotAfter
		}
	}
	return t
}

// revocationSyncWait bounds how long serve waits for the first read of the
// revocation list before it starts listening anyway.
const revocationSyncWait = 10 * time.Second

// reloadReporter logs and counts the reloads of one configuration file.
func reloadReporter(log *zap.Logger, m *broker.Metrics, config, file string) func(error) {
	return func(err error) {
		m.ObserveReload(config, err)
		if err != nil {
			log.Error("reload refused; keeping the previous one", zap.String("config", config), zap.String("file", file), zap.Error(err))
			return
		}
		log.Info("reloaded", zap.String("config", config), zap.String("file", file))
	}
}

// zapWarnings logs the API server's warning headers.
type zapWarnings struct{ log *zap.Logger }

// HandleWarningHeader implements rest.WarningHandler.
func (w zapWarnings) HandleWarningHeader(code int, agent, text string) {
	if code != 299 || text == "" {
		return
	}
	w.log.Info("API server warning", zap.String("warning", text))
}
