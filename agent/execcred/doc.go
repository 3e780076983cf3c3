// Package execcred is "tokenbroker credential", the client-go exec
// credential plugin, without its wiring: kubectl (or any client-go program)
// runs the plugin before it talks to the API server, and the plugin answers
// with a token (or a client certificate) that a broker issued, so that a
// kubeconfig stays valid while its short-lived credential renews itself.
//
// What it holds:
//
//   - ExecInfo and ParseExecInfo read KUBERNETES_EXEC_INFO, the request
//     client-go gives the plugin; Encode writes the answer, an
//     ExecCredential of client.authentication.k8s.io/v1 or v1beta1 built
//     from client-go's own types.
//   - Cache keeps one credential per Key (broker, peer identity, namespace,
//     ServiceAccount, credential kind, access mode, audiences, ttl, minTTL) as one file
//     in a private directory, so that each kubectl command does not create
//     a lease. Plugin decides, under an exclusive file lock, whether the
//     cached credential may be handed out again or a new one is issued.
//   - Target, ExecConfig and Kubeconfig build the exec stanza that runs the
//     plugin, for "tokenbroker get kubeconfig --exec" and for outputs that
//     embed the same command line; PluginTarget is what the plugin reads
//     from a ClusterProfile entry (ParsePluginTarget, CheckCluster guards
//     where its credential goes).
//
// The package issues nothing itself: the caller passes an IssueFunc (the
// command wires the agent's broker client into it). That keeps this package
// free of the agent package, which imports it for Target.
package execcred
