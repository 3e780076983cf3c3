package audit

import (
	"context"
	"encoding/json"
	"io"
	"sync"
	"time"
)

// Schema is the value of every audit event's "audit" field: it tells
// audit events apart from operational log lines in a shared stream and
// versions their shape.
const Schema = "tokenbroker.io/v1"

// Audit actions and decisions.
const (
	ActionIssue  = "issue"
	ActionRevoke = "revoke"
	ActionEnroll = "enroll"
	ActionRenew  = "renew"
	// ActionExecKubeconfig is POST /v1/kubeconfigs?format=exec: a
	// decision, and no credential.
	ActionExecKubeconfig = "exec_kubeconfig"
	// ActionAuthenticate is a caller refused before any other decision:
	// its client certificate passed the TLS handshake but has expired, has
	// no identity, comes from a CA no longer trusted or is revoked.
	ActionAuthenticate = "authenticate"
	// ActionUploadJWKS is a peer uploading its cluster's key set.
	ActionUploadJWKS = "upload_jwks"
	// ActionReportPods is a peer reporting the Pods that live in its
	// cluster (workloadIdentity.livePodsFromPeer).
	ActionReportPods = "report_pods"
	// ActionGatewayRequest is one request the lease gateway forwarded, or
	// refused, for a gateway lease (its method, path and status, never a
	// body), and ActionGatewayClose the connections it ended when their
	// lease was revoked or expired.
	ActionGatewayRequest = "gateway_request"
	ActionGatewayClose   = "gateway_close"
	// ActionGatewayForward is a long-running request (a watch, an exec,
	// attach or port-forward upgrade, a followed log) the lease gateway
	// has just forwarded, written before it ends so that a stream running
	// now, or cut by a replica that died, is on the record with the
	// Audit-ID it carries (api_audit_id); ActionGatewayRequest follows
	// when it ends, however it ends.
	ActionGatewayForward = "gateway_forward"
	// ActionGatewayUpgrade is the API server's 101 to an upgrade the lease
	// gateway forwarded (status 101), written as the stream begins, before
	// it ends; ActionGatewayRequest follows when it ends.
	ActionGatewayUpgrade = "gateway_upgrade"

	DecisionAllow = "allow"
	DecisionDeny  = "deny"
	// DecisionError is a request that policy allowed (or had not judged
	// yet) but that failed: the API server was unavailable, the
	// ServiceAccount was missing, the CA could not sign.
	DecisionError = "error"
)

// Reason codes of a refusal, in tokenbroker_denials_total and the
// metrics of the limits (which add their own).
const (
	DenyNotGranted       = "not_granted"
	DenyMinTTL           = "min_ttl"
	DenyCredential       = "credential_unavailable"
	DenyInvalid          = "invalid"
	DenyNotFound         = "not_found"
	DenyJoinToken        = "join_token"
	DenyRevoked          = "revoked"
	DenyIdentityMismatch = "identity_mismatch"
	DenyDisabled         = "disabled"
	DenyWorkloadToken    = "workload_token"
	DenyPodCertificate   = "pod_certificate"
	DenyNotSigningCA     = "not_signing_ca"
	DenyNotAPeer         = "not_a_peer"
)

