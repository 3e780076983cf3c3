// Package tenants keeps grants by namespaceSelector true while namespaces
// change: the Tracker reads the cluster's namespaces from a metadata-only
// informer (their labels and owners), knows which namespaces each selector
// grant of the policy in force matches (and so where each peer may hold
// leases, PeerNamespaces, and the lease rules built from them,
// RulesCache), and queues a namespace that stops matching a grant that
// revokes on unmatch (after the grant's revokeDelay). The Revoker works
// that queue: it confirms against the API server (the cache may lag),
// then revokes the namespace's leases of that grant through
// lease.Deleter, each with an audit event; it also sweeps at start and
// finds, for the GC, leases that left while nobody watched. The package
// holds the pure rules of that revocation too: whether a lease is still
// covered (Uncovered), which grant a decision was made under, and how a
// lease records that it is to be revoked.
package tenants
