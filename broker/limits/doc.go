// Package limits decides whether a request is within its peer's limits:
// Admission applies the policy's figures in order (a lease's quota place
// before the issuance bucket, the in-flight cap of lease reads before
// their bucket, a join token's source before the token) and answers a
// refusal as a 429 with its Retry-After (Limited), counted and audited
// under a reason code. Under it are the mechanisms: token buckets keyed by
// verified identity (Limiter, bounded by the identities the CA certified,
// swept when full), the enrollment buckets of unauthenticated callers
// keyed by source address (IPv6 by its /64) and by join token digest
// (EnrollLimiter, a bounded map that makes room by evicting the oldest),
// and the per-identity cap of lease reads waiting on the API server
// (InFlight). The quota places themselves are the lease Counter's.
package limits
