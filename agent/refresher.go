package agent

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/agent/client"
	"github.com/tokenbroker/tokenbroker/agent/config"
)

// writeTimeout bounds the writes of one credential to all outputs. Writes
// run on a context that shutdown does not cancel, so that a credential
// already obtained reaches every output before the agent exits.
const writeTimeout = 30 * time.Second

// revokeTimeout bounds one revocation.
const revokeTimeout = 30 * time.Second

// brokerAPI is what a refresher needs from its broker; *client.Client
// implements it.
type brokerAPI interface {
	KubeconfigAPI
	RevokeLease(ctx context.Context, id string) error
}

// refresher keeps one target's credential fresh in all its outputs.
//
// Its loop is step: do whatever is due now (revoke replaced leases whose
// grace is over, refresh), then say when to wake next. All decisions read
// time from the injected Clock and randomness from the schedule's Rand, so
// tests call step with a fake clock and check the outcome without
// goroutines or sleeps.
//
// Invariants: outputs are written only with a credential that was fetched
// and checked (a failed fetch touches nothing); a lease is revoked only
// after every output holds its successor, and only revokeGrace later.
type refresher struct {
	name    string
	req     config.RequestConfig
	meta    outputMeta
	api     brokerAPI
	outputs []output
	sched   schedule
	grace   time.Duration
	clock   clock.Clock
	log     *zap.Logger
	metrics *metrics
	// slots bounds how many targets step at once (nil: no bound).
	slots stepSlots

	// The loop's own state, touched only by the goroutine running step.
	started bool
	// cur is the newest credential obtained (or adopted from the outputs
	// at start); its Kubeconfig is nil when it was adopted from outputs
	// that do not hold a whole kubeconfig.
	cur *Credential
	// curRevoked: cur's lease was revoked once written, as no output
	// holds the credential itself.
	curRevoked bool
	refreshAt  time.Time // when cur is due for replacement
	stale      []string  // leases to revoke once every output holds cur
	revokes    []revocation
	retryAfter time.Duration

	mu sync.Mutex // guards st, read by health checks and metrics
	st targetStatus
}

type revocation struct {
	leaseID string
	due     time.Time
}

// targetStatus is what health checks and metrics read.
type targetStatus struct {
	// held is, per output, the credential it holds (nil: none yet).
	held        []*grant
	failures    int
	nextAttempt time.Time
	lastErr     string
}

// expiry is the earliest expiry among the credentials the outputs hold:
// the consumer worst off decides.
func (s targetStatus) expiry() (time.Time, bool) {
	var exp time.Time
	ok := false
	for _, g := range s.held {
		if g != nil && (!ok || g.expiresAt.Before(exp)) {
			exp, ok = g.expiresAt, true
		}
	}
	return exp, ok
}

// ready reports whether every output holds a credential.
func (s targetStatus) ready() bool {
	for _, g := range s.held {
		if g == nil {
			return false
		}
	}
	return len(s.held) > 0
}

func (r *refresher) status() targetStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.st
	st.held = slices.Clone(r.st.held)
	return st
}

func (r *refresher) update(fn func(*targetStatus)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.st.held == nil {
		r.st.held = make([]*grant, len(r.outputs))
	}
	fn(&r.st)
}

// run steps until ctx is done. Shutdown stops the timers; it does not
// revoke the current lease (consumers keep working) and drops the pending
// revocations of replaced leases, which expire by themselves.
func (r *refresher) run(ctx context.Context) {
	runSteps(ctx, r.clock, func(ctx context.Context) time.Time { return r.slots.do(ctx, r.step) })
	if n := len(r.revokes); n > 0 {
		r.log.Info("shutting down; replaced leases will expire by themselves", zap.Int("pending_revocations", n))
	}
}

// step does what is due at the clock's now and returns when it wants to
// run again.
func (r *refresher) step(ctx context.Context) time.Time {
	if !r.started {
		r.recover(ctx)
		r.started = true
	}
	r.revokeDue(ctx)
	if !r.clock.Now().Before(r.status().nextAttempt) {
		r.attempt(ctx)
	}
	wake := r.status().nextAttempt
	for _, rv := range r.revokes {
		if rv.due.Before(wake) {
			wake = rv.due
		}
	}
	return wake
}

