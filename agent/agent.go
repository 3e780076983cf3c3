package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/agent/client"
	"github.com/tokenbroker/tokenbroker/agent/config"
	"github.com/tokenbroker/tokenbroker/agent/podsigner"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Deps are the agent's collaborators, injected so that tests and an
// in-process e2e can start an agent with their own.
type Deps struct {
	// Kubernetes is a client of the source cluster, for Secret outputs, a
	// Secret identity and ClusterTrustBundles. Required when the config has
	// any (see Config.UsesKubernetes); it needs get, create and update on
	// those Secrets, and list on clustertrustbundles with
	// identity.trustBundleFrom.
	Kubernetes kubernetes.Interface
	// Dynamic is a dynamic client of the source cluster, for clusterProfile
	// outputs (Config.UsesClusterProfiles); it needs get, create and patch
	// on clusterprofiles and patch on clusterprofiles/status in their
	// namespaces.
	Dynamic dynamic.Interface
	// Logger receives the agent's logs; nil discards them. The agent never
	// logs a token, a key or a kubeconfig: leases appear by id.
	Logger *zap.Logger
	// Registry receives the agent's metrics and is what /metrics serves;
	// nil makes a new one. Process and Go collectors are the caller's
	// choice.
	Registry *prometheus.Registry
	// Clock drives every schedule; nil means the wall clock.
	Clock clock.Clock
	// Rand is the jitter source; nil means math/rand/v2's. It must be safe
	// for concurrent use.
	Rand Rand
	// OpsListener, if set, serves /healthz, /readyz and /metrics instead
	// of listening on Config.OpsAddress (tests pass 127.0.0.1:0).
	OpsListener net.Listener
	// JWKSSource, if set, is where jwksUpload reads the cluster's key
	// set; nil means /openid/v1/jwks through Kubernetes.
	JWKSSource JWKSSource
}

// Agent keeps the kubeconfigs of its targets fresh and its own client
// certificate renewed. Make it with New, run it with Run.
type Agent struct {
	cfg      config.Config
	log      *zap.Logger
	clock    clock.Clock
	rand     Rand
	registry *prometheus.Registry
	metrics  *metrics
	opsLn    net.Listener

	store   identityStore
	holder  *identityHolder
	brokers *brokers
	targets []*refresher
	renewer *renewer
	// reloader reads a pod certificate identity again (nil otherwise,
	// when renewer renews the client certificate).
	reloader *podCertificateReloader
	jwks     *jwksUploader
	pods     *podReporter
	trust    *clusterTrust
	// kube is the source cluster's client, for the pod signer (nil when
	// the config needs none).
	kube kubernetes.Interface

	runOnce sync.Once
}

