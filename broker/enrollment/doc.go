// Package enrollment is the certificate authority's side of the broker:
// who may hold a cluster identity, and how peers learn whom to trust. It
// holds what the CA side is made of (the CertificateAuthority, TrustSource
// and JoinTokenVerifier the broker is given; join tokens verified by the
// signing CA and the previous one only; the used-join-token record's name
// and lifetime; a CSR parsed and checked against the identity it must ask
// for), the revocation deny list (RevocationList: the ConfigMap
// tokenbroker-revocations, watched by every replica; AddRevocation and
// ReadRevocations for the API and the CLI) and the ClusterTrustBundle
// publisher; and the flows themselves (Authority: Enroll and Renew, with
// their limits, the used-join-token record and one audit event each, and
// the cluster's CA signed with its certificate when asked and allowed).
package enrollment
