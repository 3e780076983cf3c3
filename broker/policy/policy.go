package policy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	rbacpath "k8s.io/apimachinery/pkg/api/validation/path"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"github.com/tokenbroker/tokenbroker/api/schema"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/issuers"
	"github.com/tokenbroker/tokenbroker/pki"
)

// MinCredentialTTL is the shortest ttl.max, ttl.default or grant maxTTL a
// policy may set: the API server grants no credential for less (a
// TokenRequest's and a CSR's expirationSeconds both have a 600s floor).
// Each issuer declares its own limits too (broker.Issuer.Limits).
const MinCredentialTTL = 10 * time.Minute

// Bounds of a client certificate's lifetime (peers[].certificateTTL and
// "serve --client-cert-ttl"). Certificates renew themselves well before
// they expire, so a short lifetime costs little; the maximum keeps a
// certificate that escapes revocation from living long.
const (
	MinCertificateTTL = 10 * time.Minute
	MaxCertificateTTL = 720 * time.Hour
)

// maxPolicyBytes bounds the policy file; a policy is small.
const maxPolicyBytes = 1 << 20

// Policy says which peers may obtain which credentials. The zero Policy
// denies everything.
type Policy struct {
	Cluster ClusterSpec `json:"cluster"`
	TTL     TTLSpec     `json:"ttl"`
	// Limits are every peer's limits unless its own say otherwise
	// (limits.go); absent: the built-in defaults.
	Limits *LimitsSpec `json:"limits,omitempty"`
	Peers  []PeerSpec  `json:"peers"`
}

// ClusterSpec describes the target cluster as the peers reach it: the
// kubeconfigs the broker hands out point there.
type ClusterSpec struct {
	// Name of the cluster, used for the kubeconfig's cluster and context.
	Name string `json:"name"`
	// Server is the external URL of the API server: https, printable
	// ASCII, a host, no user info, query or fragment. A path is allowed,
	// for API servers behind a proxy that serves them under one.
	Server string `json:"server"`
	// TLSServerName, if set, is the name the peers' clients send as SNI
	// and verify the server certificate against instead of Server's host
	// (kubeconfig tls-server-name): for an SNI router in front of several
	// API servers, or a server reached by an address its certificate does
	// not name.
	TLSServerName string `json:"tlsServerName,omitempty"`
	// ProxyURL, if set, is the proxy the peers reach Server through
	// (kubeconfig proxy-url): http, https or socks5, as client-go accepts.
	ProxyURL string `json:"proxyURL,omitempty"`
	// CAFile is the PEM bundle that verifies Server; read by the loader.
	CAFile string `json:"caFile,omitempty"`
	// CAData is the PEM bundle inline; takes the place of CAFile.
	CAData string `json:"caData,omitempty"`
}

// TTLSpec holds the lifetimes that apply when a grant says nothing.
type TTLSpec struct {
	Default apiv1.Duration `json:"default"`
	Max     apiv1.Duration `json:"max"`
}

// PeerSpec is a cluster allowed to talk to the broker.
type PeerSpec struct {
	Name     string      `json:"name"`
	Identity string      `json:"identity"`
	Grants   []GrantSpec `json:"grants"`
	// CertificateTTL is the lifetime of the client certificates the broker
	// issues to this peer at enrollment and renewal; zero means the
	// broker's default ("serve --client-cert-ttl").
	CertificateTTL apiv1.Duration `json:"certificateTTL,omitempty"`
	// Limits override the policy's limits for this peer.
	Limits *LimitsSpec `json:"limits,omitempty"`
	// WorkloadIdentity, if set, is how the broker verifies the
	// ServiceAccount tokens of this peer's cluster, which name the
	// workload asking (grants[].workloads). The peer's certificate
	// decides that this trust applies, never the token's iss alone.
	WorkloadIdentity *WorkloadIdentitySpec `json:"workloadIdentity,omitempty"`
	// Agent, if set, is the workload of the peer's cluster that is its
	// agent: a pod certificate of that namespace and ServiceAccount,
	// signed by the peer's own cluster CA, speaks for the peer itself, as
	// its client certificate does (every grant, the peer's own routes but
	// renewal), with no workloadIdentity needed. Any other pod certificate
	// stays a workload's.
	Agent *WorkloadRef `json:"agent,omitempty"`
}

// IsAgent reports whether namespace/serviceAccount is the workload the
// peer names its agent.
func (p *PeerSpec) IsAgent(namespace, serviceAccount string) bool {
	return p != nil && p.Agent != nil && p.Agent.Namespace == namespace && p.Agent.ServiceAccount == serviceAccount
}

