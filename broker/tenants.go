package broker

import (
	"context"
	"time"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/tenants"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
)

// revoker revokes the leases of namespaces that left their selector
// grant (tenants.Revoker), with the broker's configuration as it is now;
// nil without a namespace informer.
func (b *Broker) revoker() *tenants.Revoker {
	if b.tenants == nil {
		return nil
	}
	return &tenants.Revoker{Tracker: b.tenants, Policy: b.cfg.Policy, Leases: b.store(), Deleter: b.deleter(),
		Audit: b.recorder(), Metrics: b.cfg.Metrics, Logger: b.cfg.Logger}
}

// RunTenants keeps selector grants true until ctx is done
// (tenants.Revoker.Run). A broker without a namespace informer returns at
// once.
func (b *Broker) RunTenants(ctx context.Context) {
	if r := b.revoker(); r != nil {
		r.Run(ctx)
	}
}

// queueUncovered queues the revocation of every lease its grant no longer
// covers (tenants.Revoker.QueueUncovered).
func (b *Broker) queueUncovered(ctx context.Context, reason string, fromCounter bool) {
	if r := b.revoker(); r != nil {
		r.QueueUncovered(ctx, reason, fromCounter)
	}
}

// leaseRules returns the rules of the policy in force
// (tenants.RulesCache), rebuilt only when the policy or the namespaces its
// selector grants match change.
func (b *Broker) leaseRules() *lease.Rules {
	var minTTL time.Duration
	for _, iss := range b.cfg.Issuers {
		minTTL = max(minTTL, iss.Limits().MinTTL)
	}
	return b.rules.Rules(b.cfg.Policy.Load(), b.tenants, minTTL)
}

// recheckCoverage closes the race between an issuance and a namespace
// leaving its grant: the revocation may list the namespace's leases after
// the decision and before the lease Secret exists (or while a pooled
// Secret's claim is in flight, when it is no lease yet), and so miss it.
// Called once the credential is minted and before it is answered, it
// looks again, at the namespace cache and the policy as they are now: the
// cache is updated before the revocation is queued, so a revocation that
// missed the lease is one this check sees. If the grant (one that revokes
// on unmatch) no longer covers the namespace, the lease is deleted, which
// revokes the credential nobody has seen, and the request is refused as
// any request there is now.
func (b *Broker) recheckCoverage(ctx context.Context, g *policy.GrantSpec, d policy.Decision, created *corev1.Secret, a *audit.Pending, log *zap.Logger) error {
	if g == nil || !g.KeptTrue() || b.tenants == nil {
		return nil
	}
	p := b.cfg.Policy.Load()
	if p != nil {
		if _, revoke := tenants.Uncovered(p, b.tenants, lease.RefOf(created)); !revoke {
			return nil
		}
	}
	b.deleteLease(ctx, created, log)
	a.Reason = "namespace " + created.Namespace + " is no longer covered by grant " + d.Grant + " (" + tenants.UnmatchDuringIssue + ")"
	log.Info("decision", zap.Bool("allowed", false), zap.String("reason", a.Reason))
	return problem.Errorf(problem.KindForbidden, "no grant allows this request")
}
