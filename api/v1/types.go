// Package v1 holds the wire types of the tokenbroker HTTP API, version 1.
//
// These types are the Go side of api/openapi.yaml and are shared by the
// server, the agent, the CLI and the tests, so that every side of the wire
// agrees on field names by construction. They carry no behaviour beyond
// syntactic validation of what a client sends.
package v1

import (
	"strings"
	"time"
)

// Media types used by the API.
const (
	MediaTypeJSON    = "application/json"
	MediaTypeYAML    = "application/yaml"
	MediaTypeProblem = "application/problem+json"
	// MediaTypeJWKSet is RFC 7517's media type of a key set upload.
	MediaTypeJWKSet = "application/jwk-set+json"
)

// Credential kinds a caller can ask for.
const (
	CredentialToken             = "token"
	CredentialClientCertificate = "clientCertificate"
)

// Access modes of a grant and of a request (KubeconfigRequest.Access).
const (
	// AccessDirect: the kubeconfig points at the target's API server and
	// carries a credential of the API server (the default).
	AccessDirect = "direct"
	// AccessGateway: the kubeconfig points at the broker's lease gateway
	// and carries a client certificate for that one lease, good nowhere
	// else; the gateway forwards each request as the ServiceAccount and
	// ends every open connection of the lease when it is revoked.
	AccessGateway = "gateway"
)

// KubeconfigRequest is the body of POST /v1/kubeconfigs.
type KubeconfigRequest struct {
	// Namespace of the ServiceAccount in the target cluster (for a client
	// certificate: where its user's RoleBinding is made).
	Namespace string `json:"namespace"`
	// ServiceAccount is the name of the ServiceAccount to mint a token
	// for. Empty for a client certificate, whose user is a per-lease user
	// (CertificateUser) with the grant's role.
	ServiceAccount string `json:"serviceAccount,omitempty"`
	// TTL is the lifetime the caller asks for, as a Go duration ("2h").
	// Empty means the policy default.
	TTL string `json:"ttl,omitempty"`
	// MinTTL, if set, is the shortest lifetime the caller accepts; a shorter
	// grant is refused with 422 instead of being returned.
	MinTTL string `json:"minTTL,omitempty"`
	// Audiences for the token; empty means the API server's default audience.
	Audiences []string `json:"audiences,omitempty"`
	// Credential is the kind of credential; empty means "token".
	Credential string `json:"credential,omitempty"`
	// CSR, for a client certificate only, is a PEM "CERTIFICATE REQUEST"
	// made with the caller's own key, whose subject is only the common
	// name CertificateUser(peer, its public key): the key then never
	// leaves the caller, and the kubeconfig comes without client-key-data.
	// Empty: the broker makes an ECDSA P-256 key and returns it once.
	// With access gateway it is the lease certificate's key, and only its
	// public key and signature count (any subject).
	CSR string `json:"csr,omitempty"`
	// Access asks for a mode: AccessDirect or AccessGateway. Empty: the
	// mode of the grant that allows the request.
	Access string `json:"access,omitempty"`
}

// RequestSpec is what a KubeconfigRequest asks for, without the CSR: what
// a client that asks again and again keeps (an agent's target, the exec
// plugin's PluginTarget and command line), since a CSR is made anew for
// each request. Its fields are KubeconfigRequest's, with the same JSON
// names, so that a document that holds one reads like the request.
type RequestSpec struct {
	Namespace      string   `json:"namespace"`
	ServiceAccount string   `json:"serviceAccount,omitempty"`
	TTL            string   `json:"ttl,omitempty"`
	MinTTL         string   `json:"minTTL,omitempty"`
	Audiences      []string `json:"audiences,omitempty"`
	Credential     string   `json:"credential,omitempty"`
	Access         string   `json:"access,omitempty"`
}

// Request is the KubeconfigRequest of s, without a CSR, with its own copy
// of the audiences.
func (s RequestSpec) Request() KubeconfigRequest {
	return KubeconfigRequest{
		Namespace:      s.Namespace,
		ServiceAccount: s.ServiceAccount,
		TTL:            s.TTL,
		MinTTL:         s.MinTTL,
		Audiences:      append([]string(nil), s.Audiences...),
		Credential:     s.Credential,
		Access:         s.Access,
	}
}