// WorkloadIdentitySpec is the trust in one peer cluster's workloads: in
// its ServiceAccount tokens (its issuer, our audiences and its keys, from
// exactly one of JWKS, JWKSFile and JWKSFromPeer), in the pod
// certificates of its cluster CA (PodCertificates), or both.
type WorkloadIdentitySpec struct {
	// PodCertificates: a workload of the peer's cluster may prove itself
	// with its pod certificate over mutual TLS, signed by the cluster CA
	// the peer received at enrollment (fleet CA → cluster CA → pod
	// certificate). With it alone (no issuer, audiences or key set), the
	// peer's workloads prove themselves only so.
	PodCertificates bool `json:"podCertificates,omitempty"`
	// Issuer is the exact iss of the peer cluster's tokens (its
	// --service-account-issuer).
	Issuer string `json:"issuer"`
	// Audiences: a token's aud must contain one of them.
	Audiences []string `json:"audiences"`
	// JWKS is the peer cluster's key set inline, as JSON text.
	JWKS string `json:"jwks,omitempty"`
	// JWKSFile is a file holding the key set, relative to the policy file;
	// re-read when it changes.
	JWKSFile string `json:"jwksFile,omitempty"`
	// JWKSFromPeer: the peer uploads its cluster's key set itself
	// (PUT /v1/peers/self/jwks); the broker keeps it in a Secret.
	JWKSFromPeer bool `json:"jwksFromPeer,omitempty"`
	// JWKSOverlap is how long an uploaded set still verifies after a new
	// one replaced it; zero means MaxTokenAge. Only with JWKSFromPeer.
	JWKSOverlap apiv1.Duration `json:"jwksOverlap,omitempty"`
	// MaxTokenAge caps a token's exp − iat; zero means 1h.
	MaxTokenAge apiv1.Duration `json:"maxTokenAge,omitempty"`
	// RequirePodBinding accepts only tokens bound to a pod (projected
	// tokens), not those of a TokenRequest bound to nothing or a Secret.
	RequirePodBinding bool `json:"requirePodBinding,omitempty"`
	// LivePodsFromPeer: the peer reports the Pods that live in its cluster
	// (PUT /v1/peers/self/pods; the agent's jwksUpload.livePods), and a
	// token or pod certificate is honoured only while its Pod is in the
	// last report, as the peer cluster's own API server honours a token
	// only while the Pod exists. With token trust it needs jwksFromPeer
	// and requirePodBinding; with PodCertificates alone, nothing else (the
	// peer then reports without uploading keys).
	LivePodsFromPeer bool `json:"livePodsFromPeer,omitempty"`
	// LivePodsMaxAge is how old that report may be before every token and
	// pod certificate of the peer is refused; zero means 2m. Only with
	// LivePodsFromPeer.
	LivePodsMaxAge apiv1.Duration `json:"livePodsMaxAge,omitempty"`

	// keys is the parsed JWKS or JWKSFile content (nil with JWKSFromPeer).
	keys *pki.JWKS
}

// WorkloadRef names a ServiceAccount of a peer cluster.
type WorkloadRef struct {
	Namespace      string `json:"namespace"`
	ServiceAccount string `json:"serviceAccount"`
	// Standalone, on a caller's workload (never in a policy), says the
	// workload proved itself without the peer's certificate: by its own
	// pod certificate. Such a caller gets only grants that name it.
	Standalone bool `json:"-"`
}

// Bounds of a workloadIdentity.
const (
	MinWorkloadTokenAge   = 10 * time.Minute
	MaxWorkloadTokenAge   = 24 * time.Hour
	MaxJWKSOverlap        = 7 * 24 * time.Hour
	MinLivePodsMaxAge     = 10 * time.Second
	MaxLivePodsMaxAge     = time.Hour
	DefaultLivePodsMaxAge = 2 * time.Minute
	maxWorkloadAudiences  = 16
	maxIssuerLen          = 512
)

// EffectiveMaxTokenAge is MaxTokenAge or its default.
func (w *WorkloadIdentitySpec) EffectiveMaxTokenAge() time.Duration {
	if w.MaxTokenAge != 0 {
		return time.Duration(w.MaxTokenAge)
	}
	return pki.DefaultMaxWorkloadTokenAge
}

// EffectiveLivePodsMaxAge is LivePodsMaxAge or its default.
func (w *WorkloadIdentitySpec) EffectiveLivePodsMaxAge() time.Duration {
	if w.LivePodsMaxAge != 0 {
		return time.Duration(w.LivePodsMaxAge)
	}
	return DefaultLivePodsMaxAge
}

// EffectiveJWKSOverlap is JWKSOverlap or its default, MaxTokenAge: a token
// signed with the replaced key just before the change still verifies
// until it expires.
func (w *WorkloadIdentitySpec) EffectiveJWKSOverlap() time.Duration {
	if w.JWKSOverlap != 0 {
		return time.Duration(w.JWKSOverlap)
	}
	return w.EffectiveMaxTokenAge()
}

