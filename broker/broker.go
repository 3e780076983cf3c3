package broker

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	rbacv1client "k8s.io/client-go/kubernetes/typed/rbac/v1"
	"k8s.io/utils/clock"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/enrollment"
	"github.com/tokenbroker/tokenbroker/broker/kubeconfig"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/limits"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/tenants"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/issuers"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Issuer mints one kind of credential. Errors are returned unclassified;
// the broker classifies Kubernetes API errors itself.
type Issuer interface {
	// Kind is the credential kind it issues (issuers.KindToken, …).
	Kind() string
	// Limits are the TTL bounds and the revocation of its credentials.
	Limits() issuers.Limits
	// Issue mints a credential for req, within Limits. Errors from the API
	// server are returned wrapped and unclassified.
	Issue(ctx context.Context, req issuers.Request) (issuers.Credential, error)
}

// Config is what a Broker needs. Secrets, Issuers, Policy and Logger are
// required.
type Config struct {
	// Secrets is where lease Secrets are kept.
	Secrets corev1client.SecretsGetter
	// RoleBindings, if set, lets a revocation delete a client
	// certificate's RoleBinding at once rather than leave it to the
	// garbage collector (the lease owns it).
	RoleBindings rbacv1client.RoleBindingsGetter
	// Issuers by credential kind (apiv1.CredentialToken, ...). A kind
	// missing here is refused even if the policy grants it.
	Issuers map[string]Issuer
	Policy  *policy.Store
	Logger  *zap.Logger
	// APIServerReady reports whether the API server answers; used by Ready.
	APIServerReady func(ctx context.Context) error
	// Metrics, if set, records issuance outcomes and API call time.
	Metrics *metrics.Metrics
	// Clock is the broker's one source of time, for expiries, audit times
	// and the durations it measures; nil means the wall clock. Rand
	// defaults to crypto/rand.
	Clock clock.WithTicker
	Rand  io.Reader
	// CleanupTimeout bounds one deletion of a lease after a failed
	// request and one retry of a failed deletion (retry.go); default 10s.
	CleanupTimeout time.Duration

	// Namespace is the broker's own namespace, where used join tokens are
	// recorded. Required when Enrollment.CA is set.
	Namespace string
	// Enrollment is the CA side: the signing CA, join tokens, the trust
	// bundle, certificate lifetimes and the deny list.
	Enrollment enrollment.Config
	// Auditor receives one audit.Event per decision; nil writes none.
	Auditor audit.Auditor
	// Leases counts the live leases for the quotas; nil enforces none
	// (tests of other things). MaxLiveLeases bounds all peers' leases
	// together whatever the policy says; 0 means limits.DefaultMaxLiveLeasesTotal.
	Leases        *lease.Counter
	MaxLiveLeases int
	// Namespaces, if set, is a metadata-only informer of the cluster's
	// namespaces, run by the caller: grants by namespaceSelector are
	// decided from it and kept true (RunTenants). Without it such grants
	// match nothing. While it is not synced the broker is not ready.
	Namespaces tenants.NamespaceInformer
	// LiveNamespaces, if set, reads a namespace from the API server to
	// confirm that it left a selector grant before its leases are revoked
	// (the cache may lag); nil trusts the cache.
	LiveNamespaces corev1client.NamespacesGetter
	// Pool sizes the pool of pre-created lease Secrets that takes the
	// Secret's create off a token issuance's critical path (pool.go); it
	// is kept only while RunPool runs.
	Pool lease.PoolConfig
	// PeerKeys holds the key sets peers upload (workloadIdentity
	// jwksFromPeer); nil refuses uploads and those peers' workload tokens.
	// While it is not synced the broker is not ready.
	PeerKeys *workload.PeerKeyStore
	// Gateway, if set, issues gateway leases (grants with access
	// gateway); without it they are refused with 422.
	Gateway *Gateway
}

