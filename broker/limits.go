package broker

import (
	"context"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/limits"
	"github.com/tokenbroker/tokenbroker/pki"
)

// admission applies the policy's limits (limits.Admission) with the
// broker's buckets, counter and metrics as configured now.
func (b *Broker) admission() *limits.Admission {
	return &limits.Admission{Buckets: b.limits, Enrollments: b.enrollLim, Reads: b.reads,
		Leases: b.cfg.Leases, MaxLiveLeases: b.cfg.MaxLiveLeases, Metrics: b.cfg.Metrics}
}

// admitLeaseRead applies the caller's lease read limits
// (limits.Admission.LeaseRead) under the policy in force.
func (b *Broker) admitLeaseRead(c Caller, a *audit.Pending) (done func(), err error) {
	p, err := b.policy()
	if err != nil {
		return nil, err
	}
	return b.admission().LeaseRead(p, c.Identity, limitKey(c), a)
}

// Limits is the peer's limits and usage, for whoami; nil for an identity
// the policy does not know.
func (b *Broker) Limits(c Caller) *apiv1.PeerLimits {
	p := b.cfg.Policy.Load()
	if p == nil {
		return nil
	}
	peer := p.Peer(c.Identity)
	if peer == nil {
		return nil
	}
	live := 0
	if b.cfg.Leases != nil {
		live, _ = b.cfg.Leases.Live(peer.Name)
	}
	return limits.Usage(p.LimitsFor(peer), live)
}

type remoteAddrKey struct{}

// WithRemoteAddr returns a context carrying the caller's network address
// (an IP, without the port), which keys the enrollment limits.
func WithRemoteAddr(ctx context.Context, addr string) context.Context {
	return context.WithValue(ctx, remoteAddrKey{}, addr)
}

// RemoteAddr returns the address WithRemoteAddr put in ctx, or "".
func RemoteAddr(ctx context.Context) string {
	a, _ := ctx.Value(remoteAddrKey{}).(string)
	return a
}

// limitKey names whose buckets a request takes from: the peer's, or, for
// a workload that proved itself with its own pod certificate, that
// workload's own (with the peer's figures), so that one workload of the
// source cluster cannot drain what the peer's agent needs.
func limitKey(c Caller) string {
	if w := c.Workload; w != nil && w.PodCertificate {
		if id, err := pki.WorkloadIdentity(c.Identity, w.Namespace, w.ServiceAccount); err == nil {
			return id
		}
	}
	return c.Identity
}