// TrustsTokens reports whether the peer's ServiceAccount tokens are
// trusted at all: a workloadIdentity of podCertificates alone trusts none.
func (w *WorkloadIdentitySpec) TrustsTokens() bool {
	return w.Issuer != "" || len(w.Audiences) > 0 || w.JWKS != "" || w.JWKSFile != "" || w.JWKSFromPeer
}

// StaticKeys is the pinned key set (jwks or jwksFile), nil for a peer
// that uploads its own.
func (w *WorkloadIdentitySpec) StaticKeys() *pki.JWKS { return w.keys }

// GrantSpec lets a peer obtain credentials for the listed ServiceAccounts
// in the listed namespaces (every combination), or, with credential
// clientCertificate, client certificates for a per-lease user bound to
// Role or ClusterRole in each listed namespace.
type GrantSpec struct {
	Namespaces      []string       `json:"namespaces"`
	ServiceAccounts []string       `json:"serviceAccounts,omitempty"`
	MaxTTL          apiv1.Duration `json:"maxTTL,omitempty"`
	Credential      string         `json:"credential,omitempty"`
	// Role or ClusterRole (exactly one, for clientCertificate grants
	// only) is what the certificate's user may do in the namespace: the
	// broker binds it with a RoleBinding owned by the lease.
	Role        string `json:"role,omitempty"`
	ClusterRole string `json:"clusterRole,omitempty"`

	// Name identifies the grant among its peer's: every lease records the
	// grant it was issued under (AnnotationGrant), by this name. Required
	// with NamespaceSelector, so that a lease still names its grant after
	// grants are added, removed or reordered.
	Name string `json:"name,omitempty"`
	// NamespaceSelector, if set, grants every namespace whose labels it
	// matches, now and later, besides those in Namespaces (the union). It
	// is matched against a watched cache of namespaces, never a GET per
	// request. An empty selector is an error, not "every namespace".
	NamespaceSelector *metav1.LabelSelector `json:"namespaceSelector,omitempty"`
	// NamespaceOwner, if set (selector grants only), also requires a
	// namespace the selector matches to be owned by this object (an
	// ownerReference with its UID, such as a Capsule Tenant's), so that a
	// label someone else patches on does not move a namespace in
	// (tenantpolicy.go).
	NamespaceOwner *NamespaceOwner `json:"namespaceOwner,omitempty"`
	// RevokeOnUnmatch (default true, selector grants only) keeps the grant
	// true: when a namespace stops being covered (its labels change, it
	// is deleted, or a reload narrows the grant) the leases issued under
	// this grant there are revoked, RevokeDelay later.
	RevokeOnUnmatch *bool `json:"revokeOnUnmatch,omitempty"`
	// RevokeDelay is how long a namespace may stay uncovered before its
	// leases are revoked (to ride out a relabel); default 0.
	RevokeDelay apiv1.Duration `json:"revokeDelay,omitempty"`

	// selector is NamespaceSelector compiled by Validate; nil without one.
	Selector labels.Selector `json:"-"`
	// Workloads, if set, limits the grant to requests whose verified
	// workload token names one of these ServiceAccounts of the peer's
	// cluster. Absent: any workload of the peer (the certificate alone).
	Workloads []WorkloadRef `json:"workloads,omitempty"`
	// Audiences a token request may name (audiences.go). Absent: only
	// requests that name none, whose token the API server makes for its
	// own audiences.
	Audiences []string `json:"audiences,omitempty"`
	// Access is how the grant's leases reach the API server:
	// apiv1.AccessDirect (the default: the kubeconfig holds a token of the
	// API server) or apiv1.AccessGateway (the kubeconfig holds a lease
	// certificate for the broker's gateway, which forwards as the
	// ServiceAccount and ends the lease's connections on revocation).
	Access string `json:"access,omitempty"`
}

// roleRef is the grant's role, or the zero RoleRef for a token grant.
func (g *GrantSpec) roleRef() issuers.RoleRef {
	switch {
	case g.Role != "":
		return issuers.RoleRef{Kind: "Role", Name: g.Role}
	case g.ClusterRole != "":
		return issuers.RoleRef{Kind: "ClusterRole", Name: g.ClusterRole}
	}
	return issuers.RoleRef{}
}

