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
		p := b.cfg.Policy.Load()
		agent := p != nil && cluster == c.Identity && p.Peer(cluster).IsAgent(ns, sa)
		namePod(&a.Event, agent, ns, sa, pod, uid)
	}
	b.recorder().Conclude(ctx, a, audit.DecisionDeny, reason, code)
}

// namePod names in ev the Pod of a refused pod certificate of the
// workload namespace/serviceAccount: agent_pod for the peer's agent (which
// is no workload), else the workload and its Pod.
func namePod(ev *audit.Event, agent bool, namespace, serviceAccount, pod, uid string) {
	if agent {
		ev.AgentPod, ev.AgentPodUID = namespace+"/"+pod, uid
		return
	}
	ev.Workload, ev.WorkloadPod, ev.WorkloadPodUID = namespace+"/"+serviceAccount, pod, uid
}

// recorder writes the broker's audit events with its clock and metrics,
// as configured now.
func (b *Broker) recorder() *audit.Recorder {
	return &audit.Recorder{Auditor: b.cfg.Auditor, Now: b.cfg.Clock.Now, Logger: b.cfg.Logger, Metrics: b.cfg.Metrics}
}
