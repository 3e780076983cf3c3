package v1

// PluginCommand is the subcommand of the tokenbroker binary that is the
// client-go exec credential plugin.
const PluginCommand = "credential"

// PluginArgs is the command line of the exec credential plugin after the
// binary's name: "credential" and the flags that ask broker for req,
// leaving out those at their defaults, in a fixed order (so that two
// kubeconfigs that ask for the same thing share one cache entry). With an
// empty identityDir the plugin reads $TOKENBROKER_IDENTITY_DIR, which is
// how the broker writes exec kubeconfigs: it does not know where its caller
// keeps its identity. It is the one place that turns a request into the
// plugin's flags, for "tokenbroker get kubeconfig --exec", the agent's
// Argo CD exec mode and POST /v1/kubeconfigs?format=exec.
func PluginArgs(broker, identityDir string, req KubeconfigRequest) []string {
	args := []string{PluginCommand, "--broker", broker}
	if identityDir != "" {
		args = append(args, "--identity-dir", identityDir)
	}
	args = append(args, "--namespace", req.Namespace)
	if req.ServiceAccount != "" {
		args = append(args, "--service-account", req.ServiceAccount)
	}
	if req.Credential == CredentialClientCertificate {
		args = append(args, "--credential", "client-certificate")
	}
	if req.TTL != "" {
		args = append(args, "--ttl", req.TTL)
	}
	if req.MinTTL != "" {
		args = append(args, "--min-ttl", req.MinTTL)
	}
	for _, a := range req.Audiences {
		args = append(args, "--audience", a)
	}
	// The mode its kubeconfig's cluster was made for: a gateway
	// kubeconfig points at the gateway, where a credential of the API
	// server is refused. Nothing for "" (the mode of the grant that
	// allows the request).
	if req.Access != "" {
		args = append(args, "--access", req.Access)
	}
	return args
}

// ExecExtensionKey is the kubeconfig cluster extension whose content
// client-go hands an exec plugin as spec.cluster.config when the exec
// stanza sets provideClusterInfo. A ClusterProfile access provider entry
// carries the plugin's target there (cluster-inventory-api's
// BuildConfigFromCP copies it into the exec config).
const ExecExtensionKey = "client.authentication.k8s.io/exec"

// The apiVersion and kind of PluginTarget. The version changes only with
// an incompatible schema; a plugin refuses a version it does not know and
// any field it does not know, so a target is never half understood.
const (
	PluginTargetAPIVersion = "tokenbroker.io/v1"
	PluginTargetKind       = "PluginTarget"
)

// PluginTarget is what "tokenbroker credential" asks for when it runs as a
// ClusterProfile access provider: the content of the
// client.authentication.k8s.io/exec extension of the ClusterProfile's
// "tokenbroker" access provider entry, which the agent's clusterProfile
// output writes and the plugin reads from spec.cluster.config. The
// identity (the client certificate) is never in it: it is the plugin's
// own, from --identity-dir or TOKENBROKER_IDENTITY_DIR where it runs.
// apiVersion and kind are required (client-go drops a config without a
// kind before it reaches the plugin).
type PluginTarget struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	// Broker is the URL of the broker's mutual-TLS listener.
	Broker string `json:"broker"`
	// RequestSpec is what the plugin asks the broker for. Credential is
	// left empty for CredentialToken, the default; Access empty is the
	// mode of the grant that allows the request, as before access existed.
	RequestSpec
}

// NewPluginTarget is the target of a request to broker, with its
// apiVersion and kind.
func NewPluginTarget(broker string, spec RequestSpec) PluginTarget {
	t := PluginTarget{APIVersion: PluginTargetAPIVersion, Kind: PluginTargetKind, Broker: broker, RequestSpec: spec}
	if t.Credential == CredentialToken {
		t.Credential = ""
	}
	return t
}
