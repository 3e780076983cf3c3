package broker

import (
	"crypto/x509"

	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Caller is the authenticated peer making a request, as the transport layer
// established it from a verified client certificate.
type Caller struct {
	// Identity is the SPIFFE ID from the certificate's URI SAN,
	// e.g. spiffe://oc.example/cluster/west.
	Identity string
	// CertSHA256 is the "sha256:<hex>" fingerprint of the client certificate,
	// for audit logs.
	CertSHA256 string
	// Certificate is the verified client certificate itself; renewal
	// checks that the signing CA (or the previous one, during a
	// rotation) issued it. Nil refuses renewal.
	Certificate *x509.Certificate
	// Workload, if set, is the workload of the peer's cluster that asks,
	// proven by its ServiceAccount token (AuthenticateWorkload). Nil: the
	// request carried no workload token.
	Workload *workload.Identity
	// Agent, if set, is what the pod certificate of the cluster's agent
	// (the policy's peers[].agent) says of its Pod: that certificate
	// proved the caller to be the peer itself (AuthenticatePodCertificate),
	// which Workload does not narrow unless a workload token beside it
	// names a workload. Its audit events name the Pod.
	Agent *pki.PodWorkload
}

// event is an audit event of action that c asks for: who asks and, for
// the agent's pod certificate, which of its Pods (agent_pod,
// agent_pod_uid), so that the trail tells a Pod of the agent from the
// peer's client certificate and from another of its Pods.
func (c Caller) event(action string) audit.Event {
	ev := audit.Event{Action: action, Identity: c.Identity, CertSHA256: c.CertSHA256}
	if a := c.Agent; a != nil {
		ev.AgentPod, ev.AgentPodUID = a.Namespace+"/"+a.PodName, a.PodUID
	}
	return ev
}
