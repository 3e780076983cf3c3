// Package agent runs in a source cluster and keeps kubeconfigs from the
// brokers fresh where their consumers read them.
//
// An Agent (New, then Run) does three things:
//
//   - Identity. It loads its client certificate, key and trust bundle from
//     a directory (tls.crt, tls.key, ca.crt) or from a kubernetes.io/tls
//     Secret of the source cluster, and enrolls with a join token on first
//     start if there is none. The key pair is kept in memory and presented
//     by every broker client at each handshake, whichever store holds it;
//     a renewer replaces it at identity.renewAt of its lifetime through
//     POST /v1/certificates, stores it (three files replaced together, or
//     one Secret update) and only then puts it into service. Or its
//     identity is its own Pod's certificate (identity.podCertificate),
//     which the kubelet writes and rotates: read from the volume, read
//     again every minute, never stored, enrolled or renewed.
//   - Refresh. For each target a refresher asks the target's broker for a
//     kubeconfig (POST /v1/kubeconfigs), writes it to every output, and
//     schedules the next refresh at refresh.fraction of the granted
//     lifetime less a random jitter. A failed fetch is retried with capped
//     exponential backoff and never touches the outputs. The replaced lease
//     is revoked (DELETE /v1/leases/{id}) refresh.revokeGrace after its
//     successor reached every output. A restarted agent adopts a still
//     valid credential it finds in its outputs instead of fetching at once.
//     At most maxConcurrentSteps targets do this work at once, and broker
//     connections are closed soon after their last request, so that memory
//     stays small with many targets.
//   - Outputs. Secrets in the formats admiralty, argocd, flux and
//     kubeconfig (labelled app.kubernetes.io/managed-by: tokenbroker-agent,
//     annotated with the lease) and files written atomically with mode
//     0600. An output is written only when its content changes; a Secret
//     the agent does not manage is never taken over.
//
// The operations listener serves /healthz (fails when a credential has
// expired or will expire before its next attempt, or the certificate has
// expired), /readyz (ready once every output holds a credential) and
// /metrics.
//
// # Metrics
//
// All are registered on the registry given in Deps:
//
//	tokenbroker_agent_credential_expiry_seconds{target}           gauge, at scrape time: seconds until the earliest expiry among a target's outputs
//	tokenbroker_agent_refresh_total{target,result}                counter: attempts by result (success, failure)
//	tokenbroker_agent_last_success_timestamp_seconds{target}      gauge: Unix time of the last successful refresh
//	tokenbroker_agent_output_writes_total{target,output,result}   counter: writes by result (written, unchanged, failed); output is "secret:ns/name" or "file:/path"
//	tokenbroker_agent_revocations_total{target,result}            counter: revocations of replaced leases (success, failure)
//	tokenbroker_agent_certificate_expiry_seconds                  gauge, at scrape time: seconds until the client certificate expires
//	tokenbroker_agent_certificate_renewals_total{result}          counter: renewals by result (success, failure)
//	tokenbroker_agent_cluster_ca_refusals_total                   counter: renewals whose cluster CA the broker refused (renewed without it)
//
// Tokens, keys and kubeconfigs are never logged; leases appear by id, join
// tokens by jti.
package agent
