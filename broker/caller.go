package broker

import (
	"crypto/x509"

	"github.com/tokenbroker/tokenbroker/broker/policy"
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
	Workload *Workload
}

// Workload is a verified ServiceAccount of the caller's (source) cluster.
type Workload struct {
	Namespace      string
	ServiceAccount string
	// UID is the ServiceAccount's uid, Pod the pod the token is bound to
	// ("" for a token bound to none).
	UID string
	Pod string
	// TokenJTI and TokenSHA256 name the token that proved it, for the
	// audit trail; the token itself is never kept.
	TokenJTI    string
	TokenSHA256 string
}

// Ref is the workload's namespace and ServiceAccount, as grants name it.
func (w *Workload) Ref() *policy.WorkloadRef {
	if w == nil {
		return nil
	}
	return &policy.WorkloadRef{Namespace: w.Namespace, ServiceAccount: w.ServiceAccount}
}

// String is "namespace/serviceAccount", as leases record it.
func (w *Workload) String() string {
	if w == nil {
		return ""
	}
	return w.Namespace + "/" + w.ServiceAccount
}