// ExecKubeconfigResponse is the 200 JSON answer of POST
// /v1/kubeconfigs?format=exec: a kubeconfig whose user runs the exec
// credential plugin ("tokenbroker credential"), with no credential in it.
type ExecKubeconfigResponse struct {
	Kubeconfig string `json:"kubeconfig"`
}

// KubeconfigResponse is the 201 answer of POST /v1/kubeconfigs.
type KubeconfigResponse struct {
	LeaseID    string `json:"leaseId"`
	Kubeconfig string `json:"kubeconfig"`
	// Credential is the kind of credential the kubeconfig carries:
	// CredentialToken (its user has a token, also given in Token) or
	// CredentialClientCertificate (client-certificate-data and
	// client-key-data).
	Credential string `json:"credential,omitempty"`
	Token      string `json:"token,omitempty"`
	// User is the Kubernetes user of a client certificate: the per-lease
	// user its RoleBinding names (CertificateUser).
	User         string    `json:"user,omitempty"`
	ExpiresAt    time.Time `json:"expiresAt"`
	RequestedTTL string    `json:"requestedTTL"`
	GrantedTTL   string    `json:"grantedTTL"`
	// ClampedBy says why the granted TTL is shorter (or longer) than the
	// requested one: "grant.maxTTL", "policy.maxTTL", "lease.minimum",
	// "apiserver" or "signer". Empty when the request was granted as asked.
	// ExpiresAt and GrantedTTL are the lease's: the credential's own
	// expiry can be later (the TokenRequest and CSR APIs' minimum of 10m),
	// but the broker revokes the lease at ExpiresAt.
	ClampedBy string `json:"clampedBy,omitempty"`
	// Access is the lease's mode: AccessDirect, or AccessGateway (the
	// kubeconfig's server is the gateway and its user a lease certificate
	// with client-certificate-data, and client-key-data unless the
	// request sent a CSR; Token is empty).
	Access string `json:"access,omitempty"`
}

// Lease describes one issued credential. The credential itself is never
// part of a lease.
type Lease struct {
	ID             string `json:"id"`
	Peer           string `json:"peer"`
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount,omitempty"`
	// User is the per-lease user of a client certificate.
	User string `json:"user,omitempty"`
	// Workload is the "namespace/serviceAccount" of the caller's cluster
	// that asked for the lease with a workload token; empty without one.
	Workload   string    `json:"workload,omitempty"`
	Credential string    `json:"credential"`
	CreatedAt  time.Time `json:"createdAt"`
	ExpiresAt  time.Time `json:"expiresAt"`
	// Grant is the grant the lease was issued under: its name, or
	// "grants[i]" for an unnamed one; empty for leases made before
	// leases recorded it.
	Grant string `json:"grant,omitempty"`
	// Access is the lease's mode; empty for a direct lease.
	Access string `json:"access,omitempty"`
}

// LeaseList is the answer of GET /v1/leases: one page of the caller's
// leases.
type LeaseList struct {
	Items []Lease `json:"items"`
	// Continue, when set, asks for the next page (GET
	// /v1/leases?continue=...); absent on the last page. Opaque.
	Continue string `json:"continue,omitempty"`
}

// Grant is one grant of the policy as it applies to a peer.
type Grant struct {
	Namespaces      []string `json:"namespaces"`
	ServiceAccounts []string `json:"serviceAccounts,omitempty"`
	// Role or ClusterRole, for a clientCertificate grant: what the
	// certificate's user may do in the namespace.
	Role        string `json:"role,omitempty"`
	ClusterRole string `json:"clusterRole,omitempty"`
	MaxTTL      string `json:"maxTTL"`
	Credential  string `json:"credential"`
	// Name is the grant's name in the policy, if it has one; leases
	// record it.
	Name string `json:"name,omitempty"`
	// NamespaceSelector, for a grant by label, selects namespaces besides
	// Namespaces; MatchingNamespaces are those it matches now, sorted.
	NamespaceSelector  *LabelSelector `json:"namespaceSelector,omitempty"`
	MatchingNamespaces []string       `json:"matchingNamespaces,omitempty"`
	// NamespaceOwner, for a grant by label that has one: the object the
	// selected namespaces must also be owned by (an ownerReference with
	// its UID). MatchingNamespaces are those that are.
	NamespaceOwner *NamespaceOwner `json:"namespaceOwner,omitempty"`
	// RevokeOnUnmatch, for a grant by label: whether the leases in a
	// namespace that stops matching are revoked, and RevokeDelay after
	// how long (a Go duration).
	RevokeOnUnmatch *bool  `json:"revokeOnUnmatch,omitempty"`
	RevokeDelay     string `json:"revokeDelay,omitempty"`
	// Workloads, if set, are the only ServiceAccounts of the peer's
	// cluster whose workload token makes the grant apply.
	Workloads []WorkloadRef `json:"workloads,omitempty"`
	// Audiences, for a token grant, are the audiences a request may name;
	// absent: only requests that name none (the API server's own).
	Audiences []string `json:"audiences,omitempty"`
	// Access is AccessGateway for a gateway grant; empty for the default,
	// direct.
	Access string `json:"access,omitempty"`
}

