package server

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/tenants"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Options is the configuration of a whole broker process: what
// "tokenbroker serve" reads from its flags, what "tokenbroker dev" fills in
// for a demo, and what the integration tests start. Run is the one place
// that turns it into running parts, so that all three run the same thing.
type Options struct {
	// ListenAddress, EnrollAddress and OpsAddress are the listeners'
	// addresses (":0" picks a free port; Started reports it). An empty
	// EnrollAddress means no enrollment listener.
	ListenAddress string
	EnrollAddress string
	OpsAddress    string
	// TLSCertFile and TLSKeyFile are the server certificate and key,
	// reloaded when they change.
	TLSCertFile string
	TLSKeyFile  string
	// ClientCAFile verifies peers and is served as the trust bundle;
	// reloaded when it changes.
	ClientCAFile string
	// CACertFile and CAKeyFile are the signing CA for enrollment and
	// renewal; empty disables both.
	CACertFile string
	CAKeyFile  string
	// PreviousCACertFile, during a rotation of the signing CA, is the
	// certificate of the CA being replaced: join tokens it signed still
	// verify and client certificates it issued still renew. Empty: only
	// the signing CA counts (the other CAs of ClientCAFile authenticate
	// peers but never admit or renew them). Reloaded when it changes.
	PreviousCACertFile string
	// BrokerNames are the names this broker answers to in a join token's
	// aud; empty means the policy's cluster.name (broker.Config).
	BrokerNames []string
	// AcceptUnboundJoinTokens also accepts join tokens that name no
	// broker, as releases before audiences made them (broker.Config).
	AcceptUnboundJoinTokens bool
	// ClientCertTTL is the lifetime of issued client certificates unless
	// the policy sets one for the peer.
	ClientCertTTL time.Duration
	// SignClusterCAs also signs, when a request asks (clusterCACSR), the
	// cluster's CA with its client certificate (enrollment.Config). The
	// signing CA must allow a CA below it; checked at start.
	SignClusterCAs bool
	// PolicyFile is the policy, reloaded when it changes.
	PolicyFile string
	// Namespace is the broker's own namespace: lease Secrets, used join
	// tokens, the revocation ConfigMap.
	Namespace string
	// Kube is the broker's own Kubernetes client configuration. Run
	// copies it and sets the client-side limit, the content type and the
	// user agent.
	Kube *rest.Config
	// KubeQPS and KubeBurst are the client-side limit of that client.
	KubeQPS   float32
	KubeBurst int
	// GCInterval is how often expired lease Secrets are deleted.
	GCInterval time.Duration
	// MaxLiveLeases bounds the live leases of all peers together, whatever
	// the policy says; zero means limits.DefaultMaxLiveLeasesTotal.
	MaxLiveLeases int
	// LeasePool is how many unclaimed lease Secrets the broker keeps ready
	// per namespace it recently issued tokens in (broker.PoolConfig): zero
	// means broker.DefaultPoolPerNamespace, negative turns the pool off.
	// LeasePoolMax bounds them over all namespaces; zero means
	// broker.DefaultPoolMax.
	LeasePool, LeasePoolMax int
	// ReloadInterval is how often the certificate, bundle and policy
	// files are looked at; zero means each one's default (about a
	// second). Tests shorten it.
	ReloadInterval time.Duration
	// MaxBodyBytes bounds a request body.
	MaxBodyBytes int64
	// MaxConnsPerIP and MaxConnsPerIdentity bound the open connections of
	// one client address and of one verified identity (Config); zero means
	// the defaults.
	MaxConnsPerIP       int
	MaxConnsPerIdentity int
	// MaxConns, MaxHandshakes and MaxHandshakesPerIP bound the open
	// connections of all TLS listeners, those in their TLS handshake, and
	// those of one client address in their handshake (Config); zero means
	// the defaults.
	MaxConns           int
	MaxHandshakes      int
	MaxHandshakesPerIP int
	// HandshakeTimeout bounds a TLS handshake; zero means
	// DefaultHandshakeTimeout. It must be shorter than the header timeout
	// (DefaultReadHeaderTimeout).
	HandshakeTimeout time.Duration
	// GatewayAddress, if set, is the lease gateway's listener: grants with
	// access gateway are issued (lease certificates from the signing CA,
	// so --ca-cert-file is required) and their requests forwarded.
	// GatewayURL is the gateway's URL as clients reach it, the server of
	// every gateway kubeconfig. GatewayMaxConnsPerLease and
	// GatewayMaxConnsPerPeer bound the gateway's open connections,
	// GatewayMaxRequestsPerLease and GatewayMaxRequestsPerPeer its
	// requests under way (zero: the defaults).
	GatewayAddress             string
	GatewayURL                 string
	GatewayMaxConnsPerLease    int
	GatewayMaxRequestsPerLease int
	GatewayMaxRequestsPerPeer  int
	GatewayMaxConnsPerPeer     int
	// Pprof serves net/http/pprof on the operations listener.
	Pprof bool
	// ShutdownDelay and ReusePort: see Config.
	ShutdownDelay time.Duration
	ReusePort     bool
	// Credentials are the credential kinds this broker issues (see
	// CredentialKinds).
	Credentials []string
	// SigningTimeout bounds the wait for the cluster's signer when
	// issuing a client certificate; zero means 10s.
	SigningTimeout time.Duration
	// PublishClusterTrustBundle, if set, is a signer name
	// (tokenbroker.io/<broker>): the broker keeps a ClusterTrustBundle
	// linked to that signer equal to the CAs that anchor its server
	// certificate (broker.PublishedCAs, kept by
	// broker.ClusterTrustBundlePublisher). The cluster must serve
	// certificates.k8s.io/v1 clustertrustbundles (Kubernetes 1.37 or
	// later), or Run fails.
	PublishClusterTrustBundle string
	// AuditLog is where audit events go: AuditStdout, AuditStderr or a
	// file path (see OpenAuditLog).
	AuditLog string
	// Build is reported as tokenbroker_build_info and in the user agent.
	Build Build
	// Logger receives the operational log. Nil means no logging.
	Logger *zap.Logger
	// Started, if set, is called once every listener accepts connections.
	Started func(Started)
}

