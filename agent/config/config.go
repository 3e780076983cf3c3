package config

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// Config is the agent's configuration file (agent.yaml), read by
// Load: strict YAML (an unknown key is an error), defaults filled in
// by Default, every problem reported by Validate with its field path.
// Durations are Go duration strings; every field not marked required has a
// default; a zero number means "the default". Relative paths are relative
// to the file's directory.
//
//	identity:
//	  dir: /var/run/tokenbroker/identity        # tls.crt, tls.key, ca.crt (or secret:, or podCertificate:)
//	  podCertificate: {dir: /var/run/tokenbroker/pod}  # its own Pod's certificate, from the kubelet (Kubernetes 1.37+)
//	  secret: {namespace: tokenbroker-agent, name: agent-identity}  # kubernetes.io/tls + ca.crt, in the source cluster
//	  renewBroker: https://east.example.com:8443  # mTLS listener that renews; default: the first target's broker
//	  renewAt: 0.66                                # fraction of the certificate's lifetime
//	  enroll:                                      # used only while there is no certificate yet
//	    broker: https://east.example.com:8444
//	    caFingerprint: sha256:3f1c...
//	    tokenFile: /var/run/tokenbroker/join/token
//	  trustBundleFrom:                             # verify brokers with ClusterTrustBundles instead of ca.crt
//	    clusterTrustBundle: {signerName: tokenbroker.io/east, labelSelector: {matchLabels: {app.kubernetes.io/managed-by: tokenbroker}}}
//	refresh: {fraction: 0.66, jitter: 0.1, minBackoff: 1s, maxBackoff: 5m, revokeGrace: 10m}
//	targets:
//	  - name: east
//	    broker: https://east.example.com:8443
//	    request: {namespace: argo, serviceAccount: admiralty-source, ttl: 12h, minTTL: 1h}  # access: gateway for the lease gateway
//	    refresh: {revokeGrace: 5m}                 # overrides the top level, field by field
//	    outputs:
//	      - secret: {namespace: admiralty, name: east, format: admiralty}
//	      - secret: {namespace: argocd, name: east, format: argocd, labels: {team: a}, annotations: {owner: b},
//	                 argocd: {project: team-a, namespaces: [apps], clusterResources: false, shard: 1}}
//	      - secret: {namespace: kargo, name: east, format: kubeconfig, key: kubeconfig.yaml, adopt: true}
//	      - file: {path: /shared/east.kubeconfig}   # and /shared/east.kubeconfig.meta
//	podSigner:                                     # sign this cluster's pod certificates (Kubernetes 1.37+)
//	  signerName: tokenbroker.io/workloads
//	  maxLifetime: 24h
//	opsAddress: ":9091"
//	kubeconfig: ""                                 # the source cluster; empty: in-cluster
type Config struct {
	Identity IdentityConfig `json:"identity"`
	// Refresh holds the defaults of every target's refresh.
	Refresh RefreshConfig  `json:"refresh,omitempty"`
	Targets []TargetConfig `json:"targets"`
	// JWKSUpload, if set, uploads this cluster's key set to brokers, for
	// workload identity without a public issuer.
	JWKSUpload *JWKSUploadConfig `json:"jwksUpload,omitempty"`
	// PodSigner, if set, makes the agent this cluster's pod-certificate
	// signer: it asks for the cluster's CA when it enrolls and renews, and
	// signs with it the PodCertificateRequests of SignerName.
	PodSigner *PodSignerConfig `json:"podSigner,omitempty"`
	// OpsAddress serves /healthz, /readyz and /metrics; default ":9091".
	OpsAddress string `json:"opsAddress,omitempty"`
	// Kubeconfig of the source cluster for secret outputs and a secret
	// identity; empty means in-cluster.
	Kubeconfig string `json:"kubeconfig,omitempty"`
}

