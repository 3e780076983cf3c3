// Package workload holds what the broker trusts to authenticate a source
// cluster's workload: the key sets peers upload (PeerKeyStore, one Secret
// per peer in the broker's namespace, watched). Verifying a workload token
// against the trust the policy pins is still the broker's
// (broker/workload.go) until it moves here.
package workload
