package execcred

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/agent/client"
	"github.com/tokenbroker/tokenbroker/pki"
)

// DefaultRefreshFraction is the part of a credential's granted life after
// which the plugin stops handing it out and issues a new one: a third of
// the life is left for whoever still uses the old one.
const DefaultRefreshFraction = 0.66

// Key is what makes two invocations ask for the same credential: the
// broker, who asks (the SPIFFE ID of the client certificate, so that a
// renewed certificate keeps its entry and another identity never shares
// one) and the request. Audiences are compared as a set.
type Key struct {
	Broker         string
	Identity       string
	Namespace      string
	ServiceAccount string
	Credential     string
	Audiences      []string
	TTL            string
	MinTTL         string
	// Workload is the workload whose token goes with the request
	// (WorkloadOf), "" for none: two workloads never share a cached
	// credential, since the broker may grant them different things.
	Workload string
	// Access is the access mode asked for ("" for the grant's): a gateway
	// credential is good at the gateway only, a direct one never there.
	Access string
}

// WorkloadOf names the workload of a workload token for Key.Workload: its
// issuer and subject (system:serviceaccount:<namespace>:<name>), read
// without verifying (the broker verifies). A token that is not a JWT with
// both is an error.
func WorkloadOf(token string) (string, error) {
	claims, err := pki.UnverifiedClaims(token)
	if err != nil || claims.Issuer == "" || !strings.HasPrefix(claims.Subject, "system:serviceaccount:") {
		return "", errors.New("the workload token is not a ServiceAccount token (a JWT with iss and sub system:serviceaccount:<namespace>:<name>)")
	}
	return claims.Issuer + " " + claims.Subject, nil
}