// IdentityConfig says where the agent's client certificate lives and how
// it is obtained and renewed. Exactly one of Dir, Secret and
// PodCertificate is required. The trust bundle that verifies every broker
// is the identity's ca.crt, or, with TrustBundleFrom, the
// ClusterTrustBundles it names.
type IdentityConfig struct {
	// Dir holds tls.crt, tls.key (0600) and ca.crt (see IdentityDir).
	Dir string `json:"dir,omitempty"`
	// Secret is a Secret of the source cluster with the keys tls.crt,
	// tls.key and ca.crt, so that a Deployment keeps its identity across
	// restarts without a volume; made as kubernetes.io/tls if absent.
	Secret *ObjectRef `json:"secret,omitempty"`
	// PodCertificate makes the agent's own Pod certificate its identity:
	// no key is stored, nothing is enrolled or renewed.
	PodCertificate *PodCertificateIdentity `json:"podCertificate,omitempty"`
	// RenewBroker is the mTLS listener that renews the certificate;
	// default: the first target's broker.
	RenewBroker string `json:"renewBroker,omitempty"`
	// RenewAt is the fraction of the certificate's lifetime (NotBefore to
	// NotAfter) after which it is renewed, in (0, 1); default 0.66.
	RenewAt float64 `json:"renewAt,omitempty"`
	// Enroll is used only while there is no (valid) certificate.
	Enroll *EnrollConfig `json:"enroll,omitempty"`
	// TrustBundleFrom, if set, is where the CAs that verify every broker
	// come from instead of the identity's ca.crt (which enrollment and
	// renewal still write and check).
	TrustBundleFrom *TrustBundleSource `json:"trustBundleFrom,omitempty"`
}

// TrustBundleSource is a source of broker CAs other than ca.crt; exactly
// one field is set.
type TrustBundleSource struct {
	ClusterTrustBundle *ClusterTrustBundleSource `json:"clusterTrustBundle,omitempty"`
}

// ClusterTrustBundleSource takes the broker CAs from the ClusterTrustBundles
// (certificates.k8s.io/v1, Kubernetes 1.37 or later) of the agent's own
// cluster that are linked to SignerName: only someone allowed to attest for
// that signer can write those, whereas anyone who may create
// clustertrustbundles can make one without a signer, which is never read.
// The certificates of every matching bundle are merged (as the kubelet's
// clusterTrustBundle projection does); a bundle that is malformed or holds
// a certificate that is not a CA is skipped and logged. When
// identity.enroll.caFingerprint is set, only the pinned CA and CAs that
// chain to it are kept, the pinned CA the only root. The bundles are read
// again every Interval, so that a CA rotation reaches the agent. A read
// the API answers is authoritative: if it keeps nothing, no broker is
// trusted until one does; a failed read keeps the CAs in service for 10
// intervals. One signer verifies every target's broker.
type ClusterTrustBundleSource struct {
	// SignerName selects the bundles (required), e.g. tokenbroker.io/east,
	// what the broker's --publish-cluster-trust-bundle names.
	SignerName string `json:"signerName"`
	// LabelSelector narrows them further; empty selects every bundle of
	// the signer.
	LabelSelector *metav1.LabelSelector `json:"labelSelector,omitempty"`
	// Interval is how often the bundles are read; default 1m, between 1s
	// and 1h.
	Interval apiv1.Duration `json:"interval,omitempty"`
}

// EnrollConfig is the first-start enrollment with a join token. All
// fields are required.
type EnrollConfig struct {
	// Broker is the enrollment listener.
	Broker string `json:"broker"`
	// CAFingerprint pins the CA ("sha256:<64 hex>", as "tokenbroker pki
	// join-token" prints it) when the trust bundle is first fetched.
	CAFingerprint string `json:"caFingerprint"`
	// TokenFile holds the join token. It is read once, never logged (its
	// jti is) and not deleted: the broker refuses a second use.
	TokenFile string `json:"tokenFile"`
}

// RefreshConfig is when and how a credential is refreshed.
type RefreshConfig struct {
	// Fraction of the granted lifetime after which to refresh, in (0, 1);
	// default 2/3.
	Fraction float64 `json:"fraction,omitempty"`
	// Jitter is the largest random part of a refresh delay, as a fraction
	// of it (0.1 = up to 10 % earlier), in [0, 1); default 0.1. Jitter
	// also shortens backoff delays and the certificate's renewal time.
	Jitter float64 `json:"jitter,omitempty"`
	// MinBackoff and MaxBackoff bound the capped exponential backoff after
	// a failed fetch; defaults 1s and 5m.
	MinBackoff apiv1.Duration `json:"minBackoff,omitempty"`
	MaxBackoff apiv1.Duration `json:"maxBackoff,omitempty"`
	// RevokeGrace is how long the previous lease lives on after its
	// successor was written, so consumers can switch; default 10m, long
	// enough for an Admiralty rollout, a Flux reconcile (HelmRelease
	// spec.timeout defaults to 5m) or an Argo CD sync. It must be shorter
	// than the credential's remaining life when it is replaced.
	RevokeGrace apiv1.Duration `json:"revokeGrace,omitempty"`
}