// Build identifies the running binary.
type Build struct {
	Version   string
	Revision  string
	GoVersion string
}

// Started is what a running broker reports to Options.Started.
type Started struct {
	API, Ops net.Addr
	// Enroll is nil without an enrollment listener, Gateway without a
	// lease gateway.
	Enroll, Gateway net.Addr
	// Broker is the domain core, for readiness checks in tests.
	Broker *broker.Broker
	// Metrics is the process's metrics registry, as /metrics serves it.
	Metrics prometheus.Gatherer
}

// Validate checks the options, every problem at once, in the words of
// serve's flags (which are also the keys of its config file).
func (o Options) Validate() error {
	var errs []error
	for flag, val := range map[string]string{
		"tls-cert-file": o.TLSCertFile, "tls-key-file": o.TLSKeyFile,
		"client-ca-file": o.ClientCAFile, "policy-file": o.PolicyFile,
	} {
		if val == "" {
			errs = append(errs, fmt.Errorf("--%s is required", flag))
		}
	}
	if o.KubeQPS <= 0 || o.KubeBurst <= 0 {
		errs = append(errs, errors.New("--kube-qps and --kube-burst must be positive"))
	}
	if o.SigningTimeout < 0 || o.SigningTimeout > 5*time.Minute {
		errs = append(errs, errors.New("--signing-timeout must be between 0 (the default, 10s) and 5m"))
	}
	if o.MaxLiveLeases < 0 {
		errs = append(errs, errors.New("--max-live-leases must not be negative"))
	}
	if o.LeasePool > 64 {
		errs = append(errs, errors.New("--lease-pool must be between 0 (off) and 64"))
	}
	if o.LeasePoolMax < 0 || o.LeasePoolMax > 4096 {
		errs = append(errs, errors.New("--lease-pool-max must be between 1 and 4096"))
	}
	if o.GCInterval < time.Second {
		errs = append(errs, errors.New("--gc-interval must be at least 1s"))
	}
	for _, kind := range o.Credentials {
		if !slices.Contains(CredentialKinds(), kind) {
			errs = append(errs, fmt.Errorf("--credentials: unknown or unsupported credential kind %q (this broker issues: %s)", kind, strings.Join(CredentialKinds(), ", ")))
		}
	}
	if o.AuditLog == "" {
		errs = append(errs, errors.New(`--audit-log must be "stdout", "stderr" or a file path`))
	}
	if o.MaxBodyBytes <= 0 {
		errs = append(errs, errors.New("--max-body-bytes must be positive"))
	}
	if o.MaxConnsPerIP < 0 || o.MaxConnsPerIdentity < 0 || o.MaxConns < 0 || o.MaxHandshakes < 0 || o.MaxHandshakesPerIP < 0 {
		errs = append(errs, errors.New("--max-conns, --max-conns-per-ip, --max-conns-per-identity, --max-handshakes and --max-handshakes-per-ip must not be negative"))
	}
	if o.HandshakeTimeout < 0 || o.HandshakeTimeout >= DefaultReadHeaderTimeout {
		errs = append(errs, fmt.Errorf("--handshake-timeout must be between 0 (the default, %s) and the header timeout (%s), exclusive", DefaultHandshakeTimeout, DefaultReadHeaderTimeout))
	}
	if (o.CACertFile == "") != (o.CAKeyFile == "") {
		errs = append(errs, errors.New("--ca-cert-file and --ca-key-file go together"))
	}
	if o.PreviousCACertFile != "" && o.CACertFile == "" {
		errs = append(errs, errors.New("--previous-ca-cert-file needs --ca-cert-file: it names the signing CA being replaced"))
	}
	for _, n := range o.BrokerNames {
		if err := pki.ValidJoinTokenAudience(n); err != nil {
			errs = append(errs, fmt.Errorf("--broker-name: %w", err))
		}
	}
	if o.GatewayAddress != "" {
		if o.CACertFile == "" {
			errs = append(errs, errors.New("--gateway-address needs --ca-cert-file and --ca-key-file: the signing CA issues lease certificates"))
		}
		if u, err := url.Parse(o.GatewayURL); err != nil || u.Scheme != "https" || u.Host == "" || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
			errs = append(errs, errors.New("--gateway-url must be the gateway's https URL as clients reach it (https://host[:port], no path): gateway kubeconfigs name it as their server"))
		}
	}
	if o.GatewayMaxConnsPerLease < 0 || o.GatewayMaxConnsPerPeer < 0 {
		errs = append(errs, errors.New("--gateway-max-conns-per-lease and --gateway-max-conns-per-peer must not be negative"))
	}
	if o.GatewayMaxRequestsPerLease < 0 || o.GatewayMaxRequestsPerPeer < 0 {
		errs = append(errs, errors.New("--gateway-max-requests-per-lease and --gateway-max-requests-per-peer must not be negative"))
	}
	if o.EnrollAddress != "" && o.CACertFile == "" {
		errs = append(errs, errors.New("--enroll-address needs --ca-cert-file and --ca-key-file: enrollment issues certificates"))
	}
	if o.SignClusterCAs && o.CACertFile == "" {
		errs = append(errs, errors.New("--sign-cluster-cas needs --ca-cert-file and --ca-key-file: the signing CA signs cluster CAs"))
	}
	if o.ClientCertTTL < policy.MinCertificateTTL || o.ClientCertTTL > policy.MaxCertificateTTL {
		errs = append(errs, fmt.Errorf("--client-cert-ttl must be between %s and %s", policy.MinCertificateTTL, policy.MaxCertificateTTL))
	}
	if o.PublishClusterTrustBundle != "" {
		if err := pki.ValidSignerName(o.PublishClusterTrustBundle); err != nil {
			errs = append(errs, fmt.Errorf("--publish-cluster-trust-bundle: %w", err))
		}
	}
	if msgs := validation.IsDNS1123Label(o.Namespace); len(msgs) > 0 {
		errs = append(errs, fmt.Errorf("--namespace %q: %s", o.Namespace, strings.Join(msgs, "; ")))
	}
	return errors.Join(errs...)
}

