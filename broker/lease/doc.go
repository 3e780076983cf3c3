// Package lease is the lease Secret: what the broker records of every
// credential it hands out, and the one thing whose deletion revokes it. It
// owns every read and write of lease Secrets: NewSecret; the Store (a
// holder's page with continue tokens, one lease by id through the
// counter, the leases matching some labels, the GC pass, the pool's create
// and claim, the credential id recorded after the answer); the revocation
// of one lease (Deleter); the Pool and its PoolKeeper; the retry queue of
// failed deletions (Retries) and the Timers that revoke a lease at its own
// expiry. And it knows the live leases without asking the API server on
// the request path: the Counter (its reflectors' store, one watch per
// namespace the policy grants, metadata only), which verifies each lease
// against Rules (which peer may hold a lease in which namespace, as the
// orchestrator derives them from the policy, so that a forged Secret
// counts for nothing), holds quota places (Place) and reports what
// expired.
//
// It imports no policy, enrollment or issuer package: a reader of leases
// (the gateway, to look a lease up and learn of its deletion) needs nothing
// else.
package lease
