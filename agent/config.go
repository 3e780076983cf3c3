package agent

import "github.com/tokenbroker/tokenbroker/broker"

// Config is the agent's configuration file (agent.yaml). Durations are Go
// duration strings; every field not marked required has a default.
//
//	identity:
//	  dir: /var/run/tokenbroker/identity        # tls.crt, tls.key, ca.crt (or secret:)
//	  secret: {namespace: tokenbroker-agent, name: agent-identity}  # kubernetes.io/tls + ca.crt, in the source cluster
//	  renewBroker: https://east.example.com:8443  # mTLS listener that renews; default: the first target's broker
//	  renewAt: 0.66                                # fraction of the certificate's lifetime
//	  enroll:                                      # used only while there is no certificate yet
//	    broker: https://east.example.com:8444
//	    caFingerprint: sha256:3f1c...
//	    tokenFile: /var/run/tokenbroker/join/token
//	refresh: {fraction: 0.66, jitter: 0.1, minBackoff: 1s, maxBackoff: 5m, revokeGrace: 1m}
//	targets:
//	  - name: east
//	    broker: https://east.example.com:8443
//	    request: {namespace: argo, serviceAccount: admiralty-source, ttl: 12h, minTTL: 1h}
//	    outputs:
//	      - secret: {namespace: admiralty, name: east, format: admiralty}
//	      - file: {path: /shared/east.kubeconfig}
//	opsAddress: ":9091"
type Config struct {
	Identity IdentityConfig `json:"identity"`
	// Refresh holds the defaults of every target's refresh.
	Refresh RefreshConfig  `json:"refresh,omitempty"`
	Targets []TargetConfig `json:"targets"`
	// OpsAddress serves /healthz, /readyz and /metrics; default ":9091".
	OpsAddress string `json:"opsAddress,omitempty"`
	// Kubeconfig of the source cluster for secret outputs and a secret
	// identity; empty means in-cluster.
	Kubeconfig string `json:"kubeconfig,omitempty"`
}

// IdentityConfig says where the agent's client certificate lives and how
// it is obtained and renewed. Exactly one of Dir and Secret is required.
type IdentityConfig struct {
	Dir         string        `json:"dir,omitempty"`
	Secret      *ObjectRef    `json:"secret,omitempty"`
	RenewBroker string        `json:"renewBroker,omitempty"`
	RenewAt     float64       `json:"renewAt,omitempty"`
	Enroll      *EnrollConfig `json:"enroll,omitempty"`
}

// EnrollConfig is the first-start enrollment with a join token.
type EnrollConfig struct {
	Broker        string `json:"broker"`
	CAFingerprint string `json:"caFingerprint"`
	TokenFile     string `json:"tokenFile"`
}

// RefreshConfig is when and how a credential is refreshed.
type RefreshConfig struct {
	// Fraction of the granted lifetime after which to refresh; default 2/3.
	Fraction float64 `json:"fraction,omitempty"`
	// Jitter is the largest random part of a refresh delay, as a fraction
	// of it (0.1 = up to 10 % earlier); default 0.1.
	Jitter float64 `json:"jitter,omitempty"`
	// MinBackoff and MaxBackoff bound the capped exponential backoff after
	// a failed fetch; defaults 1s and 5m.
	MinBackoff broker.Duration `json:"minBackoff,omitempty"`
	MaxBackoff broker.Duration `json:"maxBackoff,omitempty"`
	// RevokeGrace is how long the previous lease lives on after its
	// successor was written, so consumers can switch; default 1m.
	RevokeGrace broker.Duration `json:"revokeGrace,omitempty"`
}

// TargetConfig is one kubeconfig the agent keeps fresh.
type TargetConfig struct {
	// Name identifies the target in logs and metrics (a DNS label).
	Name    string         `json:"name"`
	Broker  string         `json:"broker"`
	Request RequestConfig  `json:"request"`
	Outputs []OutputConfig `json:"outputs"`
	// Refresh overrides the top-level refresh settings.
	Refresh *RefreshConfig `json:"refresh,omitempty"`
}

// RequestConfig is the POST /v1/kubeconfigs body the target sends.
type RequestConfig struct {
	Namespace      string   `json:"namespace"`
	ServiceAccount string   `json:"serviceAccount"`
	TTL            string   `json:"ttl,omitempty"`
	MinTTL         string   `json:"minTTL,omitempty"`
	Audiences      []string `json:"audiences,omitempty"`
}

// OutputConfig is one place a credential is written; exactly one of
// Secret and File.
type OutputConfig struct {
	Secret *SecretOutput `json:"secret,omitempty"`
	File   *FileOutput   `json:"file,omitempty"`
}

// Secret output formats.
const (
	FormatAdmiralty  = "admiralty"  // key "config", as Admiralty's Target kubeconfigSecret reads it
	FormatArgoCD     = "argocd"     // Argo CD cluster Secret: name, server, config (bearerToken, tlsClientConfig.caData)
	FormatFlux       = "flux"       // key "value", label reconcile.fluxcd.io/watch: Enabled
	FormatKubeconfig = "kubeconfig" // key "kubeconfig"
)

// SecretOutput is a Secret in the source cluster.
type SecretOutput struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Format    string `json:"format"`
	// Labels and annotations added to the Secret.
	Labels      map[string]string `json:"labels,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

// FileOutput is a kubeconfig file, written atomically with mode 0600.
type FileOutput struct {
	Path string `json:"path"`
}

// ObjectRef names a namespaced object.
type ObjectRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
}