// New checks cfg (applying its defaults) and builds an agent. It does not
// touch the network or the source cluster: Run does.
func New(cfg config.Config, deps Deps) (*Agent, error) {
	cfg.Default()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.UsesClusterProfiles() && deps.Dynamic == nil {
		return nil, errors.New("agent: the config has a clusterProfile output, so Deps.Dynamic is required")
	}
	if cfg.UsesKubernetes() && deps.Kubernetes == nil {
		return nil, errors.New("agent: the config has a Secret output or identity or ClusterTrustBundles, so Deps.Kubernetes is required")
	}
	a := &Agent{
		cfg:      cfg,
		log:      deps.Logger,
		clock:    deps.Clock,
		rand:     deps.Rand,
		registry: deps.Registry,
		opsLn:    deps.OpsListener,
		holder:   &identityHolder{},
		kube:     deps.Kubernetes,
	}
	if a.log == nil {
		a.log = zap.NewNop()
	}
	if a.clock == nil {
		a.clock = clock.RealClock{}
	}
	if a.rand == nil {
		a.rand = systemRand{}
	}
	if a.registry == nil {
		a.registry = prometheus.NewRegistry()
	}
	m, err := newMetrics(a.registry)
	if err != nil {
		return nil, err
	}
	a.metrics = m
	a.brokers = newBrokers(a.holder)
	if tb := cfg.Identity.TrustBundleFrom; tb != nil && tb.ClusterTrustBundle != nil {
		pin := ""
		if cfg.Identity.Enroll != nil {
			pin = cfg.Identity.Enroll.CAFingerprint
		}
		a.trust, err = newClusterTrust(*tb.ClusterTrustBundle, pin, deps.Kubernetes.CertificatesV1().ClusterTrustBundles(), a.clock, a.log.Named("trust"))
		if err != nil {
			return nil, err
		}
		a.brokers.trust = a.trust.get
	}

	switch {
	case cfg.Identity.Secret != nil:
		a.store = secretStore{secrets: deps.Kubernetes.CoreV1(), ref: *cfg.Identity.Secret}
	case cfg.Identity.PodCertificate != nil:
		a.store = podCertificateStore{dir: IdentityDir(cfg.Identity.PodCertificate.Dir)}
	default:
		a.store = dirStore{dir: IdentityDir(cfg.Identity.Dir)}
	}

	slots := newStepSlots(maxConcurrentSteps)
	for i, t := range cfg.Targets {
		outs := make([]output, 0, len(t.Outputs))
		for _, o := range t.Outputs {
			switch {
			case o.Secret != nil:
				outs = append(outs, &secretOutput{cfg: *o.Secret, secrets: deps.Kubernetes.CoreV1()})
			case o.ClusterProfile != nil:
				outs = append(outs, newClusterProfileOutput(*o.ClusterProfile, t.Name, deps.Dynamic, a.clock.Now))
			default:
				outs = append(outs, &fileOutput{cfg: *o.File})
			}
		}
		rc := cfg.RefreshFor(i)
		r := &refresher{
			name:    t.Name,
			req:     t.Request,
			meta:    outputMeta{target: t.Name, request: requestDigest(t.Broker, t.Request), broker: t.Broker, req: t.Request},
			api:     brokerRef{b: a.brokers, url: t.Broker, workloadTokenFile: t.WorkloadTokenFile},
			outputs: outs,
			sched:   newSchedule(rc, a.rand),
			grace:   time.Duration(rc.RevokeGrace),
			clock:   a.clock,
			log:     a.log.Named("refresh").With(zap.String("target", t.Name)),
			metrics: m,
			slots:   slots,
		}
		m.initTarget(t.Name, outs)
		a.targets = append(a.targets, r)
	}

	if u := cfg.JWKSUpload; u != nil {
		src := deps.JWKSSource
		if src == nil {
			src = APIServerJWKS{Client: deps.Kubernetes.Discovery().RESTClient()}
		}
		jwks := &jwksUploader{
			source:   src,
			brokers:  map[string]jwksAPI{},
			interval: time.Duration(u.Interval),
			resync:   time.Duration(u.ResyncInterval),
			clock:    a.clock,
			log:      a.log.Named("jwks"),
			uploaded: map[string]uploadState{},
		}
		podBrokers := map[string]podsAPI{}
		for _, b := range u.Brokers {
			ref := brokerRef{b: a.brokers, url: b}
			jwks.brokers[b], podBrokers[b] = ref, ref
		}
		if u.UploadsKeys() {
			a.jwks = jwks
		}
		if p := u.LivePods; p != nil {
			// With podSigner, the Pods of its pod certificates too.
			signerName := ""
			if cfg.PodSigner != nil {
				signerName = cfg.PodSigner.SignerName
			}
			a.pods = newPodReporter(deps.Kubernetes, podBrokers, p.Interval, p.Audiences, signerName, p.Namespaces, a.clock, a.log.Named("pods"))
		}
	}

	if cfg.Identity.PodCertificate != nil {
		// The kubelet renews it; the agent reads it again.
		a.reloader = &podCertificateReloader{store: a.store, holder: a.holder, clock: a.clock,
			log: a.log.Named("identity"), onChanged: a.brokers.closeIdle}
	} else {
		renewSched := newSchedule(cfg.Refresh, a.rand)
		renewSched.fraction = cfg.Identity.RenewAt
		a.renewer = &renewer{
			store:     a.store,
			holder:    a.holder,
			api:       brokerRef{b: a.brokers, url: cfg.Identity.RenewBroker},
			sched:     renewSched,
			clock:     a.clock,
			log:       a.log.Named("renew"),
			metrics:   m,
			onRenewed: a.brokers.closeIdle,
			// The pod signer's CA comes with the identity.
			wantClusterCA: cfg.PodSigner != nil,
		}
		if a.trust != nil {
			a.renewer.trust = a.trust.get
		}
	}
	if err := a.registry.Register(newExpiryCollector(a.clock.Now, a.targets, a.holder)); err != nil {
		return nil, fmt.Errorf("register agent metrics: %w", err)
	}
	return a, nil
}

