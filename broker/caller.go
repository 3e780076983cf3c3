package broker

import (
	"crypto/x509"

	"github.com/tokenbroker/tokenbroker/broker/workload"
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
}