// LabelSelector is a Kubernetes label selector (metav1.LabelSelector),
// as the policy's namespaceSelector writes it.
type LabelSelector struct {
	MatchLabels      map[string]string          `json:"matchLabels,omitempty"`
	MatchExpressions []LabelSelectorRequirement `json:"matchExpressions,omitempty"`
}

// NamespaceOwner is an object by API version, kind, name and UID, as an
// ownerReference names it.
type NamespaceOwner struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Name       string `json:"name"`
	UID        string `json:"uid"`
}

// LabelSelectorRequirement is one of a selector's matchExpressions.
type LabelSelectorRequirement struct {
	Key      string   `json:"key"`
	Operator string   `json:"operator"`
	Values   []string `json:"values,omitempty"`
}

// WorkloadInfo is the verified workload of a request.
type WorkloadInfo struct {
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
	UID            string `json:"uid,omitempty"`
	Pod            string `json:"pod,omitempty"`
}

// PeerJWKS is the answer of PUT /v1/peers/self/jwks.
type PeerJWKS struct {
	Peer string `json:"peer"`
	// KeyIDs are the kids of the set now in force, Digest its
	// "sha256:<hex>" over the keys.
	KeyIDs []string `json:"keyIds"`
	Digest string   `json:"digest"`
	// Changed is false when the set was already in force.
	Changed bool `json:"changed"`
	// PreviousKeyIDs still verify until PreviousUntil.
	PreviousKeyIDs []string   `json:"previousKeyIds,omitempty"`
	PreviousUntil  *time.Time `json:"previousUntil,omitempty"`
}

// MaxLivePods bounds a LivePodsReport.
const MaxLivePods = 1024

// LivePodsReport is the body of PUT /v1/peers/self/pods: the uids of the
// Pods that live in the caller's cluster (at most MaxLivePods).
type LivePodsReport struct {
	UIDs []string `json:"uids"`
}

// PeerLivePods is the answer of PUT /v1/peers/self/pods.
type PeerLivePods struct {
	Peer string `json:"peer"`
	// Pods is how many uids the report holds.
	Pods       int       `json:"pods"`
	ReportedAt time.Time `json:"reportedAt"`
	// ValidUntil is when every workload token of the peer is refused
	// unless it reports again (reportedAt + livePodsMaxAge).
	ValidUntil time.Time `json:"validUntil"`
}

// WorkloadRef names a ServiceAccount of the caller's (source) cluster.
type WorkloadRef struct {
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
}

// WhoAmI is the answer of GET /v1/whoami.
type WhoAmI struct {
	// Identity is the SPIFFE ID from the caller's client certificate.
	Identity string `json:"identity"`
	// Peer is the policy name of the peer with that identity; empty if the
	// policy does not know it.
	Peer string `json:"peer,omitempty"`
	// Workload is the caller's workload when the request carried a
	// workload token; Grants are then the ones that workload gets.
	Workload *WorkloadInfo `json:"workload,omitempty"`
	// Grants that apply to the caller; empty means every request is denied.
	Grants []Grant `json:"grants"`
	// Certificate describes the presented client certificate.
	Certificate CertificateInfo `json:"certificate"`
	// Limits are the peer's limits and its usage now; absent for an
	// identity the policy does not know.
	Limits *PeerLimits `json:"limits,omitempty"`
}

// PeerLimits are the limits that apply to a peer (the policy's
// peers[].limits, else its limits, else the built-in ones) and how much
// of the lease quota it uses. The buckets are per broker replica.
type PeerLimits struct {
	IssuancesPerMinute int `json:"issuancesPerMinute"`
	Burst              int `json:"burst"`
	RenewalsPerMinute  int `json:"renewalsPerMinute"`
	MaxLiveLeases      int `json:"maxLiveLeases"`
	// LiveLeases is how many unexpired leases the peer holds, as this
	// replica's lease informer sees them.
	LiveLeases int `json:"liveLeases"`
}