// Gateway is what the broker needs to issue gateway leases: the issuer of
// lease certificates, and what their kubeconfig names as its cluster.
type Gateway struct {
	Issuer Issuer
	// Server is the gateway's URL as clients reach it.
	Server string
	// CAData returns the PEM of the CAs a client verifies the gateway's
	// serving certificate with, at each issuance (they rotate); empty
	// when there are none to give (the issuance is then refused).
	CAData func() []byte
}

// cluster is the kubeconfig cluster of a gateway lease: the policy's
// cluster name, the gateway's URL and CAs.
func (g *Gateway) cluster(c policy.ClusterSpec) (policy.ClusterSpec, error) {
	ca := g.CAData()
	if len(ca) == 0 {
		return policy.ClusterSpec{}, problem.Errorf(problem.KindUnavailable, "the lease gateway's serving certificate does not verify to the broker's CAs now, so no gateway kubeconfig can be written; see the broker's log")
	}
	return policy.ClusterSpec{Name: c.Name, Server: g.Server, CAData: string(ca)}, nil
}

// maxTimedExpiries bounds the leases waiting for their timer: the global
// lease quota's default.
const maxTimedExpiries = limits.DefaultMaxLiveLeasesTotal

// Broker is the domain core. It is safe for concurrent use.
type Broker struct {
	cfg        Config
	limits     *limits.Limiter
	enrollLim  *limits.EnrollLimiter
	reads      *limits.InFlight // lease reads waiting on the API server, by identity
	joinTokens enrollment.JoinTokenVerifier
	retries    *lease.Retries // failed lease deletions, retried until done
	// expiries are the leases revoked at their expiry (leaseexpiry.go),
	// at most maxTimedExpiries; past it the GC is the only revoker.
	expiries *lease.Timers
	// after makes the writes that follow an answer (afteranswer.go).
	after *lease.AfterAnswer
	// tenants is nil without Config.Namespaces.
	tenants *tenants.Tracker
	// activity is the issuances in flight, whose quiet moments the pool's
	// refill and the deferred credential-id writes wait for.
	activity *lease.Activity
	// pool is nil when disabled.
	pool *lease.Pool
	// gcPasses counts GC passes, to make every gcFullEvery-th a full one.
	gcPasses atomic.Uint64
	// rules holds the lease rules of the policy in force (leaseRules).
	rules tenants.RulesCache
}