// Event is one decision of the broker: a kubeconfig issued or refused,
// a lease revoked, a certificate enrolled or renewed. It names who asked
// (identity, certificate fingerprint, request id) and what they got (lease
// id, the token's jti, the certificate's serial), never a credential. Its
// credential_id is what the API server's own audit log records for every
// request made with the credential (user.extra
// "authentication.kubernetes.io/credential-id": "JTI=<jti>" or
// "X509SHA256=<fingerprint>"), so the two logs join on it
// ("tokenbroker audit", broker/auditjoin).
type Event struct {
	Time     time.Time `json:"time"`
	Audit    string    `json:"audit"`
	Action   string    `json:"action"`
	Decision string    `json:"decision"`
	// Reason is why a request was denied or failed, as the caller was told.
	Reason         string `json:"reason,omitempty"`
	RequestID      string `json:"request_id,omitempty"`
	Identity       string `json:"identity,omitempty"`
	Peer           string `json:"peer,omitempty"`
	CertSHA256     string `json:"cert_sha256,omitempty"`
	Namespace      string `json:"namespace,omitempty"`
	ServiceAccount string `json:"service_account,omitempty"`
	// User is the per-lease user of a client certificate.
	User       string `json:"user,omitempty"`
	Credential string `json:"credential,omitempty"`
	LeaseID    string `json:"lease_id,omitempty"`
	TokenJTI   string `json:"token_jti,omitempty"`
	// CertificateSerial names an issued client-certificate credential
	// (hexadecimal), as TokenJTI names a token.
	CertificateSerial string `json:"certificate_serial,omitempty"`
	// CredentialID is the issued credential as the target's API server
	// names it in its audit log, user.extra
	// "authentication.kubernetes.io/credential-id": "JTI=<jti>" for a
	// token, "X509SHA256=<hex sha256 of the certificate's DER>" for a
	// client certificate. "tokenbroker audit" joins on it.
	CredentialID string `json:"credential_id,omitempty"`
	RequestedTTL string `json:"requested_ttl,omitempty"`
	GrantedTTL   string `json:"granted_ttl,omitempty"`
	ClampedBy    string `json:"clamped_by,omitempty"`
	ExpiresAt    string `json:"expires_at,omitempty"`
	// JoinTokenID is the jti of the join token an enrollment used (not
	// the token), so that a replayed token can be traced to its first use.
	JoinTokenID string `json:"join_token_jti,omitempty"`
	// Workload is the "namespace/serviceAccount" of the source cluster's
	// workload that asked, proven by its token (whose jti is
	// WorkloadTokenJTI); WorkloadTokenSHA256 names a refused one.
	Workload    string `json:"workload,omitempty"`
	WorkloadUID string `json:"workload_uid,omitempty"`
	WorkloadPod string `json:"workload_pod,omitempty"`
	// WorkloadPodUID is the uid of the Pod whose pod certificate proved
	// the workload (what tokenbroker pki revoke --pod-uid takes).
	WorkloadPodUID      string `json:"workload_pod_uid,omitempty"`
	WorkloadTokenJTI    string `json:"workload_token_jti,omitempty"`
	WorkloadTokenSHA256 string `json:"workload_token_sha256,omitempty"`
	// AgentPod ("namespace/name") and AgentPodUID name the Pod of the
	// peer's agent whose pod certificate made the request as the peer
	// itself (the policy's peers[].agent); empty for the peer's client
	// certificate. Not workload_pod: the agent asks as its cluster, not
	// as a workload.
	AgentPod    string `json:"agent_pod,omitempty"`
	AgentPodUID string `json:"agent_pod_uid,omitempty"`
	// JWKSDigest names an uploaded key set.
	JWKSDigest string `json:"jwks_digest,omitempty"`
	Serial     string `json:"serial,omitempty"`
	NotAfter   string `json:"not_after,omitempty"`
	// ClusterCASerial and ClusterCANotAfter name the cluster CA signed
	// with an enrolled or renewed certificate, when one was asked for.
	ClusterCASerial   string `json:"cluster_ca_serial,omitempty"`
	ClusterCANotAfter string `json:"cluster_ca_not_after,omitempty"`
	// Grant is the grant a lease was issued under, on issuance and on a
	// revocation because its namespace stopped matching it.
	Grant string `json:"grant,omitempty"`
	// Access is "gateway" for a gateway lease's issuance, requests and
	// closes; empty for a direct lease.
	Access string `json:"access,omitempty"`
	// Method, Path and Status are a gateway request's (the path without
	// its query); APIAuditID is the Audit-ID the gateway sent the API
	// server with it, which the API server's audit log records as the
	// event's auditID ("tokenbroker audit" joins on it). DurationMS is how
	// long it ran; Connections how many a gateway_close ended.
	Method      string `json:"method,omitempty"`
	Path        string `json:"path,omitempty"`
	Status      int    `json:"status,omitempty"`
	APIAuditID  string `json:"api_audit_id,omitempty"`
	DurationMS  int64  `json:"duration_ms,omitempty"`
	Connections int    `json:"connections,omitempty"`
}

// Auditor receives the broker's audit events. Audit must be safe for
// concurrent use and must not block for long: it runs on the request path.
type Auditor interface {
	Audit(Event) error
}

// Log writes audit events as JSON lines to w, one Write per event so
// that concurrent events never interleave.
type Log struct {
	mu  sync.Mutex
	w   io.Writer
	buf []byte
}

// NewLog returns an Auditor writing to w.
func NewLog(w io.Writer) *Log { return &Log{w: w} }

// Audit writes one event.
func (l *Log) Audit(ev Event) error {
	line, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf = append(append(l.buf[:0], line...), '\n')
	_, err = l.w.Write(l.buf)
	return err
}

// Reason codes of a refused caller (ActionAuthenticate), the reason label
// of tokenbroker_denials_total{action="authenticate"}.
const (
	RefusedNoCertificate = "no_certificate"
	RefusedExpired       = "expired"
	RefusedIdentity      = "identity"
	RefusedUntrustedCA   = "untrusted_ca"
	RefusedRevoked       = "revoked"
)

type requestIDKey struct{}

// WithRequestID returns a context carrying the transport's request id, for
// the audit events of the request.
func WithRequestID(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, requestIDKey{}, id)
}

// RequestID returns the request id WithRequestID put in ctx, or "".
func RequestID(ctx context.Context) string {
	id, _ := ctx.Value(requestIDKey{}).(string)
	return id
}