// leaseWatchInterval is how often the lease counter looks at the policy's
// namespaces: as often as the policy file is looked at, at most every 2s.
func leaseWatchInterval(reload time.Duration) time.Duration {
	if reload > 0 && reload < 2*time.Second {
		return reload
	}
	return 2 * time.Second
}

// revocationSyncWait bounds how long Run waits for the first read of the
// revocation list before it starts listening anyway.
const revocationSyncWait = 10 * time.Second

// Run builds the broker from opts and serves until ctx is done. It is the
// composition root of the broker: every part "tokenbroker serve" runs is
// made and started here, and nowhere else.
func Run(ctx context.Context, opts Options) error {
	if err := opts.Validate(); err != nil {
		return err
	}
	log := opts.Logger
	if log == nil {
		log = zap.NewNop()
	}
	pol, err := policy.LoadFile(opts.PolicyFile)
	if err != nil {
		return err
	}
	client, err := kubeClient(opts, log)
	if err != nil {
		return err
	}
	metaClient, err := metadata.NewForConfig(kubeRESTConfig(opts, log))
	if err != nil {
		return fmt.Errorf("create Kubernetes metadata client: %w", err)
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	mets, err := metrics.New(reg)
	if err != nil {
		return fmt.Errorf("register metrics: %w", err)
	}
	mets.SetBuildInfo(opts.Build.Version, opts.Build.Revision, opts.Build.GoVersion)
	auditor, closeAudit, err := OpenAuditLog(opts.AuditLog, log)
	if err != nil {
		return err
	}
	defer closeAudit()

	iss, err := NewIssuers(opts.Credentials, IssuerDeps{Client: client, Logger: log, SigningTimeout: opts.SigningTimeout})
	if err != nil {
		return err
	}

	reloadOpts := func(config, file string) []pki.ReloaderOption {
		o := []pki.ReloaderOption{pki.WithReloadCallback(reloadReporter(log, mets, config, file))}
		if opts.ReloadInterval > 0 {
			o = append(o, pki.WithReloadInterval(opts.ReloadInterval))
		}
		return o
	}
	certs, err := pki.NewCertReloader(opts.TLSCertFile, opts.TLSKeyFile, reloadOpts(metrics.ConfigServerCertificate, opts.TLSCertFile)...)
	if err != nil {
		return fmt.Errorf("load server certificate: %w", err)
	}
	clientCAs, err := pki.NewPoolReloader(opts.ClientCAFile, reloadOpts(metrics.ConfigClientCA, opts.ClientCAFile)...)
	if err != nil {
		return fmt.Errorf("load client CA bundle: %w", err)
	}
	mets.WatchCertificateExpiry(metrics.CertificateServer, func() time.Time { return certs.Leaf().NotAfter })
	mets.WatchCertificateExpiry(metrics.CertificateClientCA, func() time.Time { return earliestNotAfter(clientCAs.Certificates()) })
	// A nil *pki.CAReloader must not become a non-nil interface.
	var ca enrollment.CertificateAuthority
	var signing *pki.CAReloader // ca, for the lease gateway
	if opts.CACertFile != "" {
		// Validate-then-swap like the other files; a new CA that the
		// client-CA bundle does not trust is also warned about.
		var c *pki.CAReloader
		report := reloadReporter(log, mets, metrics.ConfigCA, opts.CACertFile)
		o := []pki.ReloaderOption{pki.WithReloadCallback(func(err error) {
			report(err)
			if err == nil {
				warnUntrustedCA(log, c.Certificate(), clientCAs)
			}
		})}
		if opts.ReloadInterval > 0 {
			o = append(o, pki.WithReloadInterval(opts.ReloadInterval))
		}
		c, err = pki.NewCAReloader(opts.CACertFile, opts.CAKeyFile, pki.CAOptions{}, o...)
		if err != nil {
			return fmt.Errorf("load signing CA: %w", err)
		}
		ca, signing = c, c
		mets.WatchCertificateExpiry(metrics.CertificateCA, func() time.Time { return c.Certificate().NotAfter })
		log.Info("issuing client certificates",
			zap.String("ca", pki.Fingerprint(c.Certificate())),
			zap.Duration("default_ttl", opts.ClientCertTTL),
			zap.Bool("cluster_cas", opts.SignClusterCAs))
		if opts.SignClusterCAs {
			if err := c.CheckSignsClusterCAs(); err != nil {
				return fmt.Errorf("--sign-cluster-cas: %w", err)
			}
		}
		warnUntrustedCA(log, c.Certificate(), clientCAs)
	}

	// A nil *pki.PoolReloader must not become a non-nil interface.
	var previousCA enrollment.CACertificates
	if opts.PreviousCACertFile != "" {
		p, err := pki.NewPoolReloader(opts.PreviousCACertFile, reloadOpts(metrics.ConfigPreviousCA, opts.PreviousCACertFile)...)
		if err != nil {
			return fmt.Errorf("load previous signing CA: %w", err)
		}
		previousCA = p
		for _, c := range p.Certificates() {
			log.Info("accepting the previous signing CA's join tokens and renewals until --previous-ca-cert-file is unset",
				zap.String("previous_ca", pki.Fingerprint(c)))
		}
	}

	var ctb *enrollment.ClusterTrustBundlePublisher
	if opts.PublishClusterTrustBundle != "" {
		if ctb, err = clusterTrustBundlePublisher(opts.PublishClusterTrustBundle, pol.Cluster.Name, client,
			publishSources(certs, clientCAs, ca, previousCA), reg, log); err != nil {
			return err
		}
	}

	store := policy.NewStore(pol)
	policyWatcher, err := policy.NewWatcher(opts.PolicyFile, store, log.Named("policy"), mets, opts.ReloadInterval)
	if err != nil {
		return err
	}
	revocations := enrollment.NewRevocationList(client.CoreV1(), opts.Namespace, log.Named("revocations"), mets)
	leases := lease.NewCounter(metaClient, clock.RealClock{}, log.Named("leases"))
	namespaces, err := namespaceInformer(ctx, metaClient, log)
	if err != nil {
		return err
	}
	peerKeys := workload.NewPeerKeyStore(client.CoreV1(), opts.Namespace, log.Named("peerkeys"))
	var gw *gatewayParts
	if opts.GatewayAddress != "" {
		if gw, err = newGateway(opts, client, leases, revocations, auditor, reg, log, signing, previousCA,
			publishSources(certs, clientCAs, ca, previousCA), certs); err != nil {
			return err
		}
	} else if n := pol.GatewayGrants(); n > 0 {
		log.Warn("the policy has grants with access: gateway, but this broker runs no lease gateway (--gateway-address): their requests are answered 422", zap.Int("gateway_grants", n))
	}
	b, err := broker.New(broker.Config{
		Secrets:        client.CoreV1(),
		RoleBindings:   client.RbacV1(),
		Issuers:        iss,
		Policy:         store,
		Logger:         log.Named("broker"),
		Metrics:        mets,
		APIServerReady: apiServerReadyz(client.Discovery().RESTClient()),
		Namespace:      opts.Namespace,
		Enrollment: enrollment.Config{
			CA:                      ca,
			PreviousCA:              previousCA,
			BrokerNames:             opts.BrokerNames,
			AcceptUnboundJoinTokens: opts.AcceptUnboundJoinTokens,
			Trust:                   clientCAs,
			CertificateTTL:          opts.ClientCertTTL,
			Revocations:             revocations,
			SignClusterCAs:          opts.SignClusterCAs,
		},
		Auditor:        auditor,
		Leases:         leases,
		MaxLiveLeases:  opts.MaxLiveLeases,
		Pool:           lease.PoolConfig{PerNamespace: opts.LeasePool, Max: opts.LeasePoolMax},
		Namespaces:     namespaces,
		LiveNamespaces: client.CoreV1(),
		PeerKeys:       peerKeys,
		Gateway:        gw.brokerConfig(),
	})
	if err != nil {
		return err
	}

	scfg := Config{
		Addr:                opts.ListenAddress,
		OpsAddr:             opts.OpsAddress,
		TLSConfig:           pki.ServerTLSConfigReloading(certs, clientCAs),
		ClientCAs:           clientCAs,
		MaxBodyBytes:        opts.MaxBodyBytes,
		MaxConnsPerIP:       opts.MaxConnsPerIP,
		MaxConnsPerIdentity: opts.MaxConnsPerIdentity,
		MaxConns:            opts.MaxConns,
		MaxHandshakes:       opts.MaxHandshakes,
		MaxHandshakesPerIP:  opts.MaxHandshakesPerIP,
		HandshakeTimeout:    opts.HandshakeTimeout,
		Pprof:               opts.Pprof,
		ShutdownDelay:       opts.ShutdownDelay,
		ReusePort:           opts.ReusePort,
		Logger:              log.Named("http"),
		Registerer:          reg,
		Gatherer:            reg,
		Broker:              b,
	}
	if opts.EnrollAddress != "" {
		scfg.EnrollAddr = opts.EnrollAddress
		scfg.EnrollTLSConfig = pki.EnrollmentTLSConfig(certs)
	}
	if gw != nil {
		scfg.GatewayAddr, scfg.GatewayTLSConfig, scfg.Gateway = opts.GatewayAddress, gw.tls, gw.gateway
	}
	srv, err := New(scfg)
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go revocations.Run(ctx)
	go namespaces.RunWithContext(ctx)
	go b.RunTenants(ctx)
	go peerKeys.Run(ctx)
	go policyWatcher.Run(ctx)
	go b.RunGC(ctx, opts.GCInterval)
	if gw != nil {
		go gw.gateway.RunDenySweeps(ctx)
	}
	if ctb != nil {
		go ctb.Run(ctx)
	}
	poolDone := make(chan struct{})
	go func() { defer close(poolDone); b.RunPool(ctx) }()
	go b.RunWritesAfterAnswers(ctx)
	defer func() { cancel(); <-poolDone }() // its unclaimed Secrets are deleted before serve returns
	go leases.Run(ctx, b.LeaseNamespaces, leaseWatchInterval(opts.ReloadInterval))
	// Until the deny list is read every caller is refused (fail closed);
	// wait for it a little so that a healthy start serves at once.
	// With ReusePort the listeners open beside the instance this one
	// replaces, which gets new connections only as long as it listens: wait
	// for as long as it takes, so that no connection lands on an instance
	// that would refuse it.
	syncCtx, cancelSync := context.WithTimeout(ctx, revocationSyncWait)
	if opts.ReusePort {
		cancelSync()
		syncCtx, cancelSync = context.WithCancel(ctx)
	}
	if err := revocations.WaitForSync(syncCtx); err != nil && ctx.Err() == nil {
		log.Warn("revocation list not read yet; every caller is refused until it is",
			zap.String("namespace", opts.Namespace), zap.Error(err))
	}
	if !cache.WaitForCacheSync(syncCtx.Done(), namespaces.HasSynced) && ctx.Err() == nil {
		log.Warn("namespace cache not synced yet; not ready until it is")
	}
	if err := peerKeys.WaitForSync(syncCtx); err != nil && ctx.Err() == nil {
		log.Warn("peer key sets not read yet; uploaded keys verify nothing until they are",
			zap.String("namespace", opts.Namespace), zap.Error(err))
	}
	if opts.ReusePort {
		// Everything /readyz checks, so that the first connection the
		// kernel hands this instance is served.
		err := wait.PollUntilContextCancel(syncCtx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
			return b.Ready(ctx) == nil, nil
		})
		if err != nil {
			cancelSync()
			return nil // stopped before it was ready: nothing served
		}
	}
	cancelSync()
	go func() {
		select {
		case <-srv.Listening():
			fields := []zap.Field{
				zap.String("api", srv.Addr().String()),
				zap.String("ops", srv.OpsAddr().String()),
				zap.String("cluster", pol.Cluster.Name),
				zap.Int("peers", len(pol.Peers)),
				zap.String("namespace", opts.Namespace),
			}
			if a := srv.EnrollAddr(); a != nil {
				fields = append(fields, zap.String("enroll", a.String()))
			}
			if a := srv.GatewayAddr(); a != nil {
				fields = append(fields, zap.String("gateway", a.String()), zap.String("gateway_url", opts.GatewayURL))
			}
			log.Info("broker listening", fields...)
			if opts.Started != nil {
				opts.Started(Started{API: srv.Addr(), Ops: srv.OpsAddr(), Enroll: srv.EnrollAddr(), Gateway: srv.GatewayAddr(), Broker: b, Metrics: reg})
			}
		case <-ctx.Done():
		}
	}()
	return srv.Run(ctx)
}