// recover looks at what the outputs hold from a previous run. A credential
// of this target and request that is still valid is adopted: the refresh
// is scheduled from it instead of fetching at once, so that restarts cause
// no churn. If some outputs lack it, it is written to them (when an output
// holds its whole kubeconfig) or a new one is fetched. Leases of this
// target found in outputs and not adopted are revoked once every output
// holds a newer credential.
func (r *refresher) recover(ctx context.Context) {
	now := r.clock.Now()
	found := make([]*stored, len(r.outputs))
	var leases []string
	var best *stored
	for i, o := range r.outputs {
		st, err := o.read(ctx)
		if err != nil {
			r.log.Warn("cannot read what an output holds from a previous run", zap.String("output", o.String()), zap.Error(err))
			continue
		}
		if st == nil || st.target != r.name {
			continue
		}
		if !slices.Contains(leases, st.leaseID) {
			leases = append(leases, st.leaseID)
		}
		if st.request != r.meta.request || !now.Before(st.expiresAt) {
			continue
		}
		found[i] = st
		if best == nil || st.expiresAt.After(best.expiresAt) {
			best = st
		}
	}
	if best == nil {
		r.stale = leases
		r.update(func(s *targetStatus) { s.nextAttempt = now })
		r.log.Info("no valid credential in the outputs; fetching one", zap.Int("old_leases", len(leases)))
		return
	}

	cred := &Credential{LeaseID: best.leaseID, ObtainedAt: best.obtainedAt, ExpiresAt: best.expiresAt}
	held := make([]*grant, len(r.outputs))
	for i, st := range found {
		if st == nil || st.leaseID != best.leaseID {
			continue
		}
		if cred.Kubeconfig == nil && st.kubeconfig != nil {
			if kc, err := parseKubeconfig(st.kubeconfig); err == nil {
				cred.setKubeconfig(st.kubeconfig, kc)
			}
		}
		if st.outdated {
			// It holds the lease under old settings (a renamed key, a
			// label, an Argo CD option): not held, so it is written again,
			// with this credential if some output holds its kubeconfig,
			// else with a new one.
			continue
		}
		held[i] = &grant{leaseID: best.leaseID, obtainedAt: best.obtainedAt, expiresAt: best.expiresAt}
	}
	if cred.ObtainedAt.IsZero() {
		// Older records lack it: the token's iat, else now, which only
		// delays the refresh within the credential's remaining lifetime.
		cred.ObtainedAt = now
		if iat, ok := tokenIssuedAt(cred.Token); ok && iat.Before(now) {
			cred.ObtainedAt = iat
		}
		for _, g := range held {
			if g != nil {
				g.obtainedAt = cred.ObtainedAt
			}
		}
	}
	r.stale = slices.DeleteFunc(leases, func(id string) bool { return id == best.leaseID })
	r.cur = cred
	r.refreshAt = r.sched.refreshAt(cred.grant())
	allHold := !slices.Contains(held, nil)
	next := now
	switch {
	case allHold:
		next = r.refreshAt
		r.scheduleRevocations(now)
		r.log.Info("adopted the credential the outputs hold",
			zap.String("lease_id", cred.LeaseID), zap.Time("expires_at", cred.ExpiresAt), zap.Time("next_refresh", r.refreshAt))
	case cred.Kubeconfig != nil:
		r.log.Info("adopted a credential some outputs hold; writing it to the others",
			zap.String("lease_id", cred.LeaseID), zap.Time("expires_at", cred.ExpiresAt))
	default:
		// Nothing to write the missing outputs with: fetch, and retire
		// the lease found once the new one is everywhere.
		r.stale = append(r.stale, cred.LeaseID)
		r.cur = nil
		r.log.Info("some outputs lack the credential and none holds its kubeconfig; fetching one",
			zap.String("lease_id", cred.LeaseID))
	}
	r.update(func(s *targetStatus) {
		s.held = held
		s.nextAttempt = next
	})
}

// attempt fetches a new credential if the one held is due (or there is
// none, or it cannot be written), then writes it to every output.
func (r *refresher) attempt(ctx context.Context) {
	now := r.clock.Now()
	if r.cur == nil || r.cur.Kubeconfig == nil || !now.Before(r.refreshAt) {
		cred, err := Fetch(ctx, r.api, r.req, r.clock.Now)
		if err != nil {
			if ctx.Err() != nil {
				return // shutting down
			}
			r.reportHealth(ctx, err)
			r.fail(now, err)
			return
		}
		if r.cur != nil && !r.curRevoked && !slices.Contains(r.stale, r.cur.LeaseID) {
			r.stale = append(r.stale, r.cur.LeaseID)
		}
		r.cur, r.curRevoked = cred, false
		r.refreshAt = r.sched.refreshAt(cred.grant())
		r.log.Info("obtained a credential",
			zap.String("lease_id", cred.LeaseID), zap.Time("expires_at", cred.ExpiresAt),
			zap.String("granted_ttl", cred.GrantedTTL), zap.String("clamped_by", cred.ClampedBy))
		if left := cred.ExpiresAt.Sub(r.refreshAt); left < r.grace {
			// The config check covers a ttl it knows; this is a lifetime
			// the broker chose or clamped.
			r.log.Warn("revokeGrace is longer than what is left of this credential when it is replaced: consumers will see it expire before the grace ends; shorten refresh.revokeGrace or lower refresh.fraction",
				zap.String("lease_id", cred.LeaseID), zap.Duration("revoke_grace", r.grace), zap.Duration("left_at_refresh", left.Round(time.Second)))
		}
	}
	if err := r.writeAll(ctx, r.cur); err != nil {
		r.fail(r.clock.Now(), err)
		return
	}
	done := r.clock.Now()
	r.metrics.refresh.WithLabelValues(r.name, resultSuccess).Inc()
	r.metrics.lastSuccess.WithLabelValues(r.name).Set(float64(done.UnixNano()) / 1e9)
	r.scheduleRevocations(done)
	if !r.curRevoked && !slices.ContainsFunc(r.outputs, holdsCredential) {
		// No output holds the credential (Argo CD's exec mode): the
		// lease only told the agent the cluster entry. Revoke it now.
		r.revokes = append(r.revokes, revocation{leaseID: r.cur.LeaseID, due: done})
		r.curRevoked = true
	}
	r.retryAfter = 0
	r.update(func(s *targetStatus) {
		s.failures = 0
		s.lastErr = ""
		s.nextAttempt = r.refreshAt
	})
	r.log.Info("credential in every output",
		zap.String("lease_id", r.cur.LeaseID), zap.Time("expires_at", r.cur.ExpiresAt), zap.Time("next_refresh", r.refreshAt))
}