// TargetConfig is one kubeconfig the agent keeps fresh.
type TargetConfig struct {
	// Name identifies the target in logs and metrics (a DNS label,
	// unique); it is also the Argo CD cluster name.
	Name string `json:"name"`
	// Broker is the target broker's mTLS listener (https, required).
	Broker  string        `json:"broker"`
	Request RequestConfig `json:"request"`
	// Outputs are where the credential is written; at least one, and no
	// two outputs (of any target) write the same Secret or file.
	Outputs []OutputConfig `json:"outputs"`
	// Refresh overrides the top-level refresh settings.
	Refresh *RefreshConfig `json:"refresh,omitempty"`
	// WorkloadTokenFile, if set, is a ServiceAccount token of this cluster
	// (a projected token with the broker's audience) sent with every
	// request of the target, so that the broker grants what the policy
	// grants that workload (grants[].workloads). Read at every request: the
	// kubelet rotates it in place.
	WorkloadTokenFile string `json:"workloadTokenFile,omitempty"`
}

// JWKSUploadConfig makes the agent upload its cluster's service-account key
// set (/openid/v1/jwks, read with its Kubernetes client) to brokers whose
// policy says workloadIdentity.jwksFromPeer: at start, whenever it changes
// and at least every ResyncInterval.
type JWKSUploadConfig struct {
	// Brokers are the mTLS listeners to upload to (https, at least one).
	Brokers []string `json:"brokers"`
	// Keys, if false, uploads no key set, only the live Pods (LivePods is
	// then required): for brokers that trust this cluster's pod
	// certificates and none of its tokens (workloadIdentity
	// {podCertificates: true, livePodsFromPeer: true}), which answer a key
	// set 403. Default true.
	Keys *bool `json:"keys,omitempty"`
	// Interval is how often the key set is read; default 1m.
	Interval apiv1.Duration `json:"interval,omitempty"`
	// ResyncInterval is how often an unchanged set is uploaded again (the
	// broker changes nothing then), so that a broker whose Secret was lost
	// heals; default 10m.
	ResyncInterval apiv1.Duration `json:"resyncInterval,omitempty"`
	// LivePods, if set, also reports to the same brokers the Pods that
	// live in this cluster, for brokers whose policy says
	// workloadIdentity.livePodsFromPeer: they honour a Pod's token or pod
	// certificate only while the Pod is in the last report. Needs list
	// and watch on Pods.
	LivePods *LivePodsConfig `json:"livePods,omitempty"`
}

// UploadsKeys says whether the key set is uploaded (Keys unset or true).
func (u *JWKSUploadConfig) UploadsKeys() bool { return u.Keys == nil || *u.Keys }

// PodCertificateIdentity is an agent identity that is its own Pod's
// certificate (KEP-4317, Kubernetes 1.37 or later): the kubelet makes the
// key, which never leaves the node, and gets the certificate from the
// cluster's pod signer (another agent's podSigner) for the Pod's
// ServiceAccount; brokers whose policy names that ServiceAccount as the
// peer's agent (peers[].agent) take it for the cluster. The kubelet
// rotates it; the agent reads it again every minute. Neither enroll,
// renewBroker nor podSigner apply: a signer cannot have a certificate of
// its own, since the kubelet starts its Pod only once it is signed. Nor
// jwksUpload: brokers take the key set and the live Pods, on which a pod
// certificate's standing depends, from a client certificate only.
type PodCertificateIdentity struct {
	// Dir (required) is the projected volume: tls.crt (the volume's
	// certificateChainPath), tls.key (keyPath) and ca.crt, the CAs that
	// verify the brokers (a ConfigMap or clusterTrustBundle source of the
	// same volume, so that the kubelet swaps them together).
	Dir string `json:"dir"`
}

// PodSignerConfig is the agent's pod-certificate signer (KEP-4317,
// certificates.k8s.io/v1 PodCertificateRequests, Kubernetes 1.37 or
// later). The cluster's CA comes with the agent's identity: enrollment and
// renewal ask the broker for it (its --sign-cluster-cas must be on), and
// it is kept beside tls.crt and tls.key (cluster-ca.crt, cluster-ca.key).
// A Pod gets a certificate of its ServiceAccount's workload identity if
// its ServiceAccount is labelled tokenbroker.io/pod-certificates=true.
type PodSignerConfig struct {
	// SignerName (required) is the signer name Pods' podCertificate
	// volumes ask for, a domain-prefixed path such as
	// tokenbroker.io/workloads; not a kubernetes.io name.
	SignerName string `json:"signerName"`
	// MaxLifetime bounds every certificate; default 24h, between 1h (the
	// API's minimum) and 91 days. A request may ask for less.
	MaxLifetime apiv1.Duration `json:"maxLifetime,omitempty"`
}

