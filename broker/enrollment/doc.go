// Package enrollment is the certificate authority's side of the broker:
// who may hold a cluster identity, and how peers learn whom to trust. It
// holds the revocation deny list (RevocationList: the ConfigMap
// tokenbroker-revocations, watched by every replica; AddRevocation and
// ReadRevocations for the API and the CLI) and the ClusterTrustBundle
// publisher (the CAs behind the serving certificate and the signing CA, for
// the agents of clusters that read them the cluster way). Enrollment with a
// join token and renewal are still the broker's (broker/certificates.go)
// until they move here.
package enrollment