// publishSources returns, at each call, the certificates a published
// ClusterTrustBundle is chosen from (broker.PublishedCAs), as reloaded:
// the serving chain, the client-CA bundle, the signing CA and the
// previous one. ca and previous may be nil.
func publishSources(certs *pki.CertReloader, clientCAs *pki.PoolReloader, ca enrollment.CertificateAuthority,
	previous enrollment.CACertificates) func() enrollment.PublishSources {
	return func() enrollment.PublishSources {
		src := enrollment.PublishSources{ClientCAs: clientCAs.Certificates()}
		if tc, err := certs.GetCertificate(nil); err == nil && tc != nil {
			for _, der := range tc.Certificate {
				c, err := x509.ParseCertificate(der)
				if err != nil {
					break
				}
				src.ServingChain = append(src.ServingChain, c)
			}
		}
		if ca != nil {
			src.Signing = ca.Certificate()
		}
		if previous != nil {
			src.Previous = previous.Certificates()
		}
		return src
	}
}

// clusterTrustBundlePublisher checks that the cluster serves
// ClusterTrustBundles at certificates.k8s.io/v1 and makes the publisher of
// the CAs that anchor this broker's server certificate
// (broker.PublishedCAs over sources, called at each check), under the
// broker's name owner.
func clusterTrustBundlePublisher(signer, owner string, client kubernetes.Interface, sources func() enrollment.PublishSources,
	reg prometheus.Registerer, log *zap.Logger) (*enrollment.ClusterTrustBundlePublisher, error) {
	const gv = "certificates.k8s.io/v1"
	res, err := client.Discovery().ServerResourcesForGroupVersion(gv)
	served := false
	if err == nil {
		for _, r := range res.APIResources {
			served = served || r.Name == "clustertrustbundles"
		}
	}
	if !served {
		if err != nil && !apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("--publish-cluster-trust-bundle: discover %s: %w", gv, err)
		}
		return nil, fmt.Errorf("--publish-cluster-trust-bundle: the cluster does not serve %s clustertrustbundles (GA in Kubernetes 1.37); unset the flag on older clusters", gv)
	}
	var warned []byte
	bundle := func() []*x509.Certificate {
		cas, ok := enrollment.PublishedCAs(sources(), time.Now())
		if pem := pki.EncodeCertificatesPEM(cas); !ok && !bytes.Equal(pem, warned) {
			warned = pem
			log.Warn("the serving certificate does not verify to any of the operator's CAs (--client-ca-file, --ca-cert-file, --previous-ca-cert-file), so its issuer is not published in the ClusterTrustBundle; peers that trust only the bundle refuse this broker until it does",
				zap.String("signer", signer))
		} else if ok {
			warned = nil
		}
		return cas
	}
	p, err := enrollment.NewClusterTrustBundlePublisher(enrollment.ClusterTrustBundleConfig{
		Client:     client.CertificatesV1().ClusterTrustBundles(),
		SignerName: signer,
		Owner:      owner,
		Bundle:     bundle,
		Logger:     log.Named("cluster-trust-bundle"),
		Registerer: reg,
	})
	if err != nil {
		return nil, err
	}
	log.Info("publishing the trust bundle as a ClusterTrustBundle", zap.String("name", p.Name()), zap.String("signer", signer))
	return p, nil
}

