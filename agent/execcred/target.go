package execcred

import (
	"errors"
	"fmt"
	"path/filepath"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// APIVersionV1 and APIVersionV1beta1 are the ExecCredential versions the
// plugin speaks; APIVersionV1 is the one it asks for in the kubeconfigs it
// writes (v1beta1 is for older clients that configured it themselves).
const (
	APIVersionV1      = "client.authentication.k8s.io/v1"
	APIVersionV1beta1 = "client.authentication.k8s.io/v1beta1"
)

// Command is the subcommand of the tokenbroker binary that is the plugin.
const Command = apiv1.PluginCommand

// installHint is what client-go prints when the plugin's command is not
// found: the kubeconfig names a binary that must exist where it is used.
const installHint = `tokenbroker credential is the exec credential plugin of the tokenbroker binary.
Install tokenbroker (see docs/guides/kubectl.md), or correct "command" in this
kubeconfig's user to the path of the tokenbroker binary on this machine.`

// Target is what a plugin invocation asks a broker for, as the flags of
// "tokenbroker credential" say it. It is the one place that turns a request
// into the plugin's command line, so that an exec kubeconfig and any other
// output that runs the plugin (Argo CD's execProviderConfig) pass the same
// arguments and therefore share one cache entry.
type Target struct {
	// Broker is the URL of the broker's mutual-TLS listener.
	Broker string
	// IdentityDir holds tls.crt, tls.key and ca.crt. It should be absolute:
	// client-go runs the plugin in the caller's working directory.
	IdentityDir string
	// RequestSpec is what the plugin asks the broker for. Credential ""
	// and apiv1.CredentialToken both mean a token; Access "" is the mode
	// of the grant that allows the request.
	apiv1.RequestSpec
	// WorkloadTokenFile, if set, is the workload token sent to the broker
	// (an absolute path: a projected ServiceAccount token).
	WorkloadTokenFile string
}

// Args returns the arguments of the plugin's command: "credential" and its
// flags (apiv1.PluginArgs, then --workload-token-file).
func (t Target) Args() []string {
	args := apiv1.PluginArgs(t.Broker, t.IdentityDir, t.Request())
	if t.WorkloadTokenFile != "" {
		args = append(args, "--workload-token-file", t.WorkloadTokenFile)
	}
	return args
}

// ExecConfig is the exec stanza of a kubeconfig user that runs the plugin
// as command (the tokenbroker binary): API version v1, never interactive
// (the plugin reads no input, and a CI job has no terminal), and no cluster
// information, which the plugin does not use.
func ExecConfig(command string, t Target) *clientcmdapi.ExecConfig {
	return &clientcmdapi.ExecConfig{
		APIVersion:         APIVersionV1,
		Command:            command,
		Args:               t.Args(),
		InstallHint:        installHint,
		InteractiveMode:    clientcmdapi.NeverExecInteractiveMode,
		ProvideClusterInfo: false,
	}
}

// Kubeconfig returns a kubeconfig whose one context joins cluster (named
// clusterName) to a user that runs the plugin, in t's namespace. It is
// checked with clientcmd's own validation before it is written, so that a
// kubeconfig kubectl would refuse is never handed out. The identity
// directory must be absolute, for the same reason as in Target.
func Kubeconfig(clusterName string, cluster *clientcmdapi.Cluster, command string, t Target) ([]byte, error) {
	if cluster == nil || cluster.Server == "" {
		return nil, errors.New("exec kubeconfig: the cluster has no server")
	}
	if clusterName == "" {
		return nil, errors.New("exec kubeconfig: the cluster has no name")
	}
	if command == "" {
		return nil, errors.New("exec kubeconfig: the plugin's command is empty")
	}
	if !filepath.IsAbs(t.IdentityDir) {
		return nil, fmt.Errorf("exec kubeconfig: the identity directory %q must be an absolute path: kubectl runs the plugin in its own working directory", t.IdentityDir)
	}
	userName := t.ServiceAccount
	if t.Credential == apiv1.CredentialClientCertificate {
		userName = "client-certificate"
	}
	userName += "@" + clusterName
	contextName := t.Namespace + "/" + userName

	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[clusterName] = cluster.DeepCopy()
	user := clientcmdapi.NewAuthInfo()
	user.Exec = ExecConfig(command, t)
	cfg.AuthInfos[userName] = user
	ctx := clientcmdapi.NewContext()
	ctx.Cluster, ctx.AuthInfo, ctx.Namespace = clusterName, userName, t.Namespace
	cfg.Contexts[contextName] = ctx
	cfg.CurrentContext = contextName
	if err := clientcmd.Validate(*cfg); err != nil {
		return nil, fmt.Errorf("exec kubeconfig: %w", err)
	}
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("exec kubeconfig: %w", err)
	}
	return data, nil
}

// KubeconfigFromBroker is Kubeconfig with the cluster entry (its name,
// server, CA, tls-server-name, proxy-url) of the current context of a
// kubeconfig the broker issued. That kubeconfig holds a credential: errors
// never quote it, and nothing of its user is kept.
func KubeconfigFromBroker(brokerKubeconfig []byte, command string, t Target) ([]byte, error) {
	name, cluster, err := currentCluster(brokerKubeconfig)
	if err != nil {
		return nil, fmt.Errorf("exec kubeconfig: %w", err)
	}
	// Load records where each entry came from; a kubeconfig written for
	// another place must not carry that.
	cluster = cluster.DeepCopy()
	cluster.LocationOfOrigin = ""
	return Kubeconfig(name, cluster, command, t)
}

// ClusterOfKubeconfig is the cluster entry (server and CA) of the current
// context of a kubeconfig the broker wrote, for CheckCluster. Errors never
// quote the kubeconfig.
func ClusterOfKubeconfig(data []byte) (ClusterRef, error) {
	_, cluster, err := currentCluster(data)
	if err != nil {
		return ClusterRef{}, err
	}
	if cluster.Server == "" {
		return ClusterRef{}, errNoCluster
	}
	return ClusterRef{Server: cluster.Server, CAData: cluster.CertificateAuthorityData}, nil
}

// errNoCluster is a broker's kubeconfig without the cluster entry of its
// current context.
var errNoCluster = errors.New("the broker's kubeconfig names no cluster")

// currentCluster is the name and the entry of the cluster of the current
// context of a kubeconfig the broker wrote. That kubeconfig holds a
// credential: errors never quote it.
func currentCluster(data []byte) (string, *clientcmdapi.Cluster, error) {
	cfg, err := clientcmd.Load(data)
	if err != nil {
		return "", nil, errors.New("the broker's kubeconfig does not parse")
	}
	ctx, ok := cfg.Contexts[cfg.CurrentContext]
	if !ok {
		return "", nil, errors.New("the broker's kubeconfig has no current context")
	}
	cluster, ok := cfg.Clusters[ctx.Cluster]
	if !ok {
		return "", nil, errNoCluster
	}
	return ctx.Cluster, cluster, nil
}
