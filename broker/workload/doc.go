// Package workload authenticates a source cluster's workload: it
// verifies a workload token against the trust the policy pins for the
// peer that presents it (Verify: issuer, audiences, static keys or the
// key set the peer uploaded; every refusal a reason code with a
// caller-facing detail, BadToken), and holds the key sets peers upload
// (PeerKeyStore, one Secret per peer in the broker's namespace, watched;
// Upload). What a verified workload may get is the policy's decision.
package workload