// New checks cfg and returns a Broker.
func New(cfg Config) (*Broker, error) {
	if cfg.Secrets == nil || cfg.Policy == nil || cfg.Logger == nil {
		return nil, errors.New("broker: Secrets, Policy and Logger are required")
	}
	if cfg.Enrollment.CA != nil && cfg.Namespace == "" {
		return nil, errors.New("broker: Namespace is required with a CA (used join tokens are recorded there)")
	}
	if cfg.Enrollment.CertificateTTL == 0 {
		cfg.Enrollment.CertificateTTL = pki.DefaultClientLifetime
	}
	if cfg.Enrollment.CertificateTTL < policy.MinCertificateTTL || cfg.Enrollment.CertificateTTL > policy.MaxCertificateTTL {
		return nil, fmt.Errorf("broker: CertificateTTL must be between %s and %s", policy.MinCertificateTTL, policy.MaxCertificateTTL)
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.Rand == nil {
		cfg.Rand = rand.Reader
	}
	if cfg.CleanupTimeout == 0 {
		cfg.CleanupTimeout = 10 * time.Second
	}
	if cfg.MaxLiveLeases == 0 {
		cfg.MaxLiveLeases = limits.DefaultMaxLiveLeasesTotal
	}
	b := &Broker{cfg: cfg, joinTokens: cfg.Enrollment.JoinTokens, limits: limits.NewLimiter(cfg.Clock), enrollLim: limits.NewEnrollLimiter(cfg.Clock), reads: limits.NewInFlight(), retries: lease.NewRetries(cfg.Clock, cfg.Logger, cfg.Metrics.SetPendingDeletions), expiries: lease.NewTimers(cfg.Clock, maxTimedExpiries), after: lease.NewAfterAnswer(maxWritesAfterAnswers, inBackground), activity: new(lease.Activity)}
	b.pool = lease.NewPool(cfg.Pool, b.activity)
	if b.joinTokens == nil && cfg.Enrollment.CA != nil {
		b.joinTokens = enrollment.NewCAJoinTokens(cfg.Enrollment.CA, cfg.Enrollment.PreviousCA, b.joinTokenAudiences, cfg.Clock.Now)
	}
	if cfg.Namespaces != nil {
		t, err := tenants.NewTracker(cfg.Namespaces, cfg.Policy, cfg.Clock, cfg.Logger, cfg.Metrics, cfg.LiveNamespaces)
		if err != nil {
			return nil, fmt.Errorf("broker: watch namespaces: %w", err)
		}
		b.tenants = t
	}
	if cfg.Leases != nil {
		cfg.Leases.SetRules(b.leaseRules)
	}
	return b, nil
}

func (b *Broker) policy() (*policy.Policy, error) { return b.cfg.Policy.Current() }

// IssueKubeconfig authorizes req for caller, creates a lease Secret, mints
// a credential bound to it and returns the kubeconfig. On any failure the
// lease Secret is deleted again. req must have passed syntactic validation;
// the TTL strings are parsed again here so that the broker never trusts its
// caller. Every call ends in one audit event (ActionIssue).
func (b *Broker) IssueKubeconfig(ctx context.Context, c Caller, req apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
	start := b.cfg.Clock.Now()
	wait := new(apiWait)
	a := &audit.Pending{Event: c.event(audit.ActionIssue)}
	a.Event.Namespace, a.Event.ServiceAccount = req.Namespace, req.ServiceAccount
	a.Event.Credential, a.Event.RequestedTTL = policy.OrDefault(req.Credential, apiv1.CredentialToken), req.TTL
	if w := c.Workload; w != nil {
		a.Event.Workload, a.Event.WorkloadUID, a.Event.WorkloadPod, a.Event.WorkloadTokenJTI = w.String(), w.UID, w.Pod, w.TokenJTI
		a.Event.WorkloadPodUID = w.PodUID
	}
	b.activity.Start()
	defer func() {
		b.activity.Done(b.cfg.Clock.Now())
		if b.pool != nil {
			b.pool.Wake()
		}
	}()
	resp, outcome, err := b.issue(context.WithValue(ctx, apiWaitKey{}, wait), c, req, a)
	total := b.cfg.Clock.Since(start)
	b.cfg.Metrics.ObserveIssue(outcome, total, total-time.Duration(wait.d.Load()))
	b.concludeOutcome(ctx, a, outcome, err)
	return resp, err
}

// concludeOutcome concludes a kubeconfig or lease request by its outcome
// (outcomeGranted, or outcomeFor its error): the decision, and as the
// reason the caller-facing detail of err, which never holds a secret.
func (b *Broker) concludeOutcome(ctx context.Context, a *audit.Pending, outcome string, err error) {
	switch outcome {
	case outcomeGranted:
		b.recorder().Conclude(ctx, a, audit.DecisionAllow, "", "")
	case outcomeDenied:
		b.recorder().Conclude(ctx, a, audit.DecisionDeny, problem.Detail(err), audit.DenyNotGranted)
	case outcomeNotFound:
		b.recorder().Conclude(ctx, a, audit.DecisionDeny, problem.Detail(err), audit.DenyNotFound)
	case outcomeInvalid, outcomeUnprocessable:
		b.recorder().Conclude(ctx, a, audit.DecisionDeny, problem.Detail(err), audit.DenyInvalid)
	case outcomeLimited:
		b.recorder().Conclude(ctx, a, audit.DecisionDeny, problem.Detail(err), "")
	case outcomeUnavailable:
		b.recorder().Conclude(ctx, a, audit.DecisionError, "the Kubernetes API server is unavailable", "")
	default:
		b.recorder().Conclude(ctx, a, audit.DecisionError, "internal error", "")
	}
}

// apiWait adds up the time one request spends waiting on the API server,
// so that the broker's own time can be told apart from it.
type apiWait struct{ d atomic.Int64 }

type apiWaitKey struct{}

// timeAPI records an API server call that started at start and ended with
// err: in the per-call histogram, in the error counter and in the
// request's apiWait, if ctx carries one. It returns the call's duration.
func (b *Broker) timeAPI(ctx context.Context, call string, start time.Time, err error) time.Duration {
	d := b.cfg.Clock.Since(start)
	b.cfg.Metrics.ObserveAPI(call, d)
	if err != nil {
		b.cfg.Metrics.ObserveAPIError(call, problem.APIErrorReason(err))
	}
	if w, ok := ctx.Value(apiWaitKey{}).(*apiWait); ok {
		w.d.Add(int64(d))
	}
	return d
}

// timed is timeAPI for those that need no duration back (lease.Store,
// lease.Deleter).
func (b *Broker) timed(ctx context.Context, call string, start time.Time, err error) {
	b.timeAPI(ctx, call, start, err)
}

// decided is what decide found: the policy it read, its decision, the
// issuer of the decided credential kind, and the minTTL asked for.
type decided struct {
	policy.Decision
	policy    *policy.Policy
	issuer    Issuer
	requested time.Duration // the TTL asked for, 0 for the default
	minTTL    time.Duration
}

// decide is the policy's decision on req for c, shared by an issuance and
// an exec kubeconfig: parse the TTLs, decide, and find the issuer of the
// credential kind. On a refusal it returns the outcome to conclude a with
// (and sets a's denial); on success it names the peer in a.
func (b *Broker) decide(c Caller, req apiv1.KubeconfigRequest, a *audit.Pending, log *zap.Logger) (decided, string, error) {
	requested, minTTL, err := policy.ParseTTLs(req.TTL, req.MinTTL)
	if err != nil {
		return decided{}, outcomeInvalid, err
	}
	p, err := b.policy()
	if err != nil {
		return decided{}, outcomeError, err
	}
	d, err := p.DecideAccess(b.namespaceLabels(), c.Identity, c.Workload.Ref(), req.Namespace, req.ServiceAccount, req.Credential, req.Access, req.Audiences, requested, minTTL)
	if err != nil {
		if errors.Is(err, policy.ErrAudienceNotGranted) {
			// The caller is told only "forbidden"; the audit says why.
			a.Denial, a.Reason = policy.DenyAudience, policy.ErrAudienceNotGranted.Error()
		}
		log.Info("decision", zap.Bool("allowed", false), zap.String("reason", policy.OrDefault(a.Reason, problem.Detail(err))))
		if problem.KindOf(err) == problem.KindForbidden {
			return decided{}, outcomeDenied, err
		}
		a.Denial = audit.DenyMinTTL
		return decided{}, outcomeUnprocessable, err
	}
	a.Event.Peer, a.Event.Grant = d.Peer, d.Grant
	issuer := b.cfg.Issuers[d.Credential]
	if d.Access == apiv1.AccessGateway {
		a.Event.Access = apiv1.AccessGateway
		if issuer = nil; b.cfg.Gateway != nil {
			issuer = b.cfg.Gateway.Issuer
		}
		if issuer == nil {
			log.Info("decision", zap.Bool("allowed", false), zap.String("reason", "gateway not enabled"))
			a.Denial = audit.DenyCredential
			return decided{}, outcomeUnprocessable, problem.Errorf(problem.KindUnprocessable, "access gateway is not available from this broker: it runs no lease gateway (serve --gateway-address)")
		}
	}
	if issuer == nil {
		log.Info("decision", zap.Bool("allowed", false), zap.String("reason", "credential kind not enabled"))
		a.Denial = audit.DenyCredential
		return decided{}, outcomeUnprocessable, problem.Errorf(problem.KindUnprocessable, "credential %q is not available from this broker", d.Credential)
	}
	return decided{Decision: d, policy: p, issuer: issuer, requested: requested, minTTL: minTTL}, outcomeGranted, nil
}

func (b *Broker) issue(ctx context.Context, c Caller, req apiv1.KubeconfigRequest, a *audit.Pending) (*apiv1.KubeconfigResponse, string, error) {
	log := b.cfg.Logger.WithLazy(
		zap.String("identity", c.Identity),
		zap.String("namespace", req.Namespace),
		zap.String("service_account", req.ServiceAccount),
		zap.String("requested_ttl", req.TTL),
	)
	if c.Workload != nil {
		log = log.WithLazy(zap.String("workload", c.Workload.String()), zap.String("workload_token_jti", c.Workload.TokenJTI))
	}
	dec, outcome, err := b.decide(c, req, a, log)
	if err != nil {
		return nil, outcome, err
	}
	p, d, issuer, requested, minTTL := dec.policy, dec.Decision, dec.issuer, dec.requested, dec.minTTL
	place, err := b.admission().Lease(p, c.Identity, limitKey(c), d.Peer, a)
	if err != nil {
		return nil, outcomeLimited, err
	}
	if place != nil {
		defer place.Release() // a no-op once committed
	}
	// The lease's timer (expireLeaseAt) and the GC revoke it at its
	// expiry, however long its credential lives.
	credTTL, err := policy.FitIssuer(&d, issuer.Limits(), lease.MinTTL, minTTL)
	if err != nil {
		log.Info("decision", zap.Bool("allowed", false), zap.String("reason", "minTTL over the issuer's maximum"))
		a.Denial = audit.DenyMinTTL
		return nil, outcomeUnprocessable, err
	}

	k := kindOf(d)
	if outcome, err := k.prepare(ctx, b, p, d, req, a); err != nil {
		return nil, outcome, err
	}
	if a.Event.User != "" {
		log = log.WithLazy(zap.String("user", a.Event.User))
	}
	// Checked before any object is made: a gateway kubeconfig needs the
	// gateway's CAs.
	cluster, err := k.cluster(b, p)
	if err != nil {
		return nil, outcomeUnavailable, err
	}

	// A pooled Secret serves the kind as pool.go says: a token's
	// TokenRequest and claim at once, a gateway lease claimed after its
	// answer.
	var ready *lease.Pooled
	if k.pool() != poolNone {
		ready = b.pool.Take(req.Namespace, b.cfg.Clock.Now(), k.pool() == poolAfterAnswer)
	}
	if ready != nil && k.pool() == poolAfterAnswer && !b.stillPooled(ready) {
		// Deleted or edited since the pool made it: no certificate is
		// signed for it, and what is left of it goes.
		log.Info("lease pool: the pooled Secret is gone or was edited; issuing on the sequential path",
			zap.String("secret", ready.Secret.Namespace+"/"+ready.Secret.Name))
		gone := ready.Secret
		b.after.Go(ctx, b.cfg.CleanupTimeout, func(ctx context.Context) { b.deleteLease(ctx, gone, log) })
		ready = nil
	}
	var id string
	if ready != nil {
		id = ready.ID
	} else if id, err = lease.NewID(b.cfg.Rand); err != nil {
		return nil, outcomeError, err
	}
	a.Event.LeaseID = id
	log = log.WithLazy(zap.String("lease_id", id), zap.String("peer", d.Peer))
	now := b.cfg.Clock.Now()
	// The lease's expiry in whole seconds, as its annotation records it
	// and the GC and the timer revoke it: never later than asked.
	expected := now.Add(d.TTL).Truncate(time.Second)
	ls := b.leaseSecret(id, c, d, req, expected)
	grant := tenants.DecidedGrant(p, d)
	tenants.MarkRevokeOnUnmatch(ls, grant)
	ireq := issuers.Request{
		Namespace:      req.Namespace,
		ServiceAccount: req.ServiceAccount,
		TTL:            credTTL,
		Audiences:      req.Audiences,
		LeaseID:        id,
		Peer:           c.Identity,
	}
	k.shape(ls, &ireq)
	// From the moment a lease Secret exists, every failure must delete
	// it: no orphans.
	fail := func(created *corev1.Secret, outcome string, err error) (*apiv1.KubeconfigResponse, string, error) {
		b.deleteLease(ctx, created, log)
		log.Warn("decision", zap.Bool("allowed", true), zap.String("reason", "issuance failed"), zap.Error(err))
		return nil, outcome, err
	}
	iss, failed, outcome, err := b.issueOn(ctx, log, ready, ls, issuer, k, d.Credential, ireq, req)
	if err != nil {
		if failed == nil {
			return nil, outcome, err
		}
		return fail(failed, outcome, err)
	}
	created, cred := iss.created, iss.cred
	k.finish(&cred)

	granted, clampedBy, expiresAt := policy.Granted(d, cred.ExpiresAt, expected, iss.start, k.signed())
	if minTTL > 0 && granted < minTTL {
		a.Denial = audit.DenyMinTTL
		return fail(created, outcomeUnprocessable, problem.Errorf(problem.KindUnprocessable,
			"minTTL %s cannot be granted: the API server granted only %s", minTTL, granted))
	}
	// The audit names the credential without holding it: a token's jti,
	// a certificate's serial, and the id the API server logs for it.
	ref := cred.Ref()
	ref.APIID = k.apiID(ref)
	// If the API server or the signer shortened the credential, the
	// lease's true expiry (for listings and the GC) is recorded before the
	// answer (by the claim after it, for a gateway lease), with the
	// credential's id; otherwise the id follows the answer (afteranswer.go).
	idRecorded := false
	if clamped := clampedBy == policy.ClampedByAPIServer || clampedBy == policy.ClampedBySigner; clamped && iss.unclaimed {
		lease.SetExpiry(ls, cred.ExpiresAt)
	} else if clamped {
		if err := b.store().RecordCredential(ctx, created, ref.APIID, &cred.ExpiresAt); err != nil {
			return fail(created, outcomeFor(err), err)
		}
		idRecorded = true
	}

	if cred.Kind() != issuer.Kind() {
		return fail(created, outcomeError, fmt.Errorf("the %s issuer returned a %s credential", issuer.Kind(), cred.Kind()))
	}
	// The namespace may have left the grant since the decision.
	if err := b.recheckCoverage(ctx, grant, d, created, a, log); err != nil {
		return nil, outcomeDenied, err
	}
	kc, err := kubeconfig.Build(cluster, req.Namespace, k.subject(req), cred)
	if err != nil {
		return fail(created, outcomeError, fmt.Errorf("build kubeconfig: %w", err))
	}
	log.Info("decision", zap.Bool("allowed", true),
		zap.String("granted_ttl", granted.String()),
		zap.String("clamped_by", clampedBy),
		zap.Time("expires_at", expiresAt),
		zap.String(ref.LogKey, ref.Value))
	a.Event.GrantedTTL, a.Event.ClampedBy = granted.String(), clampedBy
	if cred.Kind() == issuers.KindToken {
		a.Event.TokenJTI = ref.Value
	} else {
		a.Event.CertificateSerial = ref.Value
	}
	a.Event.CredentialID = ref.APIID
	a.Event.ExpiresAt = expiresAt.UTC().Format(time.RFC3339)
	b.cfg.Metrics.ObserveGrant(d.Peer, req.Namespace, req.ServiceAccount, d.Credential, requested, granted, clampedBy)
	reqTTL := ""
	if requested != 0 {
		reqTTL = requested.String()
	}
	if place != nil {
		place.Commit(ls.Namespace, ls.Name, expiresAt)
	}
	if cred.ExpiresAt.After(expiresAt.Add(time.Second)) {
		// The credential outlives the lease: revoke it at the lease's
		// expiry, not up to a GC interval later.
		b.expireLeaseAt(created, cred.Kind(), expiresAt, log)
	}
	if !idRecorded {
		b.after.RecordCredentialID(ctx, b.store(), created, ref.APIID, log)
	}
	if iss.unclaimed {
		b.claimAfterAnswer(ctx, ready, ls, log)
	}
	return &apiv1.KubeconfigResponse{
		LeaseID:      id,
		Kubeconfig:   string(kc),
		Credential:   cred.Kind(),
		Token:        cred.Token,
		User:         a.Event.User,
		ExpiresAt:    expiresAt.UTC(),
		RequestedTTL: reqTTL,
		GrantedTTL:   granted.String(),
		ClampedBy:    clampedBy,
		Access:       d.Access,
	}, outcomeGranted, nil
}

// issued is a credential issued on its lease Secret: created (or, for a
// gateway lease answered before its claim, what the Secret is to be:
// unclaimed), and when the issuer was asked.
type issued struct {
	created   *corev1.Secret
	cred      issuers.Credential
	start     time.Time
	unclaimed bool
}

// issueOn issues the credential of kind k on the pooled Secret ready, as
// k.pool says, or on a Secret created first (the sequential path). On
// failure it returns the Secret the caller must delete (nil if none was
// made) and the outcome.
func (b *Broker) issueOn(ctx context.Context, log *zap.Logger, ready *lease.Pooled, ls *corev1.Secret, issuer Issuer, k kind, credKind string, ireq issuers.Request, req apiv1.KubeconfigRequest) (issued, *corev1.Secret, string, error) {
	if ready != nil && k.pool() == poolAfterAnswer {
		start := b.cfg.Clock.Now()
		created, cred, err := b.signPooled(ctx, ready, ls, issuer, credKind, ireq)
		if err != nil {
			err = classifyIssuer(err, req)
			return issued{}, ready.Secret, outcomeFor(err), err
		}
		b.cfg.Metrics.ObservePoolPath(pathPool)
		return issued{created: created, cred: cred, start: start, unclaimed: true}, nil, "", nil
	}
	if ready != nil {
		start := b.cfg.Clock.Now()
		claimed, cred, claimErr, issueErr := b.claim(ctx, ready, ls, issuer, credKind, ireq)
		switch {
		case problem.IsNotFound(claimErr):
			// Another replica's GC, its clock ahead, took the pooled
			// Secret: nothing is left to delete, and nothing stops the
			// sequential path.
			log.Info("lease pool: the claimed Secret was gone; issuing on the sequential path", zap.Error(claimErr))
		case apierrors.IsConflict(claimErr):
			// Edited since the pool made it: it goes, with the token
			// bound to it, and the sequential path issues another.
			log.Warn("lease pool: the claimed Secret was edited by someone else; deleting it and issuing on the sequential path", zap.Error(claimErr))
			b.deleteLease(ctx, ready.Secret, log)
		case claimErr != nil:
			// The pooled Secret goes, and a credential bound to it with it.
			err := problem.Classify(claimErr, "claim lease Secret", "pooled lease Secret vanished")
			return issued{}, ready.Secret, outcomeFor(err), err
		case issueErr != nil:
			err := classifyIssuer(issueErr, req)
			return issued{}, claimed, outcomeFor(err), err
		default:
			b.cfg.Metrics.ObservePoolPath(pathPool)
			return issued{created: claimed, cred: cred, start: start}, nil, "", nil
		}
	}
	if k.pool() != poolNone {
		b.cfg.Metrics.ObservePoolPath(pathSequential)
	}
	created, err := b.store().Create(ctx, ls, "create_lease")
	if err != nil {
		err = problem.Classify(err, "create lease Secret", fmt.Sprintf("namespace %q not found", req.Namespace))
		log.Warn("decision", zap.Bool("allowed", true), zap.String("reason", "lease creation failed"), zap.Error(err))
		if problem.KindOf(err) == problem.KindUnavailable && !neverSent(err) {
			// The API server may have stored the Secret and failed before
			// it answered. Its name is unique, so delete it by name once
			// the API server is back.
			b.cleanUpLater(ls, log)
		}
		return issued{}, nil, outcomeFor(err), err
	}
	start := b.cfg.Clock.Now()
	ireq.Lease = issuers.ObjectRef{Kind: "Secret", Name: created.Name, UID: created.UID}
	cred, err := issuer.Issue(ctx, ireq)
	b.cfg.Metrics.ObserveIssuer(credKind, b.timeAPI(ctx, "issue_"+credKind, start, err), err)
	if err != nil {
		err = classifyIssuer(err, req)
		return issued{}, created, outcomeFor(err), err
	}
	return issued{created: created, cred: cred, start: start}, nil, "", nil
}

// leaseSecret is the lease Secret of id that decision d makes for c.
func (b *Broker) leaseSecret(id string, c Caller, d policy.Decision, req apiv1.KubeconfigRequest, expires time.Time) *corev1.Secret {
	return lease.NewSecret(id, req.Namespace, lease.Holder{Peer: d.Peer, Identity: c.Identity, Workload: c.Workload.String()},
		req.ServiceAccount, d.Credential, d.Grant, expires)
}

// deleteLease removes a lease Secret after a failed request. It runs even
// when the request's context is done (the client may have gone away), with
// its own timeout; if it fails, the GC removes the Secret once it expires.
func (b *Broker) deleteLease(ctx context.Context, s *corev1.Secret, log *zap.Logger) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), b.cfg.CleanupTimeout)
	defer cancel()
	err := b.deleter().DeleteSecret(ctx, s)
	if err == nil {
		return
	}
	if problem.KindOf(problem.Classify(err, "", "")) != problem.KindUnavailable {
		log.Error("delete lease after failed request", zap.String("secret", s.Namespace+"/"+s.Name), zap.Error(err))
		return
	}
	// The API server went away between the lease and the token: keep
	// trying in the background, so that the lease is gone soon after it
	// is back rather than only when the GC sees it expire.
	log.Warn("delete lease after failed request: API server unavailable, retrying in the background",
		zap.String("secret", s.Namespace+"/"+s.Name), zap.Error(err))
	b.cleanUpLater(s, log)
}

