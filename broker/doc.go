// Package broker is the orchestrator of tokenbroker's domain core: it issues
// a kubeconfig (IssueKubeconfig: decide with the policy, admit within the
// limits, create the lease, call an issuer, build the kubeconfig, audit),
// lists and revokes leases, enrolls and renews cluster certificates,
// authenticates source workloads, collects expired leases and revokes those
// of namespaces that left a selector grant, by calling the packages below it
// (docs/architecture.md, "The core: one package per job"). It knows nothing
// of HTTP; the server package translates.
//
// All state lives in the Kubernetes API, so several broker replicas in front
// of one API server behave as one:
//
//   - lease Secrets (label tokenbroker.io/kind=lease) in the namespaces of the
//     ServiceAccounts they are for (broker/lease, broker/objects);
//   - used join tokens: a Secret per jti, tokenbroker-jti-<hash>, of type
//     tokenbroker.io/used-join-token in the broker's own namespace, created
//     before anything is signed, so that the API server's create-if-absent
//     decides which replica gets a token that two are given; collected with
//     expired leases (broker/enrollment);
//   - the deny list: the ConfigMap tokenbroker-revocations in the broker's
//     namespace, watched by every replica (enrollment.RevocationList).
//
// The policy is reloaded from its file without a restart (policy.Watcher): a
// bad file is refused and the policy in force kept.
//
// Every domain metric is defined in broker/metrics; every decision ends in
// exactly one audit.Event (broker/audit) handed to Config.Auditor.
package broker