// Run serves the operations listener, loads the identity (enrolling with
// the join token if there is none and identity.enroll is set), then keeps
// every target fresh and the certificate renewed until ctx is done. It
// returns nil after a graceful stop: timers stopped, writes in flight
// finished, current leases left alone so that consumers keep working. It
// returns an error if the identity cannot be had or the listener fails.
// Run may be called once.
func (a *Agent) Run(ctx context.Context) error {
	err := errors.New("agent: Run called twice")
	a.runOnce.Do(func() { err = a.run(ctx) })
	return err
}

func (a *Agent) run(ctx context.Context) error {
	ln := a.opsLn
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", a.cfg.OpsAddress); err != nil {
			return fmt.Errorf("ops listener: %w", err)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	srv := &http.Server{
		Handler:           a.Handler(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       60 * time.Second,
		ErrorLog:          zap.NewStdLog(a.log.Named("ops")),
	}
	srvErr := make(chan error, 1)
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			srvErr <- fmt.Errorf("ops listener: %w", err)
			cancel()
		}
		close(srvErr)
	}()
	a.log.Info("agent starting", zap.String("ops", ln.Addr().String()), zap.Int("targets", len(a.targets)),
		zap.String("identity_store", a.store.String()))

	err := a.startIdentity(ctx)
	var wg sync.WaitGroup
	if err == nil {
		if a.trust != nil {
			// Targets that start before a good read back off and try
			// again; the loop reads every interval.
			if terr := a.trust.refresh(ctx); terr != nil && ctx.Err() == nil {
				a.log.Error("reading the broker CAs from ClusterTrustBundles failed; brokers are not trusted until a read succeeds", zap.Error(terr))
			}
			wg.Go(func() { a.trust.run(ctx) })
		}
		if a.reloader != nil {
			wg.Go(func() { a.reloader.run(ctx) })
		} else {
			wg.Go(func() { a.renewer.run(ctx) })
		}
		if a.pods != nil {
			wg.Go(func() { a.pods.run(ctx) })
		}
		if a.jwks != nil {
			wg.Go(func() { a.jwks.run(ctx) })
		}
		if ps := a.cfg.PodSigner; ps != nil {
			s, serr := podsigner.New(podsigner.Config{
				Client: a.kube, SignerName: ps.SignerName, CA: a.holder.clusterCA, ClusterIdentity: a.holder.get().spiffeID,
				MaxLifetime: time.Duration(ps.MaxLifetime), Clock: a.clock, Logger: a.log.Named("podsigner"),
			})
			if serr != nil {
				err = serr
				cancel()
			} else {
				a.log.Info("signing pod certificates", zap.String("signer", ps.SignerName),
					zap.Bool("cluster_ca", a.holder.clusterCA() != nil))
				wg.Go(func() { s.Run(ctx) })
			}
		}
		for _, r := range a.targets {
			wg.Go(func() { r.run(ctx) })
		}
		<-ctx.Done()
		wg.Wait()
	}
	shutCtx, stop := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer stop()
	_ = srv.Shutdown(shutCtx) // probes that hang on are cut off
	a.brokers.closeIdle()
	if lerr := <-srvErr; lerr != nil {
		return lerr
	}
	if err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled) {
		err = nil // stopped while enrolling
	}
	a.log.Info("agent stopped")
	return err
}