// namespaceInformer is the broker's metadata-only informer of namespaces,
// which grants by namespaceSelector are decided from and kept true by:
// names, labels, owner references and deletion timestamps only (broker.TrimNamespace), so
// that thousands of namespaces cost a few megabytes. It needs list and
// watch on namespaces.
func namespaceInformer(ctx context.Context, mc metadata.Interface, log *zap.Logger) (cache.SharedIndexInformer, error) {
	inf := metadatainformer.NewFilteredMetadataInformer(mc, corev1.SchemeGroupVersion.WithResource("namespaces"), "", 0, cache.Indexers{}, nil).Informer()
	if err := inf.SetTransform(tenants.TrimNamespace); err != nil {
		return nil, fmt.Errorf("namespace informer: %w", err)
	}
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		if ctx.Err() == nil {
			log.Warn("watch of namespaces failed; retrying", zap.Error(err))
		}
	}) // fails only once the informer runs
	return inf, nil
}

// kubeClient is the broker's Kubernetes client. It lifts client-go's
// default client-side limit (5 QPS, burst 10), which would otherwise
// throttle a broker to a handful of issuances a second, and speaks
// protobuf, which costs the broker and the API server less CPU than JSON
// for the built-in types it calls (Secrets, TokenRequest). It asks for no
// gzip: the API server would otherwise deflate and flush every event of
// every lease watch (each replica watches every lease Secret), and the
// broker inflate it, for bytes that cross a cluster network.
func kubeClient(opts Options, log *zap.Logger) (kubernetes.Interface, error) {
	if opts.Kube == nil {
		return nil, fmt.Errorf("no Kubernetes client configuration")
	}
	client, err := kubernetes.NewForConfig(kubeRESTConfig(opts, log))
	if err != nil {
		return nil, fmt.Errorf("create Kubernetes client: %w", err)
	}
	return client, nil
}

