package broker

// Caller is the authenticated peer making a request, as the transport layer
// established it from a verified client certificate.
type Caller struct {
	// Identity is the SPIFFE ID from the certificate's URI SAN,
	// e.g. spiffe://oc.example/cluster/west.
	Identity string
	// CertSHA256 is the "sha256:<hex>" fingerprint of the client certificate,
	// for audit logs.
	CertSHA256 string
}