// startIdentity loads the stored identity, or enrolls when there is none
// (or it has expired) and identity.enroll is set.
func (a *Agent) startIdentity(ctx context.Context) error {
	id, err := a.store.load(ctx)
	now := a.clock.Now()
	switch {
	case err == nil && now.Before(id.leaf().NotAfter):
		a.holder.set(id)
		a.log.Info("identity loaded", zap.String("identity", id.spiffeID),
			zap.String("serial", id.leaf().SerialNumber.Text(16)), zap.Time("not_after", id.leaf().NotAfter),
			zap.String("store", a.store.String()))
		return nil
	case err == nil && a.reloader != nil:
		// The kubelet replaces it before it expires; until then brokers
		// refuse it, and the reloader takes the new one.
		a.holder.set(id)
		a.log.Warn("the pod certificate has expired; waiting for the kubelet's next one", zap.String("identity", id.spiffeID),
			zap.Time("not_after", id.leaf().NotAfter), zap.String("store", a.store.String()))
		return nil
	case err == nil:
		if a.cfg.Identity.Enroll == nil {
			return fmt.Errorf("the client certificate of %s in %s expired at %s; give identity.enroll a new join token to enroll again",
				id.spiffeID, a.store, id.leaf().NotAfter.UTC().Format(time.RFC3339))
		}
		a.log.Warn("the stored client certificate has expired; enrolling again",
			zap.String("identity", id.spiffeID), zap.Time("not_after", id.leaf().NotAfter))
	case errors.Is(err, errNoIdentity) && a.reloader != nil:
		return fmt.Errorf("%w (%s): the Pod needs a podCertificate volume there, with certificateChainPath tls.crt and keyPath tls.key, and ca.crt", errNoIdentity, a.store)
	case errors.Is(err, errNoIdentity):
		if a.cfg.Identity.Enroll == nil {
			return fmt.Errorf("%w (%s) and identity.enroll is not set: run \"tokenbroker enroll\" or configure identity.enroll with a join token", errNoIdentity, a.store)
		}
	default:
		return fmt.Errorf("load identity: %w", err)
	}
	return a.enroll(ctx)
}

// enroll obtains the first certificate with the join token. Transient
// failures (the broker not reachable yet) are retried with backoff; the
// token is never logged, its jti is. The token file is left in place:
// the broker refuses a second use anyway.
func (a *Agent) enroll(ctx context.Context) error {
	e := a.cfg.Identity.Enroll
	token, err := pki.ReadJoinToken(e.TokenFile, nil)
	if err != nil {
		return err
	}
	claims, err := parseJoinToken(token)
	if err != nil {
		return fmt.Errorf("join token in %s: %w", e.TokenFile, err)
	}
	log := a.log.Named("enroll").With(zap.String("broker", e.Broker), zap.String("identity", claims.sub),
		zap.String("jti", claims.jti), zap.String("token_file", e.TokenFile))
	log.Info("enrolling with the join token")
	sched := newSchedule(a.cfg.Refresh, a.rand)
	var id *identity
	for failures := 1; ; failures++ {
		id, _, err = enroll(ctx, EnrollOptions{BrokerURL: e.Broker, Fingerprint: e.CAFingerprint, Token: token, ClusterCA: a.cfg.PodSigner != nil})
		if err == nil {
			break
		}
		if !client.Retryable(err) || ctx.Err() != nil {
			return fmt.Errorf("enroll with the join token in %s: %w", e.TokenFile, err)
		}
		d := sched.backoff(failures)
		log.Warn("enrollment failed; retrying", zap.Int("failures", failures), zap.Duration("retry_in", d), zap.Error(err))
		if err := a.sleep(ctx, d); err != nil {
			return err
		}
	}
	log.Info("the join token was used; it cannot be used again",
		zap.String("serial", id.leaf().SerialNumber.Text(16)), zap.Time("not_after", id.leaf().NotAfter))
	// The certificate exists only here now: keep trying to store it.
	for failures := 1; ; failures++ {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), saveTimeout)
		err := a.store.save(sctx, id)
		cancel()
		if err == nil {
			break
		}
		d := sched.backoff(failures)
		log.Error("cannot store the enrolled identity; retrying", zap.String("store", a.store.String()), zap.Duration("retry_in", d), zap.Error(err))
		if err := a.sleep(ctx, d); err != nil {
			return fmt.Errorf("store the enrolled identity in %s: %w", a.store, err)
		}
	}
	a.holder.set(id)
	log.Info("identity stored", zap.String("store", a.store.String()))
	return nil
}