// ID is the key's name in the cache: the hex SHA-256 of its fields.
func (k Key) ID() string {
	aud := slices.Clone(k.Audiences)
	slices.Sort(aud)
	aud = slices.Compact(aud)
	fields := []any{"tokenbroker-credential-v1", k.Broker, k.Identity, k.Namespace, k.ServiceAccount, k.Credential, aud, k.TTL, k.MinTTL}
	if k.Workload != "" {
		// Appended only when set, so that the entries of callers without
		// a workload keep their names.
		fields = append(fields, "workload", k.Workload)
	}
	if k.Access != "" {
		// Likewise appended only when set.
		fields = append(fields, "access", k.Access)
	}
	b, err := json.Marshal(fields)
	if err != nil { // strings only: cannot happen
		panic(err)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// Credential is a credential the broker issued. Token and ClientKeyData
// are secrets: String and GoString leave them out.
type Credential struct {
	LeaseID string
	// Token, or ClientCertificateData and ClientKeyData (PEM).
	Token                 string
	ClientCertificateData string
	ClientKeyData         string
	// ObtainedAt is when the answer arrived, ExpiresAt when the credential
	// expires.
	ObtainedAt time.Time
	ExpiresAt  time.Time
	// RefreshAt is set by the Plugin: the refresh point.
	RefreshAt time.Time
	// Cluster is the cluster of the broker's kubeconfig (server and CA),
	// which the credential may be sent to; nil if unknown.
	Cluster *ClusterRef
}

// String describes the credential without its secrets.
func (c *Credential) String() string {
	if c == nil {
		return "<nil credential>"
	}
	return fmt.Sprintf("credential{lease %s, expires %s}", c.LeaseID, c.ExpiresAt.UTC().Format(time.RFC3339))
}

// GoString is String, so that %#v leaks nothing either.
func (c *Credential) GoString() string { return c.String() }

// Status is the plugin's answer for c: the credential, and its refresh
// point as the expiration, so that client-go runs the plugin again there
// (it has no margin of its own).
func (c *Credential) Status() Status {
	return Status{
		Token:                 c.Token,
		ClientCertificateData: c.ClientCertificateData,
		ClientKeyData:         c.ClientKeyData,
		Expiration:            c.RefreshAt,
	}
}

// IssueFunc asks the broker for a new credential, filling every field of
// Credential but RefreshAt.
type IssueFunc func(ctx context.Context) (*Credential, error)

// Outcome says how Plugin.Get came by its credential.
type Outcome string

// The outcomes of Plugin.Get.
const (
	// OutcomeHit: the cached credential, before its refresh point.
	OutcomeHit Outcome = "hit"
	// OutcomeMiss: no cache file; a new credential.
	OutcomeMiss Outcome = "miss"
	// OutcomeCorrupt: a cache file that could not be used; a new credential
	// replaced it.
	OutcomeCorrupt Outcome = "corrupt"
	// OutcomeRefresh: the cached credential reached its refresh point; a new
	// credential replaced it.
	OutcomeRefresh Outcome = "refresh"
	// OutcomeRefused: the process the cached credential was handed to asked
	// again before the refresh point, so the API server refused it; a new
	// credential replaced it.
	OutcomeRefused Outcome = "refused"
	// OutcomeUncached: no cache; a new credential.
	OutcomeUncached Outcome = "uncached"
	// OutcomeStale: the cached credential reached its refresh point and
	// the broker could not be reached (BrokerAway: a transport error, a
	// 5xx or a 429); the cached one, still valid, is handed out with an
	// expiration a minute away (StaleRetry). Never after the broker
	// refused (BrokerRefused: 401, 403), which drops the entry instead.
	OutcomeStale Outcome = "stale"
)

// StaleRetry is how soon client-go is told to come back for a credential
// handed out after its refresh point because the broker was away.
const StaleRetry = time.Minute

// Plugin decides, for each invocation, whether to hand out the cached
// credential or to issue a new one.
//
// # Refresh point
//
// A credential issued at obtainedAt and expiring at expiresAt is handed out
// until refreshAt = obtainedAt + RefreshFraction × (expiresAt − obtainedAt),
// in whole seconds, and that refreshAt is the expirationTimestamp client-go
// gets: client-go keeps a credential in memory until its expiration with no
// margin of its own, so a long-running program runs the plugin again
// exactly when the cache would no longer hand the credential out. If the
// broker cannot be reached then, the cached credential is handed out for
// the rest of its life, StaleRetry at a time, with a warning
// (OutcomeStale): the rest of the life is the margin for a broker that is
// away.
//
// # A credential the API server refused
//
// client-go runs an exec plugin again in two cases only
// (k8s.io/client-go/plugin/pkg/client/auth/exec, getCreds and
// maybeRefreshCreds): when the expiration it was given has passed, or when
// the API server answered 401 to the credential the plugin gave it, in the
// same process. Since the expiration is the refresh point, a process that
// runs the plugin a second time before the refresh point has had the
// credential refused: its lease was revoked, or the token was otherwise
// invalidated. So each entry records the parent processes (PID and start
// time, see Parent) it was handed to; when one of them asks again before
// the refresh point, the entry is dropped and a new credential issued.
// After a revocation, the next kubectl therefore fails once (its first
// request gets 401; client-go runs the plugin again, which caches a fresh
// credential) and the one after works; a controller recovers at its next
// request.
//
// The rule needs to know the parent, so it applies only when client-go ran
// the plugin (ExecInfo.FromClientGo): a person running the command twice
// from one shell is not taken for a refusal. A wrapper script that runs the
// plugin without exec hides kubectl behind a new process each time; then a
// refused credential is handed out until its refresh point.
type Plugin struct {
	// Clock decides hits and refresh points (k8s.io/utils/clock).
	Clock clock.PassiveClock
	// Cache is nil for --no-cache: every invocation issues a credential.
	Cache *Cache
	// RefreshFraction is in (0, 1); 0 means DefaultRefreshFraction.
	RefreshFraction float64
	// Warn is told of what does not stop the plugin, such as a cache file
	// that could not be written after a credential was issued. It may be
	// nil.
	Warn func(error)
	// Guard, if set, is the token-theft guard (CheckCluster against where
	// client-go will send the credential): a credential is handed out only
	// if Guard accepts its Cluster. A cached credential without a Cluster
	// is not handed out but replaced, and one Guard refuses is kept in the
	// cache (it is good for the right cluster) while Get returns Guard's
	// error. A newly issued credential is checked too; IssueFunc should
	// check before it issues, so that nothing is issued for a refusal.
	Guard func(*Credential) error
	// Wait sleeps for d or until ctx ends; nil means a real timer.
	Wait func(ctx context.Context, d time.Duration) error
}

func (p *Plugin) wait(ctx context.Context, d time.Duration) error {
	if p.Wait != nil {
		return p.Wait(ctx, d)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Get returns the credential for key, handed to parent, issuing one with
// issue when the cache has none to hand out (see Plugin). The cache is
// locked from the read to the write, so that parallel invocations for one
// key make one issuance. Errors: an unsafe cache (wrapping ErrUnsafeCache),
// a lock not obtained in time, and issue's errors, as they are (but see
// OutcomeStale); after a 401 or 403 of the broker the entry is gone.
func (p *Plugin) Get(ctx context.Context, key Key, parent Parent, issue IssueFunc) (*Credential, Outcome, error) {
	if p.Cache == nil {
		c, err := p.issue(ctx, issue)
		return c, OutcomeUncached, err
	}
	id := key.ID()
	unlock, err := p.Cache.lock(ctx, id)
	if err != nil {
		return nil, "", err
	}
	defer unlock()
	e, state, err := p.Cache.load(id)
	if err != nil {
		return nil, "", err
	}
	now := p.Clock.Now()
	outcome := OutcomeMiss
	switch {
	case state == stateCorrupt:
		outcome = OutcomeCorrupt
	case e == nil:
	case !now.Before(e.RefreshAt):
		outcome = OutcomeRefresh
	case parent.Known() && e.servedTo(parent):
		outcome = OutcomeRefused
		// Never hand the refused credential out again, even if no new
		// one can be issued now.
		if err := p.Cache.remove(id); err != nil {
			return nil, "", err
		}
	case p.Guard != nil && e.Cluster == nil:
		// Written without the guard: who knows where it may go.
	default:
		if p.Guard != nil {
			if err := p.Guard(e.credential()); err != nil {
				return nil, "", err
			}
		}
		if parent.Known() {
			e.serve(parent)
			if err := p.Cache.store(e); err != nil {
				p.warn(fmt.Errorf("record who was handed the cached credential: %w", err))
			}
		}
		return e.credential(), OutcomeHit, nil
	}
	c, err := p.issue(ctx, issue)
	if err != nil {
		if BrokerRefused(err) && state != stateMissing {
			// The broker no longer vouches for this identity or request
			// (a revoked identity, a narrowed policy): what it issued
			// before must not outlive that answer here.
			if rmErr := p.Cache.remove(id); rmErr != nil {
				p.warn(fmt.Errorf("drop the cached credential the broker no longer grants: %w", rmErr))
			}
			return nil, outcome, err
		}
		if outcome == OutcomeRefresh && now.Before(e.ExpiresAt) && BrokerAway(err) &&
			(p.Guard == nil || e.Cluster != nil && p.Guard(e.credential()) == nil) {
			stale := e.credential()
			stale.RefreshAt = now.Add(StaleRetry).Truncate(time.Second)
			if stale.RefreshAt.After(stale.ExpiresAt) {
				stale.RefreshAt = stale.ExpiresAt
			}
			p.warn(fmt.Errorf("no new credential (%w); the cached one is used until it expires at %s", err, e.ExpiresAt.UTC().Format(time.RFC3339)))
			return stale, OutcomeStale, nil
		}
		return nil, outcome, err
	}
	e = newEntry(id, key.Broker, c)
	e.serve(parent)
	if err := p.Cache.store(e); err != nil {
		p.warn(fmt.Errorf("the credential works but was not cached, so the next command asks the broker again: %w", err))
	}
	return c, outcome, nil
}

// BrokerAway reports whether err says the broker could not answer, so
// that a cached credential may stand in for a new one (OutcomeStale): a
// transport error (no connection, a timeout, a connection cut off), a 5xx
// or a 429. Any other answer of the broker is a decision, never covered
// up with a cached credential; nor is a broker that fails TLS verification
// (client.Retryable), or a local failure such as an unreadable identity.
func BrokerAway(err error) bool {
	var pe *client.ProblemError
	if errors.As(err, &pe) {
		return pe.Status >= 500 || pe.Status == http.StatusTooManyRequests
	}
	if errors.Is(err, ErrClusterMismatch) || !client.Retryable(err) {
		return false
	}
	var ue *url.Error
	var ne net.Error
	return errors.As(err, &ue) || errors.As(err, &ne) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, io.ErrUnexpectedEOF)
}

// BrokerRefused reports whether err is the broker's 401 or 403, or its
// refusal of the client certificate in the TLS handshake
// (client.ErrCertificateRefused: a revoked, expired or unknown
// certificate): it no longer accepts the caller's identity, or its policy
// no longer grants the request. The cache entry of the request is then
// dropped.
func BrokerRefused(err error) bool {
	if errors.Is(err, client.ErrCertificateRefused) {
		return true
	}
	var pe *client.ProblemError
	return errors.As(err, &pe) && (pe.Status == http.StatusUnauthorized || pe.Status == http.StatusForbidden)
}

// issueRetries bounds how often issue asks again when the broker says to
// retry in a moment (a 503 or 429 with Retry-After of at most
// issueRetryMax): e.g. a new Pod's token before the source cluster's agent
// reported the Pod, or a broker replica handing over.
const (
	issueRetries  = 3
	issueRetryMax = 2 * time.Second
)

// issue calls issue, again after the broker's Retry-After while it says to
// retry in a moment, and sets the refresh point.
func (p *Plugin) issue(ctx context.Context, issue IssueFunc) (*Credential, error) {
	c, err := issue(ctx)
	for attempt := 0; err != nil && attempt < issueRetries; attempt++ {
		var pe *client.ProblemError
		if !errors.As(err, &pe) || pe.Status != http.StatusServiceUnavailable && pe.Status != http.StatusTooManyRequests ||
			pe.RetryAfter <= 0 || pe.RetryAfter > issueRetryMax {
			break
		}
		if werr := p.wait(ctx, pe.RetryAfter); werr != nil {
			break
		}
		c, err = issue(ctx)
	}
	if err != nil {
		return nil, err
	}
	if c == nil || c.Token == "" && (c.ClientCertificateData == "" || c.ClientKeyData == "") {
		return nil, errors.New("the broker's answer holds neither a token nor a certificate and its key")
	}
	if p.Guard != nil {
		if c.Cluster == nil {
			return nil, fmt.Errorf("%w: the broker's kubeconfig names no cluster", ErrClusterMismatch)
		}
		if err := p.Guard(c); err != nil {
			return nil, err
		}
	}
	if !c.ExpiresAt.After(c.ObtainedAt) {
		return nil, fmt.Errorf("lease %s expired at %s, before it arrived", c.LeaseID, c.ExpiresAt.UTC().Format(time.RFC3339))
	}
	c.RefreshAt = RefreshPoint(c.ObtainedAt, c.ExpiresAt, p.fraction())
	return c, nil
}

func (p *Plugin) fraction() float64 {
	if p.RefreshFraction <= 0 || p.RefreshFraction >= 1 {
		return DefaultRefreshFraction
	}
	return p.RefreshFraction
}

func (p *Plugin) warn(err error) {
	if p.Warn != nil {
		p.Warn(err)
	}
}

// RefreshPoint is obtainedAt plus fraction of the life up to expiresAt,
// rounded down to whole seconds (the precision of the expirationTimestamp
// client-go reads, so that client-go's expiry and the cache's agree). A
// life too short to leave a whole second before expiry yields expiresAt.
func RefreshPoint(obtainedAt, expiresAt time.Time, fraction float64) time.Time {
	life := expiresAt.Sub(obtainedAt)
	at := obtainedAt.Add(time.Duration(float64(life) * fraction)).Truncate(time.Second)
	if !at.After(obtainedAt) || at.After(expiresAt) {
		return expiresAt
	}
	return at
}
