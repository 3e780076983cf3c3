// Package broker is the domain core of tokenbroker: it authorizes a peer
// against the policy, chooses and clamps the TTL, creates the lease, calls an
// issuer, builds the kubeconfig, revokes leases and garbage-collects expired
// ones. It also issues the client certificates of the small PKI: enrollment
// with a single-use join token (Enroll), renewal with the current certificate
// (Renew), the trust bundle (TrustBundle) and the revocation deny list
// (RevocationList, AddRevocation). It knows nothing of HTTP; the server
// package translates.
//
// All state lives in the Kubernetes API, so several broker replicas in front
// of one API server behave as one:
//
//   - lease Secrets (label tokenbroker.io/kind=lease) in the namespaces of the
//     ServiceAccounts they are for;
//   - used join tokens: a Secret per jti, tokenbroker-jti-<hash>, of type
//     tokenbroker.io/used-join-token (label tokenbroker.io/kind=used-join-token)
//     in the broker's own namespace, created before anything is signed, so
//     that the API server's create-if-absent decides which replica gets a
//     token that two are given; collected with expired leases;
//   - the deny list: the ConfigMap tokenbroker-revocations in the broker's
//     namespace, watched by every replica (see RevocationList).
//
// The policy is reloaded from its file without a restart (PolicyWatcher): a
// bad file is refused and the policy in force kept.
//
// # Metrics
//
// Every domain metric is defined in broker/metrics and listed on its
// Metrics type.
//
// # Audit trail
//
// Every decision ends in exactly one audit.Event handed to Config.Auditor;
// broker/audit defines the events and the JSON-lines log.
package broker
