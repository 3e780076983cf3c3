// Package broker is the domain core of tokenbroker: it authorizes a peer
// against the policy, chooses and clamps the TTL, creates the lease, calls an
// issuer, builds the kubeconfig, revokes leases and garbage-collects expired
// ones. It knows nothing of HTTP; the server package translates.
//
// All state lives in the Kubernetes API (lease Secrets), so several broker
// replicas in front of one API server behave as one.
package broker
