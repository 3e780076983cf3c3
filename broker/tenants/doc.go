// Package tenants keeps grants by namespaceSelector true while namespaces
// change: the Tracker reads the cluster's namespaces from a metadata-only
// informer (their labels and owners), knows which namespaces each selector
// grant of the policy in force matches, and queues a namespace that stops
// matching a grant that revokes on unmatch (after the grant's revokeDelay),
// confirming against the API server before anything is revoked (the cache
// may lag). It also holds the pure rules of that revocation: whether a
// lease is still covered (Uncovered), which grant a decision was made
// under, and how a lease records that it is to be revoked. Deleting the
// leases is the orchestrator's, through the callbacks of Run.
package tenants
