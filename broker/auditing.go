package broker

import (
	"context"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/pki"
)

// RefuseCaller records a caller the transport refused (401) in the audit
// trail and the denial metrics: c holds what is known of it (identity and
// certificate fingerprint, either may be empty), code is one of the
// Refused* constants and reason says why. A pod certificate refused as
// revoked (audit.RefusedRevoked: the transport read its chain first)
// names its Pod as AuthenticatePodCertificate's refusals do: agent_pod
// for the peer's agent, else workload_pod.
func (b *Broker) RefuseCaller(ctx context.Context, c Caller, code, reason string) {
	a := &audit.Pending{Event: c.event(audit.ActionAuthenticate)}
	if cert := c.Certificate; code == audit.RefusedRevoked && pki.IsWorkloadCertificate(cert) {
		cluster, ns, sa, _ := pki.ParseWorkloadIdentity(cert.URIs[0].String())
		pod, uid := cert.Subject.CommonName, cert.Subject.SerialNumber
		if p := b.cfg.Policy.Load(); p != nil && cluster == c.Identity && p.Peer(cluster).IsAgent(ns, sa) {
			a.Event.AgentPod, a.Event.AgentPodUID = ns+"/"+pod, uid
		} else {
			a.Event.Workload, a.Event.WorkloadPod, a.Event.WorkloadPodUID = ns+"/"+sa, pod, uid
		}
	}
	b.recorder().Conclude(ctx, a, audit.DecisionDeny, reason, code)
}

// recorder writes the broker's audit events with its clock and metrics,
// as configured now.
func (b *Broker) recorder() *audit.Recorder {
	return &audit.Recorder{Auditor: b.cfg.Auditor, Now: b.cfg.Clock.Now, Logger: b.cfg.Logger, Metrics: b.cfg.Metrics}
}
