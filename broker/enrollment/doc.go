// Package enrollment is the certificate authority's side of the broker:
// who may hold a cluster identity. So far it holds the revocation deny list
// (RevocationList: the ConfigMap tokenbroker-revocations, watched by every
// replica; AddRevocation and ReadRevocations for the API and the CLI);
// enrollment with a join token and renewal are still the broker's
// (broker/certificates.go) until they move here.
package enrollment