// ParsePolicy decodes and validates a policy document (YAML or JSON).
// Unknown fields are errors, so that a misspelt key never silently widens
// or narrows what is granted. CAFile is not read here.
func Parse(data []byte) (*Policy, error) {
	if len(data) > maxPolicyBytes {
		return nil, fmt.Errorf("policy is %d bytes, over the limit of %d", len(data), maxPolicyBytes)
	}
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("parse policy: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	var p Policy
	if err := dec.Decode(&p); err != nil {
		return nil, fmt.Errorf("parse policy: %w", err)
	}
	p.defaults()
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return &p, nil
}

func (p *Policy) defaults() {
	if p.TTL.Default == 0 {
		p.TTL.Default = apiv1.Duration(time.Hour)
	}
	if p.TTL.Max == 0 {
		p.TTL.Max = apiv1.Duration(24 * time.Hour)
	}
	for i := range p.Peers {
		for j := range p.Peers[i].Grants {
			if p.Peers[i].Grants[j].Credential == "" {
				p.Peers[i].Grants[j].Credential = apiv1.CredentialToken
			}
			if p.Peers[i].Grants[j].Access == "" {
				p.Peers[i].Grants[j].Access = apiv1.AccessDirect
			}
		}
	}
}

// Validate reports every problem in the policy at once.
func (p *Policy) Validate() error {
	var probs []apiv1.FieldError
	add := func(field, format string, args ...any) {
		probs = append(probs, apiv1.FieldError{Field: field, Detail: fmt.Sprintf(format, args...)})
	}
	if p.Cluster.Name == "" {
		add("cluster.name", "is required")
	} else if errs := validation.IsDNS1123Label(p.Cluster.Name); len(errs) > 0 {
		add("cluster.name", "%s", strings.Join(errs, "; "))
	} else if p.Cluster.Name == pki.JoinTokenAudience {
		// Without --broker-name the broker answers to cluster.name in a
		// join token's aud; this one is the aud of every unbound token.
		add("cluster.name", "%q is the audience of unbound join tokens: as the broker's name it would accept them without --accept-unbound-join-tokens; choose another name", p.Cluster.Name)
	}
	if p.Cluster.Server == "" {
		add("cluster.server", "is required")
	} else if detail := schema.URLProblem(p.Cluster.Server, "must be an https:// URL", "https"); detail != "" {
		add("cluster.server", "%s", detail)
	}
	if p.Cluster.TLSServerName != "" {
		if detail := schema.HostProblem(p.Cluster.TLSServerName); detail != "" {
			add("cluster.tlsServerName", "must be a DNS name or an IP address, without scheme or port: %s", detail)
		}
	}
	if p.Cluster.ProxyURL != "" {
		if detail := schema.URLProblem(p.Cluster.ProxyURL, "must be an http://, https:// or socks5:// URL", "http", "https", "socks5"); detail != "" {
			add("cluster.proxyURL", "%s", detail)
		}
	}
	if p.Cluster.CAFile == "" && p.Cluster.CAData == "" {
		add("cluster.caFile", "is required (or cluster.caData)")
	}
	if p.Cluster.CAFile != "" && p.Cluster.CAData != "" {
		add("cluster.caData", "give caFile or caData, not both")
	}
	maxTTL := time.Duration(p.TTL.Max)
	if maxTTL < MinCredentialTTL {
		add("ttl.max", "must be at least %s", MinCredentialTTL)
	}
	if d := time.Duration(p.TTL.Default); d < MinCredentialTTL || d > maxTTL {
		add("ttl.default", "must be between %s and ttl.max", MinCredentialTTL)
	}
	validateLimits(add, "limits", p.Limits, true)
	names := map[string]bool{}
	ids := map[string]bool{}
	for i, peer := range p.Peers {
		path := fmt.Sprintf("peers[%d]", i)
		if errs := validation.IsDNS1123Label(peer.Name); len(errs) > 0 {
			add(path+".name", "%s", strings.Join(errs, "; "))
		} else if names[peer.Name] {
			add(path+".name", "duplicate peer name %q", peer.Name)
		}
		names[peer.Name] = true
		if err := ValidSPIFFEID(peer.Identity); err != nil {
			add(path+".identity", "%v", err)
		} else if ids[peer.Identity] {
			add(path+".identity", "duplicate identity %q", peer.Identity)
		}
		ids[peer.Identity] = true
		validateLimits(add, path+".limits", peer.Limits, false)
		if d := time.Duration(peer.CertificateTTL); d != 0 && (d < MinCertificateTTL || d > MaxCertificateTTL) {
			add(path+".certificateTTL", "must be between %s and %s", MinCertificateTTL, MaxCertificateTTL)
		}
		if wi := peer.WorkloadIdentity; wi != nil {
			validateWorkloadIdentity(path+".workloadIdentity", wi, add)
		}
		if peer.Agent != nil {
			validateWorkloadRef(path+".agent", *peer.Agent, add)
		}
		certNamespaces := map[string]bool{}
		grantNames := map[string]bool{}
		for j, g := range peer.Grants {
			gpath := fmt.Sprintf("%s.grants[%d]", path, j)
			if len(g.Namespaces) == 0 && g.NamespaceSelector == nil {
				add(gpath+".namespaces", "must list at least one namespace (or set namespaceSelector)")
			}
			validateTenantGrant(&p.Peers[i].Grants[j], gpath, time.Duration(p.TTL.Max), grantNames, add)
			for k, ns := range g.Namespaces {
				if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
					add(fmt.Sprintf("%s.namespaces[%d]", gpath, k), "%s", strings.Join(errs, "; "))
				}
			}
			cert := g.Credential == apiv1.CredentialClientCertificate
			switch {
			case cert && len(g.ServiceAccounts) > 0:
				add(gpath+".serviceAccounts", "must be empty for a clientCertificate grant: the certificate is for a per-lease user, whose permissions are the grant's role or clusterRole")
			case !cert && len(g.ServiceAccounts) == 0:
				add(gpath+".serviceAccounts", "must list at least one ServiceAccount")
			}
			switch {
			case cert && (g.Role == "") == (g.ClusterRole == ""):
				add(gpath+".role", "a clientCertificate grant names exactly one of role and clusterRole: what the certificate's user may do in the namespace")
			case !cert && (g.Role != "" || g.ClusterRole != ""):
				add(gpath+".role", "only a clientCertificate grant binds a role (a token acts as its ServiceAccount)")
			}
			for _, r := range []struct{ field, name string }{{"role", g.Role}, {"clusterRole", g.ClusterRole}} {
				if r.name == "" {
					continue
				}
				// RBAC role names are path segment names (colons allowed).
				if strings.HasPrefix(r.name, "system:") {
					add(gpath+"."+r.field, "must not be a system: role")
				} else if errs := rbacpath.IsValidPathSegmentName(r.name); len(errs) > 0 {
					add(gpath+"."+r.field, "is not a valid role name: %s", strings.Join(errs, "; "))
				} else if len(r.name) > 253 {
					add(gpath+"."+r.field, "must be at most 253 characters")
				}
			}
			if cert {
				for k, ns := range g.Namespaces {
					if certNamespaces[ns] {
						add(fmt.Sprintf("%s.namespaces[%d]", gpath, k), "%q is in another clientCertificate grant of this peer: a request names no role, so one namespace has one", ns)
					}
					certNamespaces[ns] = true
				}
			}
			for k, sa := range g.ServiceAccounts {
				if errs := validation.IsDNS1123Subdomain(sa); len(errs) > 0 {
					add(fmt.Sprintf("%s.serviceAccounts[%d]", gpath, k), "%s", strings.Join(errs, "; "))
				}
			}
			if g.MaxTTL != 0 && (time.Duration(g.MaxTTL) < MinCredentialTTL || time.Duration(g.MaxTTL) > maxTTL) {
				add(gpath+".maxTTL", "must be between %s and ttl.max (%s)", MinCredentialTTL, maxTTL)
			}
			if g.Credential != apiv1.CredentialToken && g.Credential != apiv1.CredentialClientCertificate {
				add(gpath+".credential", "must be %q or %q", apiv1.CredentialToken, apiv1.CredentialClientCertificate)
			}
			switch g.Access {
			case apiv1.AccessDirect:
			case apiv1.AccessGateway:
				if g.Credential != apiv1.CredentialToken {
					add(gpath+".access", "gateway needs credential token: the gateway forwards a lease's requests as its ServiceAccount")
				}
				if len(g.Audiences) > 0 {
					add(gpath+".audiences", "must be empty with access gateway: a lease certificate is good at the gateway only, for no audience")
				}
			default:
				add(gpath+".access", "must be %q or %q", apiv1.AccessDirect, apiv1.AccessGateway)
			}
			if len(g.Workloads) > 0 && peer.WorkloadIdentity == nil {
				add(gpath+".workloads", "needs %s.workloadIdentity: without it no workload can prove itself (by token or pod certificate)", path)
			}
			validateGrantAudiences(g, gpath, add)
			for k, w := range g.Workloads {
				validateWorkloadRef(fmt.Sprintf("%s.workloads[%d]", gpath, k), w, add)
			}
		}
	}
	if len(probs) > 0 {
		return &apiv1.ValidationError{Document: "policy", Problems: probs}
	}
	return nil
}