// LivePodsConfig says which Pods the agent reports and how often.
type LivePodsConfig struct {
	// Audiences: a Pod is reported if one of its projected
	// serviceAccountToken volumes is for one of them (the brokers'
	// workloadIdentity audiences). With PodSigner, a Pod whose projected
	// podCertificate volume names its SignerName is reported too, and
	// Audiences may be empty (brokers that trust pod certificates alone);
	// without, at least one is required. A report holds at most 1024 Pods.
	Audiences []string `json:"audiences,omitempty"`
	// Namespaces, if set, reports only the Pods of these namespaces (those
	// of the workloads the brokers grant): a tenant elsewhere who can
	// create Pods cannot then push the report over its bound.
	Namespaces []string `json:"namespaces,omitempty"`
	// Interval is how often an unchanged report is sent again, so that the
	// brokers know the agent is alive; default 30s. Keep it well under the
	// brokers' livePodsMaxAge (default 2m). A change is reported within a
	// second.
	Interval apiv1.Duration `json:"interval,omitempty"`
}

// RequestConfig is the POST /v1/kubeconfigs body the target sends
// (apiv1.RequestSpec, with the request's field names): namespace and
// serviceAccount are required; ttl and minTTL are Go durations (empty: the
// broker's policy decides).
//
// Credential is "token" (the default) or "clientCertificate": a client
// certificate for a per-lease user with the grant's role, whose key the
// agent makes itself and never sends (no serviceAccount then).
//
// Access is "direct" (a credential of the API server), "gateway" (a client
// certificate for this one lease, good only at the broker's lease gateway,
// which the kubeconfig's server then is; the agent makes the key and never
// sends it) or empty: the mode of the grant that allows the request.
// Gateway takes a serviceAccount, credential token (or none) and no
// audiences; every output carries the certificate and key but a file
// output's tokenFile, which holds a token only.
type RequestConfig apiv1.RequestSpec

// OutputConfig is one place a credential is written; exactly one of
// Secret, File and ClusterProfile.
type OutputConfig struct {
	Secret         *SecretOutput         `json:"secret,omitempty"`
	File           *FileOutput           `json:"file,omitempty"`
	ClusterProfile *ClusterProfileOutput `json:"clusterProfile,omitempty"`
}

// ClusterProfileOutput publishes the target as a ClusterProfile access
// provider (sigs.k8s.io/cluster-inventory-api, multicluster.x-k8s.io/v1alpha1):
// one status.accessProviders entry named "tokenbroker" on the
// ClusterProfile Namespace/Name, holding the cluster entry of the broker's
// kubeconfigs (server, CA, tls-server-name, proxy-url) and, as its
// client.authentication.k8s.io/exec extension, the target (an
// apiv1.PluginTarget) that "tokenbroker credential" reads there. It holds
// no credential: consumers (MultiKueue, multicluster-runtime, Argo CD's
// ClusterProfile integration) run the plugin, so the target's lease is
// revoked once the entry is written, as with Argo CD's exec mode. The
// entry is written only when it changes: each status write makes those
// consumers rebuild their client and watches for the cluster.
type ClusterProfileOutput struct {
	// Namespace is the inventory (a consumer reads profiles in one
	// namespace: Kueue's own, for MultiKueue).
	Namespace string `json:"namespace"`
	// Name of the ClusterProfile; default the target's name.
	Name string `json:"name,omitempty"`
	// ClusterManager, if set, says the agent is the cluster manager of
	// this profile: it creates the ClusterProfile when it is missing, with
	// spec.clusterManager.name and the x-k8s.io/cluster-manager label set
	// to this, and keeps its ControlPlaneHealthy condition: True while the
	// broker answers, False when it does not. Without it the agent only
	// adds its entry to a ClusterProfile that someone else manages, and
	// waits (with backoff) for it to exist.
	ClusterManager string `json:"clusterManager,omitempty"`
}

// AccessProviderName is the name of the agent's entry in a
// ClusterProfile's status.accessProviders, and the provider name in a
// consumer's provider file.
const AccessProviderName = "tokenbroker"

// Secret output formats.
const (
	FormatAdmiralty  = "admiralty"  // key "config", as Admiralty's Target kubeconfigSecret reads it
	FormatArgoCD     = "argocd"     // Argo CD cluster Secret: name, server, config (bearerToken or tlsClientConfig.{certData,keyData}, tlsClientConfig.{caData,serverName}, proxyUrl)
	FormatFlux       = "flux"       // key "value", label reconcile.fluxcd.io/watch: Enabled
	FormatKubeconfig = "kubeconfig" // key "kubeconfig"
	// FormatMultiKueue is the Secret a MultiKueueCluster's
	// spec.clusterSource.kubeConfig names (locationType Secret, in Kueue's
	// namespace): key "kubeconfig" (fixed), the broker's kubeconfig with
	// its inline token or client certificate and certificate-authority-data,
	// the only shapes Kueue ≥ v0.15 accepts.
	FormatMultiKueue = "multikueue"
)

