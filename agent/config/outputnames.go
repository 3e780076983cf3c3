package config

import (
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// Labels and annotations on the Secrets the agent writes. The annotations
// let a restarted agent find the credential it wrote (and its lease) and
// schedule from it instead of fetching at once.
const (
	// LabelManagedBy marks the Secrets the agent owns; it refuses to write
	// a Secret without it.
	LabelManagedBy = "app.kubernetes.io/managed-by"
	ManagedByAgent = "tokenbroker-agent"

	AnnotationLeaseID   = "tokenbroker.io/lease-id"
	AnnotationExpiresAt = "tokenbroker.io/expires-at"
	// AnnotationObtainedAt is when the credential arrived, so that a
	// restarted agent refreshes at the same fraction of its lifetime.
	AnnotationObtainedAt = "tokenbroker.io/obtained-at"
	// AnnotationTarget names the target that wrote the Secret.
	AnnotationTarget = "tokenbroker.io/target"
	// AnnotationRequest is a digest of the broker URL and the request, so
	// that a restarted agent whose target now asks for something else
	// (another ServiceAccount, say) does not adopt the old credential.
	AnnotationRequest = "tokenbroker.io/request"
	// AnnotationOwned records, as JSON {"data":[…],"labels":[…],
	// "annotations":[…]}, the keys the agent wrote, so that it can remove
	// one it no longer writes (a data key renamed in the config) without
	// ever touching a key someone else wrote.
	AnnotationOwned = "tokenbroker.io/owned"
	// AnnotationOutput is a digest of the output's settings, so that a
	// restarted agent whose config changed them (a renamed key, a label,
	// an Argo CD option) rewrites the Secret instead of adopting it as it
	// is until the next refresh.
	AnnotationOutput = "tokenbroker.io/output"

	labelArgoCDSecretType = "argocd.argoproj.io/secret-type"
	labelFluxWatch        = "reconcile.fluxcd.io/watch"
)

// agentAnnotations are the annotations the agent writes on every Secret.
var agentAnnotations = []string{AnnotationLeaseID, AnnotationExpiresAt, AnnotationObtainedAt, AnnotationTarget, AnnotationRequest, AnnotationOwned, AnnotationOutput}

// formatLabels are the labels a format sets for its consumer; a
// configuration may not set them on that format.
func FormatLabels(format string) map[string]string {
	switch format {
	case FormatArgoCD:
		return map[string]string{labelArgoCDSecretType: "cluster"}
	case FormatFlux:
		return map[string]string{labelFluxWatch: "Enabled"}
	}
	return nil
}

// metaSuffix names the sidecar file next to a file output that records the
// lease, as the annotations do for a Secret.
const MetaSuffix = ".meta"

// The data keys of the Secret formats.
const (
	keyAdmiralty  = "config"     // Admiralty's Target spec.kubeconfigSecret default key
	keyFlux       = "value"      // Flux's kubeConfig.secretRef default key
	KeyKubeconfig = "kubeconfig" // the plain format
)

// DataKey is the key that holds the kubeconfig, "" for the argocd format.
func (o SecretOutput) DataKey() string {
	if o.Format == FormatArgoCD {
		return ""
	}
	if o.Key != "" {
		return o.Key
	}
	switch o.Format {
	case FormatAdmiralty:
		return keyAdmiralty
	case FormatFlux:
		return keyFlux
	}
	return KeyKubeconfig // kubeconfig and multikueue
}

// Defaults of jwksUpload.
const (
	DefaultJWKSInterval       = time.Minute
	DefaultJWKSResyncInterval = 10 * time.Minute
	DefaultLivePodsInterval   = 30 * time.Second
)

// Bounds of podSigner.maxLifetime: the PodCertificateRequest API's
// maximum maxExpirationSeconds (91 days), and the kubelet's default ask.
const (
	DefaultPodCertificateLifetime = 24 * time.Hour
	MaxPodCertificateLifetime     = 91 * 24 * time.Hour
)

// APIRequest returns the wire form of the request.
func (r RequestConfig) APIRequest() apiv1.KubeconfigRequest {
	return apiv1.RequestSpec(r).Request()
}

// Subject names what a request is for in messages: namespace/ServiceAccount
// (through the lease gateway, for a gateway request), or the namespace's
// client certificate.
func (r RequestConfig) Subject() string {
	if r.Credential == apiv1.CredentialClientCertificate {
		return "a client certificate in " + r.Namespace
	}
	if r.Access == apiv1.AccessGateway {
		return r.Namespace + "/" + r.ServiceAccount + " through the lease gateway"
	}
	return r.Namespace + "/" + r.ServiceAccount
}