// validateWorkloadRef checks a workload a policy names: a namespace (a
// DNS-1123 label) and a ServiceAccount (a DNS-1123 subdomain).
func validateWorkloadRef(path string, w WorkloadRef, add func(field, format string, args ...any)) {
	switch errs := validation.IsDNS1123Label(w.Namespace); {
	case w.Namespace == "":
		add(path+".namespace", "is required")
	case len(errs) > 0:
		add(path+".namespace", "%s", strings.Join(errs, "; "))
	}
	switch errs := validation.IsDNS1123Subdomain(w.ServiceAccount); {
	case w.ServiceAccount == "":
		add(path+".serviceAccount", "is required")
	case len(errs) > 0:
		add(path+".serviceAccount", "%s", strings.Join(errs, "; "))
	}
}

// validateWorkloadIdentity checks one peer's workloadIdentity; an inline
// jwks is parsed here (a jwksFile by the loader).
func validateWorkloadIdentity(path string, wi *WorkloadIdentitySpec, add func(field, format string, args ...any)) {
	if wi.PodCertificates && !wi.TrustsTokens() {
		if wi.MaxTokenAge != 0 || wi.JWKSOverlap != 0 || wi.RequirePodBinding {
			add(path, "token settings (maxTokenAge, jwksOverlap, requirePodBinding) need the token trust too: issuer, audiences and a key set")
		}
		// The live Pods apply to pod certificates as well: the peer's
		// agent reports them without uploading keys.
		validateLivePodsMaxAge(path, wi, add)
		return
	}
	switch {
	case wi.Issuer == "":
		add(path+".issuer", "is required: the iss of the peer cluster's ServiceAccount tokens")
	case len(wi.Issuer) > maxIssuerLen || !printableASCII(wi.Issuer):
		add(path+".issuer", "must be at most %d printable ASCII characters", maxIssuerLen)
	}
	if len(wi.Audiences) == 0 {
		add(path+".audiences", "must list at least one audience, such as tokenbroker.<cluster>")
	}
	if len(wi.Audiences) > maxWorkloadAudiences {
		add(path+".audiences", "at most %d audiences", maxWorkloadAudiences)
	}
	for i, a := range wi.Audiences {
		if strings.TrimSpace(a) == "" || len(a) > 256 || !printableASCII(a) {
			add(fmt.Sprintf("%s.audiences[%d]", path, i), "must be 1 to 256 printable ASCII characters")
		}
	}
	sources := 0
	for _, set := range []bool{wi.JWKS != "", wi.JWKSFile != "", wi.JWKSFromPeer} {
		if set {
			sources++
		}
	}
	if sources != 1 {
		add(path+".jwks", "give exactly one of jwks, jwksFile and jwksFromPeer: true")
	}
	if wi.JWKS != "" {
		keys, err := pki.ParseJWKS([]byte(wi.JWKS))
		if err != nil {
			add(path+".jwks", "%v", err)
		}
		wi.keys = keys
	}
	if d := time.Duration(wi.MaxTokenAge); d != 0 && (d < MinWorkloadTokenAge || d > MaxWorkloadTokenAge) {
		add(path+".maxTokenAge", "must be between %s and %s", MinWorkloadTokenAge, MaxWorkloadTokenAge)
	}
	if d := time.Duration(wi.JWKSOverlap); d != 0 {
		if !wi.JWKSFromPeer {
			add(path+".jwksOverlap", "only applies with jwksFromPeer: true (a pinned set changes when you change it)")
		} else if d < time.Second || d > MaxJWKSOverlap {
			add(path+".jwksOverlap", "must be between 1s and %s", MaxJWKSOverlap)
		}
	}
	if wi.LivePodsFromPeer {
		if !wi.JWKSFromPeer {
			add(path+".livePodsFromPeer", "needs jwksFromPeer: true (the peer's agent reports its keys and its Pods)")
		}
		if !wi.RequirePodBinding {
			add(path+".livePodsFromPeer", "needs requirePodBinding: true (a token bound to no Pod could not be checked against the report)")
		}
	}
	validateLivePodsMaxAge(path, wi, add)
}

