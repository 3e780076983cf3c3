package agent

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"sync"
	"time"

	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/pki"

	"go.uber.org/zap"

	"github.com/tokenbroker/tokenbroker/agent/client"
)

// saveTimeout bounds storing a renewed identity; it runs on a context
// that shutdown does not cancel, so that a certificate the broker already
// issued is not lost.
const saveTimeout = 30 * time.Second

// renewer renews the agent's client certificate at renewAt of its
// lifetime, through one broker's mTLS listener. Like the refresher, its
// loop is a step function over an injected clock.
//
// A renewed identity goes into service only after the store holds it, so
// a failure at any point leaves the working certificate in place, on disk
// and in memory.
type renewer struct {
	store     identityStore
	holder    *identityHolder
	api       renewAPI
	sched     schedule
	clock     clock.Clock
	log       *zap.Logger
	metrics   *metrics
	onRenewed func()
	// trust, if set (identity.trustBundleFrom), is the broker CAs in
	// service from ClusterTrustBundles: they vouch for a renewal answer's
	// CAs too, so that after a CA rotation the new CA, which the bundles
	// already carry, is kept in the stored ca.crt.
	trust func() *trustState
	// wantClusterCA asks for the cluster's CA at every renewal, also when
	// the identity in service has none yet (the agent signs pod
	// certificates). Without it a renewal asks for none, and an identity
	// that has one loses it. A broker that refuses the CA (it signs none)
	// still renews the certificate: the CA is then dropped, counted and
	// logged, and asked for again at the next renewal.
	wantClusterCA bool

	forCert    *x509.Certificate // the certificate renewAt was computed for
	renewAt    time.Time
	retryAfter time.Duration

	mu       sync.Mutex // guards failures and next, read by health checks
	failures int
	next     time.Time
}

func (r *renewer) run(ctx context.Context) { runSteps(ctx, r.clock, r.step) }

// step renews if due and returns when to run again.
func (r *renewer) step(ctx context.Context) time.Time {
	cur := r.holder.get()
	if cur.leaf() != r.forCert {
		r.forCert = cur.leaf()
		r.renewAt = r.sched.refreshAt(certGrant(cur.leaf(), r.clock.Now()))
		if r.wantClusterCA != (cur.clusterCA != nil) {
			// The pod signer was turned on for an identity without a
			// cluster CA: renew now to get one, not at half-life. Or it
			// was turned off: renew now, so that the CA's key, which
			// nothing uses, leaves the store.
			r.renewAt = r.clock.Now()
		}
		r.setNext(0, r.renewAt)
	}
	now := r.clock.Now()
	if now.Before(r.nextAttempt()) {
		return r.nextAttempt()
	}
	trusted := r.trusted(ctx, cur)
	next, resp, err := renewIdentity(ctx, r.api, cur, trusted, now, r.wantClusterCA)
	if r.wantClusterCA && clusterCARefused(err) {
		// The client certificate is what every target needs: renew it
		// without the CA rather than let it expire. The pod signer waits
		// (its requests are retried) until a renewal gets one.
		r.metrics.clusterCARefusals.Inc()
		r.log.Error("the broker signs no cluster CA (tokenbroker serve --sign-cluster-cas); renewing the client certificate without it: no pod certificates are signed until a renewal gets one",
			zap.Time("certificate_expires_at", cur.leaf().NotAfter), zap.Bool("had_cluster_ca", cur.clusterCA != nil), zap.Error(err))
		next, resp, err = renewIdentity(ctx, r.api, cur, trusted, now, false)
	}
	if err == nil {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), saveTimeout)
		err = r.store.save(sctx, next)
		cancel()
	}
	if err != nil {
		if ctx.Err() != nil {
			return now
		}
		var pe *client.ProblemError
		if errors.As(err, &pe) {
			r.retryAfter = pe.RetryAfter
		}
		failures := r.failuresSoFar() + 1
		at := now.Add(r.sched.next(now, nil, failures, r.retryAfter))
		r.setNext(failures, at)
		r.metrics.renewals.WithLabelValues(resultFailure).Inc()
		r.log.Error("certificate renewal failed; the current certificate stays in service",
			zap.Int("failures", failures), zap.Time("next_attempt", at),
			zap.Time("certificate_expires_at", cur.leaf().NotAfter), zap.Error(err))
		return at
	}
	r.holder.set(next)
	if r.onRenewed != nil {
		r.onRenewed()
	}
	r.retryAfter = 0
	r.metrics.renewals.WithLabelValues(resultSuccess).Inc()
	r.forCert = next.leaf()
	r.renewAt = r.sched.refreshAt(certGrant(next.leaf(), now))
	r.setNext(0, r.renewAt)
	fields := []zap.Field{zap.String("identity", next.spiffeID), zap.String("serial", resp.SerialNumber),
		zap.Time("not_after", next.leaf().NotAfter), zap.Time("next_renewal", r.renewAt),
		zap.String("store", r.store.String())}
	if ca := next.clusterCA; ca != nil {
		fields = append(fields, zap.String("cluster_ca_serial", ca.ca.Certificate().SerialNumber.Text(16)),
			zap.Time("cluster_ca_not_after", ca.ca.Certificate().NotAfter))
	}
	r.log.Info("client certificate renewed", fields...)
	return r.renewAt
}

// trusted is the trust bundle a renewal answer is checked against: the one
// in service, the stored one when an operator replaced ca.crt (or the
// Secret's ca.crt) since it was loaded, which is how a new CA reaches a
// running agent during a rotation (docs/pki.md), and, with
// identity.trustBundleFrom, the CAs in service from ClusterTrustBundles,
// which is how it reaches an agent that trusts brokers through them. A store that cannot be
// read leaves the bundle in service alone.
func (r *renewer) trusted(ctx context.Context, cur *identity) []byte {
	out := append([]byte(nil), cur.bundlePEM...)
	if stored, err := r.store.load(ctx); err == nil && !bytes.Equal(stored.bundlePEM, cur.bundlePEM) {
		out = append(out, stored.bundlePEM...)
	}
	return append(out, trustInService(r.trust)...)
}

// trustInService is the PEM of the CAs trust has in service, nothing when
// trust is nil, has not read yet or trusts nothing.
func trustInService(trust func() *trustState) []byte {
	if trust == nil {
		return nil
	}
	if st := trust(); st != nil && st.err == nil {
		return st.pem
	}
	return nil
}

func (r *renewer) setNext(failures int, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures, r.next = failures, at
}

func (r *renewer) nextAttempt() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.next
}

func (r *renewer) failuresSoFar() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failures
}

// certGrant is the lifetime renewAt applies to: from when the certificate
// was issued to its NotAfter. The CA backdates NotBefore by pki.Backdate
// against clock skew; measured from NotBefore, a short certificate with a
// small renewAt would be due the moment it was issued, and the agent would
// renew in a loop.
func certGrant(cert *x509.Certificate, now time.Time) grant {
	issued := cert.NotBefore.Add(pki.Backdate)
	if issued.After(now) {
		issued = now
	}
	if issued.Before(cert.NotBefore) || !issued.Before(cert.NotAfter) {
		issued = cert.NotBefore
	}
	return grant{obtainedAt: issued, expiresAt: cert.NotAfter}
}