func (a *Agent) sleep(ctx context.Context, d time.Duration) error {
	return sleepUntil(ctx, a.clock, a.clock.Now().Add(d))
}

// Handler serves the operations endpoints: /healthz (503 with the reason
// when a credential or the certificate has expired, or a credential will
// expire before its next attempt), /readyz (503 until every output of
// every target holds a credential) and /metrics. It is internal (probes
// and scrapers), so it may say why.
func (a *Agent) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := a.Healthy(); err != nil {
			writeText(w, http.StatusServiceUnavailable, "unhealthy: "+err.Error())
			return
		}
		writeText(w, http.StatusOK, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := a.Ready(); err != nil {
			writeText(w, http.StatusServiceUnavailable, "not ready: "+err.Error())
			return
		}
		writeText(w, http.StatusOK, "ok")
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(a.registry, promhttp.HandlerOpts{
		ErrorLog:      zap.NewStdLog(a.log.Named("metrics")),
		ErrorHandling: promhttp.ContinueOnError,
	}))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		mux.ServeHTTP(w, r)
	})
}

func writeText(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, msg+"\n") // a probe that hung up needs no answer
}

// Healthy returns why the agent is unhealthy, or nil: a target whose
// credential has expired or will expire before its next attempt, or an
// expired client certificate. A restart does not fix these, but a probe
// failing makes them visible; a target still waiting for its first
// credential is not unhealthy (see Ready).
func (a *Agent) Healthy() error {
	now := a.clock.Now()
	var errs []error
	if leaf := a.holder.leaf(); leaf != nil && !now.Before(leaf.NotAfter) {
		errs = append(errs, fmt.Errorf("client certificate expired at %s", leaf.NotAfter.UTC().Format(time.RFC3339)))
	}
	for _, r := range a.targets {
		if err := targetHealth(r.name, r.status(), now); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func targetHealth(name string, st targetStatus, now time.Time) error {
	exp, ok := st.expiry()
	if !ok {
		return nil
	}
	rfc := func(t time.Time) string { return t.UTC().Format(time.RFC3339) }
	switch {
	case !now.Before(exp):
		return fmt.Errorf("target %s: credential expired at %s (%d failures in a row: %s)", name, rfc(exp), st.failures, st.lastErr)
	case st.nextAttempt.After(exp):
		return fmt.Errorf("target %s: credential expires at %s, before the next attempt at %s (%d failures in a row: %s)",
			name, rfc(exp), rfc(st.nextAttempt), st.failures, st.lastErr)
	}
	return nil
}

// Ready returns nil once the agent has its identity and every output of
// every target holds a credential.
func (a *Agent) Ready() error {
	if !a.holder.loaded() {
		return errors.New("no client certificate yet")
	}
	var waiting []string
	for _, r := range a.targets {
		if !r.status().ready() {
			waiting = append(waiting, r.name)
		}
	}
	if len(waiting) > 0 {
		return fmt.Errorf("no credential written yet for %s", strings.Join(waiting, ", "))
	}
	return nil
}