// validateLivePodsMaxAge checks livePodsMaxAge, for token trust and pod
// certificates alike.
func validateLivePodsMaxAge(path string, wi *WorkloadIdentitySpec, add func(field, format string, args ...any)) {
	if d := time.Duration(wi.LivePodsMaxAge); d != 0 {
		if !wi.LivePodsFromPeer {
			add(path+".livePodsMaxAge", "only applies with livePodsFromPeer: true")
		} else if d < MinLivePodsMaxAge || d > MaxLivePodsMaxAge {
			add(path+".livePodsMaxAge", "must be between %s and %s", MinLivePodsMaxAge, MaxLivePodsMaxAge)
		}
	}
}

func printableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// validSPIFFEID checks that id is a cluster identity,
// spiffe://<trust-domain>/cluster/<name>: the only form a client
// certificate can carry, so any other could never match a caller.
func ValidSPIFFEID(id string) error {
	if id == "" {
		return errors.New("is required")
	}
	if _, _, err := pki.ParseIdentity(id); err != nil {
		return fmt.Errorf("%q is not a cluster identity spiffe://<trust-domain>/cluster/<name>: %w", id, err)
	}
	return nil
}

// Peer returns the policy of the peer with the given identity, or nil.
func (p *Policy) Peer(identity string) *PeerSpec {
	for i := range p.Peers {
		if p.Peers[i].Identity == identity {
			return &p.Peers[i]
		}
	}
	return nil
}

// CertificateTTL returns the lifetime of a client certificate for
// identity: the peer's certificateTTL if the policy names one, else def.
func (p *Policy) CertificateTTL(identity string, def time.Duration) time.Duration {
	if peer := p.Peer(identity); peer != nil && peer.CertificateTTL != 0 {
		return time.Duration(peer.CertificateTTL)
	}
	return def
}

