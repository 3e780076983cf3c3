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
	return args
}