// CertificateInfo is a short description of an X.509 certificate.
type CertificateInfo struct {
	Subject      string    `json:"subject"`
	SerialNumber string    `json:"serialNumber"`
	NotBefore    time.Time `json:"notBefore"`
	NotAfter     time.Time `json:"notAfter"`
	SHA256       string    `json:"sha256"`
}

// Problem is an RFC 9457 problem details object.
type Problem struct {
	Type     string `json:"type"`
	Title    string `json:"title"`
	Status   int    `json:"status"`
	Detail   string `json:"detail,omitempty"`
	Instance string `json:"instance,omitempty"`
	// RequestID lets an operator find the log line of this request.
	RequestID string `json:"requestId,omitempty"`
	// Errors lists field-level validation errors.
	Errors []FieldError `json:"errors,omitempty"`
	// Reason says what failed in a refused workload token (401
	// invalid-workload-token): expired, wrong-audience, unknown-key…
	Reason string `json:"reason,omitempty"`
}

// FieldError is one invalid field of a request.
type FieldError struct {
	Field  string `json:"field"`
	Detail string `json:"detail"`
}

// ValidationError is a document (a policy, an agent configuration) that
// failed validation: every problem found, each with its field path, so that
// an operator fixes them all in one go.
type ValidationError struct {
	// Document names what was validated, for the message: "policy",
	// "agent config".
	Document string
	Problems []FieldError
}

// Error lists the problems, each as "field: detail".
func (e *ValidationError) Error() string {
	parts := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		parts[i] = p.Field + ": " + p.Detail
	}
	return "invalid " + e.Document + ": " + strings.Join(parts, "; ")
}

// MediaTypePEM is the media type of a bare PEM bundle (GET /v1/trust-bundle
// with Accept: application/x-pem-file).
const MediaTypePEM = "application/x-pem-file"

// CertificateRequest is the body of POST /v1/certificates, for enrollment
// (with a join token as the bearer token, on the enrollment listener) and
// for renewal (with the still-valid client certificate, on the mTLS
// listener).
type CertificateRequest struct {
	// CSR is a PEM "CERTIFICATE REQUEST" whose only URI SAN is the identity
	// the caller enrolls or renews, spiffe://<trust-domain>/cluster/<name>.
	// The key pair is made by the caller and never leaves it.
	CSR string `json:"csr"`
	// ClusterCACSR, if set, asks also for the cluster's CA (the
	// intermediate its pod certificates chain through): a PEM
	// "CERTIFICATE REQUEST" for another key, with the same identity as
	// its only URI SAN. Only a broker that signs cluster CAs
	// (serve --sign-cluster-cas) answers it; others refuse the whole
	// request.
	ClusterCACSR string `json:"clusterCACSR,omitempty"`
}

// CertificateResponse is the 201 answer of POST /v1/certificates.
type CertificateResponse struct {
	Identity string `json:"identity"`
	// Certificate is the PEM chain: the client certificate first, then any
	// intermediate CA certificates.
	Certificate  string    `json:"certificate"`
	SerialNumber string    `json:"serialNumber"`
	NotBefore    time.Time `json:"notBefore"`
	NotAfter     time.Time `json:"notAfter"`
	// CABundle is the PEM trust bundle that verifies the broker and the
	// peers (all CAs in force, old and new during a rotation).
	CABundle string `json:"caBundle"`
	// ClusterCA, when the request had a ClusterCACSR, is the cluster CA's
	// PEM chain: the cluster CA first, then any intermediate CA
	// certificates, not the root. It lives as long as the client
	// certificate; ClusterCANotAfter is its NotAfter.
	ClusterCA         string     `json:"clusterCA,omitempty"`
	ClusterCANotAfter *time.Time `json:"clusterCANotAfter,omitempty"`
}

// TrustBundle is the answer of GET /v1/trust-bundle.
type TrustBundle struct {
	// CABundle is the PEM bundle of the CA certificates in force.
	CABundle string `json:"caBundle"`
	// Fingerprints are the "sha256:<hex>" fingerprints of the bundle's
	// certificates, in the same order, for pinning.
	Fingerprints []string `json:"fingerprints"`
}
