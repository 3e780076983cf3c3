// Package auditjoin attributes the requests of a target API server's audit
// log to the broker's leases: it reads the API server's audit events
// (audit.k8s.io/v1 Event, JSON lines) as a stream and joins each request
// made with a broker credential to the lease that credential was issued
// with, its peer, source workload and the broker request that minted it.
//
// The join key is the credential id the API server writes into every
// authenticated request's user.extra["authentication.kubernetes.io/credential-id"]:
// "JTI=<jti>" for a bound ServiceAccount token, "X509SHA256=<lowercase hex
// sha256 of the leaf certificate's DER>" for a client certificate. The
// broker records the same string as credential_id in its issue audit
// events and as the annotation tokenbroker.io/credential-id on the lease
// Secret. An Index is built from either (ReadBrokerLog, AddLease); Join
// streams the API server's log through it; Summary aggregates the joined
// requests per lease and per RBAC subject, and Unused lists the RBAC rule
// entries a subject never exercised.
//
// A request a lease gateway forwarded reaches the API server with the
// gateway's credential, not the lease's: it joins by the Audit-ID the
// gateway sent, which the broker records as api_audit_id in its
// gateway_forward and gateway_upgrade events (written while a stream runs)
// and its gateway_request event (when the request ends). The events of one
// id are one request, and any one of them joins it, so a stream whose
// replica died mid-stream is still attributed. The index holds a bounded
// number of gateway requests (WithMaxGatewayRequests); the events of the
// requests past it are counted (Index.Gateway), never dropped silently.
//
// A request that fails authentication has no user and so no credential id
// in its audit event: it cannot be joined (Stats.Unauthenticated counts
// them). A revoked token's later requests are such requests; a revoked
// client certificate still authenticates, and its refused (403) requests
// join.
//
// Every input is untrusted: one line is at most MaxLineBytes (longer lines
// are skipped and counted), and memory grows with the index and the
// summary's aggregates, never with the length of the log.
package auditjoin
