// Package limits holds the broker's rate limits: token buckets keyed by
// verified identity for issuance and renewal (Limiter, bounded by the
// identities the CA certified, swept when full), the enrollment buckets of
// unauthenticated callers keyed by source address (IPv6 by its /64) and by
// join token digest (EnrollLimiter, a bounded map that makes room by
// evicting the oldest), the per-identity cap of lease reads waiting on the
// API server (InFlight), and the 429 answer with its Retry-After
// (Limited). The figures come from the policy; the quotas of live leases
// are the lease package's places. It decides nothing else and imports only
// problem of the core.
package limits