// namespaces returns the namespaces the peer's grants name, sorted, each
// once.
func (ps *PeerSpec) Namespaces() []string {
	var out []string
	for _, g := range ps.Grants {
		out = append(out, g.Namespaces...)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// Namespaces returns every namespace any grant names, sorted, each once:
// the namespaces where the broker creates lease Secrets.
func (p *Policy) Namespaces() []string {
	var out []string
	for i := range p.Peers {
		out = append(out, p.Peers[i].Namespaces()...)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// Decision is the outcome of an allowed request: who asked, under which
// grant, and with which lifetime.
type Decision struct {
	Peer       string
	Credential string
	// Role is what a client certificate's user gets (zero for a token).
	Role         issuers.RoleRef
	RequestedTTL time.Duration
	TTL          time.Duration
	// ClampedBy names the limit that changed the requested TTL, or "".
	ClampedBy string
	// Grant names the grant that allowed the request (GrantSpec.Name, or
	// its position "grants[i]" for an unnamed one): the lease records it.
	Grant string
	// Access is the grant's mode (apiv1.AccessDirect or AccessGateway).
	Access string
}

// Clamp reasons, as reported in clampedBy.
const (
	ClampedByGrant     = "grant.maxTTL"
	ClampedByPolicy    = "policy.maxTTL"
	ClampedByAPIServer = "apiserver"
	// ClampedBySigner: the cluster's signer issued a certificate that
	// expires sooner than asked (it caps certificates at its CA's expiry).
	ClampedBySigner = "signer"
	// ClampedByLeaseMinimum: a TTL raised to the lease minimum
	// (lease.MinTTL).
	ClampedByLeaseMinimum = "lease.minimum"
)

// DecideIn authorizes a request and chooses its TTL, matching grants'
// namespace selectors against the labels nss reports (nil: selectors
// match nothing). requested and minTTL are zero when the caller gave none. It fails with KindForbidden when no
// grant allows the request (the same error whatever the reason, so a peer
// cannot probe the policy), and with KindUnprocessable when the grant
// cannot give at least minTTL.
func (p *Policy) DecideIn(nss NamespaceLabels, identity, namespace, serviceAccount, credential string, requested, minTTL time.Duration) (Decision, error) {
	return p.DecideFor(nss, identity, nil, namespace, serviceAccount, credential, requested, minTTL)
}

// DecideFor is DecideIn for a request that may carry a verified workload
// (nil: none). A grant that names workloads matches only a request whose
// workload is one of them.
func (p *Policy) DecideFor(nss NamespaceLabels, identity string, workload *WorkloadRef, namespace, serviceAccount, credential string, requested, minTTL time.Duration) (Decision, error) {
	return p.decideFor(nss, identity, workload, namespace, serviceAccount, credential, "", nil, requested, minTTL)
}

// decideFor is DecideFor for a request that names audiences (nil: none):
// a grant matches only if it lists every one (audiences.go).
// access, if set, is the mode the request asks for: only grants of that
// mode match.
func (p *Policy) decideFor(nss NamespaceLabels, identity string, workload *WorkloadRef, namespace, serviceAccount, credential, access string, audiences []string, requested, minTTL time.Duration) (Decision, error) {
	if credential == "" {
		credential = apiv1.CredentialToken
	}
	peer := p.Peer(identity)
	if peer == nil {
		return Decision{}, problem.Errorf(problem.KindForbidden, "no grant allows this request")
	}
	var grant *GrantSpec
	audienceOnly := false // a grant matched but for the audiences
	for i := range peer.Grants {
		g := &peer.Grants[i]
		// A certificate grant names no ServiceAccount (the request none).
		saOK := slices.Contains(g.ServiceAccounts, serviceAccount) || (credential == apiv1.CredentialClientCertificate && serviceAccount == "")
		accessOK := access == "" || access == g.Access
		if g.Credential == credential && accessOK && g.Covers(nss, namespace) && saOK && g.admits(workload) {
			if !g.allowsAudiences(audiences) {
				audienceOnly = true
				continue
			}
			// The most generous matching grant wins, so that adding a grant
			// never takes anything away.
			if grant == nil || p.grantMax(g) > p.grantMax(grant) {
				grant = g
			}
		}
	}
	if grant == nil && audienceOnly {
		return Decision{}, &problem.Error{Kind: problem.KindForbidden, Detail: "no grant allows this request", Err: ErrAudienceNotGranted}
	}
	if grant == nil {
		return Decision{}, problem.Errorf(problem.KindForbidden, "no grant allows this request")
	}
	d := Decision{Peer: peer.Name, Credential: credential, Role: grant.roleRef(), RequestedTTL: requested, Access: grant.Access}
	d.Grant = peer.GrantRef(grant)
	if requested == 0 {
		requested = time.Duration(p.TTL.Default)
	}
	d.TTL, d.ClampedBy = p.clamp(grant, requested)
	if minTTL > 0 && d.TTL < minTTL {
		return Decision{}, problem.Errorf(problem.KindUnprocessable,
			"minTTL %s cannot be granted: at most %s is allowed (%s)", minTTL, d.TTL, OrDefault(d.ClampedBy, "requested ttl"))
	}
	return d, nil
}

// admits reports whether the grant applies to a request from workload
// (nil: no workload token): a grant without workloads applies to the
// peer and to every workload that asks over the peer's connection, never
// to one that proved itself alone (a pod certificate, which any
// namespace's ServiceAccount of the peer's cluster may have): that one
// gets only the grants that name it.
func (g *GrantSpec) admits(w *WorkloadRef) bool {
	if len(g.Workloads) == 0 {
		return w == nil || !w.Standalone
	}
	return w != nil && slices.ContainsFunc(g.Workloads, func(x WorkloadRef) bool {
		return x.Namespace == w.Namespace && x.ServiceAccount == w.ServiceAccount
	})
}

func OrDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

func (p *Policy) grantMax(g *GrantSpec) time.Duration {
	if g.MaxTTL != 0 {
		return time.Duration(g.MaxTTL)
	}
	return time.Duration(p.TTL.Max)
}

// clamp bounds ttl by the grant's maximum (or the policy's). The issuer's
// own limits (a minimum lifetime) are applied by the broker once it knows
// the issuer.
func (p *Policy) clamp(g *GrantSpec, ttl time.Duration) (time.Duration, string) {
	switch {
	case g.MaxTTL != 0 && ttl > time.Duration(g.MaxTTL):
		return time.Duration(g.MaxTTL), ClampedByGrant
	case ttl > time.Duration(p.TTL.Max):
		return time.Duration(p.TTL.Max), ClampedByPolicy
	}
	return ttl, ""
}

// Grants returns the peer name and grants that apply to identity; an
// unknown identity gets "" and an empty (non-nil) list.
func (p *Policy) Grants(identity string) (string, []apiv1.Grant) {
	return p.GrantsFor(identity, nil, false, nil)
}

// GrantsFor is Grants as they apply to one workload of the peer when
// onlyWorkload is set (w nil: a request without a workload token, which
// grants naming workloads never match); otherwise every grant of the peer.
// describe, if set, adds what the caller knows of each grant (the
// namespaces a selector matches now).
func (p *Policy) GrantsFor(identity string, w *WorkloadRef, onlyWorkload bool, describe func(peer string, g *GrantSpec, out *apiv1.Grant)) (string, []apiv1.Grant) {
	peer := p.Peer(identity)
	if peer == nil {
		return "", []apiv1.Grant{}
	}
	out := make([]apiv1.Grant, 0, len(peer.Grants))
	for i := range peer.Grants {
		g := &peer.Grants[i]
		if onlyWorkload && !g.admits(w) {
			continue
		}
		var workloads []apiv1.WorkloadRef
		for _, wr := range g.Workloads {
			workloads = append(workloads, apiv1.WorkloadRef{Namespace: wr.Namespace, ServiceAccount: wr.ServiceAccount})
		}
		out = append(out, apiv1.Grant{
			Workloads:       workloads,
			Namespaces:      slices.Clone(g.Namespaces),
			ServiceAccounts: slices.Clone(g.ServiceAccounts),
			Role:            g.Role,
			ClusterRole:     g.ClusterRole,
			MaxTTL:          p.grantMax(g).String(),
			Credential:      g.Credential,
			Audiences:       slices.Clone(g.Audiences),
			Access:          gatewayOnly(g.Access),
		})
		if describe != nil {
			describe(peer.Name, g, &out[len(out)-1])
		}
	}
	return peer.Name, out
}

// gatewayOnly is access as whoami tells it: "gateway", or nothing for
// the default direct mode (as before access existed).
func gatewayOnly(access string) string {
	if access == apiv1.AccessGateway {
		return access
	}
	return ""
}

// ParseTTLs parses a request's ttl and minTTL; empty means zero. A
// duration that is not positive is KindInvalid with a field error.
func ParseTTLs(ttl, minTTL string) (time.Duration, time.Duration, error) {
	var fields []apiv1.FieldError
	parse := func(name, s string) time.Duration {
		if s == "" {
			return 0
		}
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			fields = append(fields, apiv1.FieldError{Field: name, Detail: `must be a positive Go duration such as "1h"`})
			return 0
		}
		return d
	}
	t, m := parse("ttl", ttl), parse("minTTL", minTTL)
	if len(fields) > 0 {
		return 0, 0, problem.Invalid(fields...)
	}
	return t, m, nil
}