// SecretOutput is a Secret in the source cluster, of type Opaque,
// labelled app.kubernetes.io/managed-by: tokenbroker-agent and annotated
// with the lease (see the Annotation constants). The agent writes only
// the keys, labels and annotations it owns (recorded in the
// tokenbroker.io/owned annotation) and keeps every other one, so that
// what a user or `argocd cluster set` adds survives a refresh. It never
// takes over a Secret without its label unless Adopt says so.
type SecretOutput struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Format    string `json:"format"`
	// Key is the data key that holds the kubeconfig in the admiralty, flux
	// and kubeconfig formats; default "config", "value" and "kubeconfig".
	// Kargo's chart reads "kubeconfig.yaml"; capsule-proxy users name the
	// key in Flux's secretRef. The argocd format has fixed keys.
	Key string `json:"key,omitempty"`
	// ArgoCD sets the optional keys of an Argo CD cluster Secret (format
	// argocd only). A key left unset here is not the agent's: whatever a
	// user or `argocd cluster set` writes there stays.
	ArgoCD *ArgoCDOptions `json:"argocd,omitempty"`
	// Labels and annotations added to the Secret; the agent's own keys
	// are refused.
	Labels      map[string]string `json:"labels,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
	// Adopt lets the agent take over a Secret of that name that exists
	// without its label (one made by hand, say), keeping every key it
	// does not write. Without it the agent refuses to touch such a Secret.
	Adopt bool `json:"adopt,omitempty"`
}

// ArgoCDOptions are the optional keys of an Argo CD cluster Secret, as
// Argo CD's util/db.SecretToCluster reads them.
type ArgoCDOptions struct {
	// Name is the cluster's name in Argo CD; default: the target's name.
	Name string `json:"name,omitempty"`
	// Project restricts the cluster to one AppProject.
	Project string `json:"project,omitempty"`
	// Namespaces makes Argo CD manage only these namespaces of the
	// cluster (written comma-separated), as the token's RBAC usually
	// allows no more.
	Namespaces []string `json:"namespaces,omitempty"`
	// ClusterResources lets a namespaced cluster manage cluster-scoped
	// resources too; meaningful only with Namespaces.
	ClusterResources *bool `json:"clusterResources,omitempty"`
	// Shard pins the cluster to one application-controller shard.
	Shard *int64 `json:"shard,omitempty"`
	// Exec makes the Secret's config run "tokenbroker credential" in Argo
	// CD (execProviderConfig) instead of holding the credential, so that
	// config changes only when the cluster entry does: every change of
	// config makes the application controller rebuild that cluster's
	// cache.
	Exec *ArgoCDExec `json:"exec,omitempty"`
}

// ArgoCDExec is where Argo CD's pods (the application controller and the
// API server) find the plugin and the identity it presents.
type ArgoCDExec struct {
	// Command is the path of the tokenbroker binary in those pods, e.g.
	// copied there from our image by an init container.
	Command string `json:"command"`
	// IdentityDir is where those pods mount the identity the plugin
	// presents to the broker (tls.crt, tls.key, ca.crt); absolute.
	IdentityDir string `json:"identityDir"`
	// Env is added to the plugin's environment, e.g. XDG_CACHE_HOME for
	// its disk cache on a writable volume.
	Env map[string]string `json:"env,omitempty"`
}

// FileOutput is a kubeconfig file, written atomically with mode 0600 when
// its content changes, next to PATH.meta, a JSON record of the lease.
type FileOutput struct {
	Path string `json:"path"`
	// TokenFile, a file name, puts the token in that file beside Path and
	// writes a kubeconfig whose user has "tokenFile: <TokenFile>" instead
	// of the token. client-go re-reads a token file every minute, so a
	// consumer sharing the volume picks up a refreshed token without a
	// restart, and the kubeconfig itself changes
	// only when the cluster entry does. The path is relative: clientcmd
	// resolves it against the kubeconfig's directory when it loads the
	// file, so the volume may be mounted anywhere. Tokens only.
	TokenFile string `json:"tokenFile,omitempty"`
}

// ObjectRef names a namespaced object.
type ObjectRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
}