func kubeRESTConfig(opts Options, log *zap.Logger) *rest.Config {
	rc := rest.CopyConfig(opts.Kube)
	TuneKubeClient(rc, opts.KubeQPS, opts.KubeBurst)
	rc.UserAgent = "tokenbroker/" + opts.Build.Version
	// API server warnings (such as a shortened token) go to our log in
	// its format, not to stderr through klog.
	rc.WarningHandler = ZapWarnings{Log: log.Named("kubernetes")}
	return rc
}

// TuneKubeClient sets on rc what the broker's Kubernetes client sets
// beside its kubeconfig (kubeClient says why): the client-side limit qps
// and burst, protobuf, and no gzip. The bench's direct client and its
// bare issuer call it too, so that they are configured as the broker's by
// construction.
func TuneKubeClient(rc *rest.Config, qps float32, burst int) {
	rc.QPS, rc.Burst = qps, burst
	rc.ContentType = "application/vnd.kubernetes.protobuf"
	rc.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	rc.DisableCompression = true
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

// reloadReporter logs and counts the reloads of one configuration file.
func reloadReporter(log *zap.Logger, m *metrics.Metrics, config, file string) func(error) {
	return func(err error) {
		m.ObserveReload(config, err)
		if err != nil {
			log.Error("reload refused; keeping the previous one", zap.String("config", config), zap.String("file", file), zap.Error(err))
			return
		}
		log.Info("reloaded", zap.String("config", config), zap.String("file", file))
	}
}

// warnUntrustedCA warns when the signing CA does not chain to the client-CA
// bundle: the certificates it signs would be refused by this broker's own
// handshake. It is a warning, not a refusal, because the two files are
// replaced separately during a rotation and either may be read first.
func warnUntrustedCA(log *zap.Logger, ca *x509.Certificate, bundle *pki.PoolReloader) {
	if _, err := ca.Verify(x509.VerifyOptions{Roots: bundle.Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		log.Warn("the signing CA is not in the client-CA bundle; certificates it signs are refused until it is",
			zap.String("ca", pki.Fingerprint(ca)), zap.Error(err))
	}
}

// ZapWarnings logs the API server's warning headers; the broker and the
// agent set it as their client's rest.WarningHandler.
type ZapWarnings struct{ Log *zap.Logger }

// HandleWarningHeader implements rest.WarningHandler.
func (w ZapWarnings) HandleWarningHeader(code int, agent, text string) {
	if code != 299 || text == "" {
		return
	}
	w.Log.Info("API server warning", zap.String("warning", text))
}

// apiServerReadyz returns a readiness check that asks the API server's
// /readyz through c (a discovery client's RESTClient), for broker.Config.APIServerReady.
func apiServerReadyz(c rest.Interface) func(context.Context) error {
	return func(ctx context.Context) error {
		return c.Get().AbsPath("/readyz").Do(ctx).Error()
	}
}