// writeAll writes c to every output; outputs that already hold it are not
// touched. It returns an error if any output failed.
func (r *refresher) writeAll(ctx context.Context, c *Credential) error {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), writeTimeout)
	defer cancel()
	var errs []error
	for i, o := range r.outputs {
		wrote, err := o.write(wctx, r.meta, c)
		res := resultUnchanged
		switch {
		case err != nil:
			res = resultFailed
			errs = append(errs, err)
			r.log.Error("cannot write an output; it keeps what it holds",
				zap.String("output", o.String()), zap.String("lease_id", c.LeaseID), zap.Error(err))
		case wrote:
			res = resultWritten
			r.log.Debug("output written", zap.String("output", o.String()), zap.String("lease_id", c.LeaseID))
		}
		r.metrics.outputWrites.WithLabelValues(r.name, o.String(), string(res)).Inc()
		if err == nil {
			g := c.grant()
			r.update(func(s *targetStatus) { s.held[i] = &g })
		}
	}
	return errors.Join(errs...)
}

// fail records a failed attempt and schedules the retry. The outputs keep
// what they hold.
// reportHealth tells the outputs that report the broker's health (a
// ClusterProfile the agent manages) that the broker did not issue.
func (r *refresher) reportHealth(ctx context.Context, cause error) {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), writeTimeout)
	defer cancel()
	for _, o := range r.outputs {
		h, ok := o.(healthReporter)
		if !ok {
			continue
		}
		wrote, err := h.reportHealth(wctx, r.meta, cause)
		switch {
		case err != nil:
			r.log.Warn("cannot report the broker's health", zap.String("output", o.String()), zap.Error(err))
		case wrote:
			r.log.Info("reported the broker unhealthy", zap.String("output", o.String()))
		}
	}
}

func (r *refresher) fail(now time.Time, err error) {
	var pe *client.ProblemError
	if errors.As(err, &pe) {
		r.retryAfter = pe.RetryAfter
	}
	var failures int
	r.update(func(s *targetStatus) {
		s.failures++
		failures = s.failures
		var last *grant
		if r.cur != nil {
			g := r.cur.grant()
			last = &g
		}
		s.nextAttempt = now.Add(r.sched.next(now, last, s.failures, r.retryAfter))
		s.lastErr = err.Error()
	})
	r.metrics.refresh.WithLabelValues(r.name, resultFailure).Inc()
	st := r.status()
	fields := []zap.Field{zap.Int("failures", failures), zap.Time("next_attempt", st.nextAttempt), zap.Error(err)}
	if exp, ok := st.expiry(); ok {
		fields = append(fields, zap.Time("credential_expires_at", exp))
	}
	r.log.Warn("refresh failed; the outputs keep their credential", fields...)
}

// scheduleRevocations retires the stale leases revokeGrace after now; call
// it only once every output holds the current credential.
func (r *refresher) scheduleRevocations(now time.Time) {
	for _, id := range r.stale {
		r.revokes = append(r.revokes, revocation{leaseID: id, due: now.Add(r.grace)})
	}
	r.stale = nil
}

// revokeDue revokes the leases whose grace is over. A failure is logged
// and counted, not retried: the lease expires anyway.
func (r *refresher) revokeDue(ctx context.Context) {
	now := r.clock.Now()
	keep := r.revokes[:0]
	for _, rv := range r.revokes {
		if now.Before(rv.due) || ctx.Err() != nil {
			keep = append(keep, rv)
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, revokeTimeout)
		err := r.api.RevokeLease(rctx, rv.leaseID)
		cancel()
		var pe *client.ProblemError
		switch {
		case err == nil:
			r.metrics.revocations.WithLabelValues(r.name, resultSuccess).Inc()
			r.log.Info("revoked the replaced lease", zap.String("lease_id", rv.leaseID))
		case errors.As(err, &pe) && pe.Status == http.StatusNotFound:
			// Already gone (expired and collected, or revoked): done.
			r.metrics.revocations.WithLabelValues(r.name, resultSuccess).Inc()
			r.log.Info("the replaced lease is already gone", zap.String("lease_id", rv.leaseID))
		case ctx.Err() != nil:
			keep = append(keep, rv)
		default:
			r.metrics.revocations.WithLabelValues(r.name, resultFailure).Inc()
			r.log.Warn("cannot revoke the replaced lease; it expires by itself", zap.String("lease_id", rv.leaseID), zap.Error(err))
		}
	}
	r.revokes = keep
}