// cleanUpLater queues s for deletion with backoff until it is gone
// (retry.go).
func (b *Broker) cleanUpLater(s *corev1.Secret, log *zap.Logger) {
	if !b.queueSecretDeletion(s, deleteFailed) {
		log.Error("the GC deletes this lease when it expires", zap.String("secret", s.Namespace+"/"+s.Name))
	}
}

// neverSent reports whether err says the request never reached the API
// server (the connection could not be made), so nothing can have been
// stored.
func neverSent(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// deleter revokes leases with the broker's clients, clock and API timing.
func (b *Broker) deleter() *lease.Deleter {
	return &lease.Deleter{Secrets: b.cfg.Secrets, RoleBindings: b.cfg.RoleBindings, Now: b.cfg.Clock.Now,
		Timed: b.timed}
}

// WhoAmI returns the policy name of the caller and the grants that apply:
// every grant of the peer, or, for a caller with a workload, the grants
// that workload gets.
func (b *Broker) WhoAmI(c Caller) (string, []apiv1.Grant) {
	p := b.cfg.Policy.Load()
	if p == nil {
		return "", []apiv1.Grant{}
	}
	return p.GrantsFor(c.Identity, c.Workload.Ref(), c.Workload != nil, b.tenants.Describe)
}

// namespaceLabels is what selector grants are decided from: the namespace
// cache, or nothing.
func (b *Broker) namespaceLabels() policy.NamespaceLabels {
	if b.tenants == nil {
		return nil
	}
	return b.tenants
}

// Ready reports whether a policy is loaded, the revocation list is synced
// and the API server answers.
func (b *Broker) Ready(ctx context.Context) error {
	if b.cfg.Policy.Load() == nil {
		return errors.New("no policy loaded")
	}
	if b.cfg.Enrollment.Revocations != nil && !b.cfg.Enrollment.Revocations.Synced() {
		return errors.New("revocation list not synced yet")
	}
	if b.cfg.Leases != nil && !b.cfg.Leases.Synced() {
		return errors.New("lease counts not synced yet")
	}
	if b.tenants != nil && !b.tenants.Synced() {
		return errors.New("namespace cache not synced yet")
	}
	if b.cfg.PeerKeys != nil && !b.cfg.PeerKeys.Synced() {
		return errors.New("peer key sets not synced yet")
	}
	if b.cfg.APIServerReady != nil {
		if err := b.cfg.APIServerReady(ctx); err != nil {
			return fmt.Errorf("API server not ready: %w", err)
		}
	}
	return nil
}
