// Package lease is the lease Secret: what the broker records of every
// credential it hands out, and the one thing whose deletion revokes it. It
// owns what is known of the live leases without asking the API server on
// the request path: the Counter (its reflectors' store, one watch per
// namespace the policy grants, metadata only), which verifies each lease
// against Rules (which peer may hold a lease in which namespace, as the
// orchestrator derives them from the policy, so that a forged Secret counts
// for nothing), holds quota places (Place), reports what expired, and the
// paging of lease listings (PageRequest, Cursor, continue tokens).
//
// It imports no policy, enrollment or issuer package: a reader of leases
// (the gateway, to look a lease up and learn of its deletion) needs nothing
// else.
package lease
