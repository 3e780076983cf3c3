package execcred

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

func TestTargetArgs(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		target Target
		want   []string
	}{
		{name: "a token at the broker's default lifetime needs only the required flags",
			target: Target{Broker: "https://b:8443", IdentityDir: "/id", RequestSpec: apiv1.RequestSpec{Namespace: "argo", ServiceAccount: "runner"}},
			want:   []string{"credential", "--broker", "https://b:8443", "--identity-dir", "/id", "--namespace", "argo", "--service-account", "runner"}},
		{name: "lifetimes and audiences follow in a fixed order",
			target: Target{Broker: "https://b", IdentityDir: "/id", RequestSpec: apiv1.RequestSpec{Namespace: "argo", ServiceAccount: "runner", TTL: "8h", MinTTL: "1h", Audiences: []string{"a", "b"}}},
			want: []string{"credential", "--broker", "https://b", "--identity-dir", "/id", "--namespace", "argo", "--service-account", "runner",
				"--ttl", "8h", "--min-ttl", "1h", "--audience", "a", "--audience", "b"}},
		{name: "a client certificate says so and names no ServiceAccount",
			target: Target{Broker: "https://b", IdentityDir: "/id", RequestSpec: apiv1.RequestSpec{Namespace: "argo", Credential: apiv1.CredentialClientCertificate}},
			want:   []string{"credential", "--broker", "https://b", "--identity-dir", "/id", "--namespace", "argo", "--credential", "client-certificate"}},
		{name: "a gateway target asks for access gateway, after the request's other flags",
			target: Target{Broker: "https://b", IdentityDir: "/id", RequestSpec: apiv1.RequestSpec{Namespace: "argo", ServiceAccount: "runner", TTL: "1h", Access: apiv1.AccessGateway}, WorkloadTokenFile: "/t"},
			want: []string{"credential", "--broker", "https://b", "--identity-dir", "/id", "--namespace", "argo", "--service-account", "runner",
				"--ttl", "1h", "--access", "gateway", "--workload-token-file", "/t"}},
		{name: "an explicit direct target says so: without it the grant's mode is used",
			target: Target{Broker: "https://b", IdentityDir: "/id", RequestSpec: apiv1.RequestSpec{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessDirect}},
			want:   []string{"credential", "--broker", "https://b", "--identity-dir", "/id", "--namespace", "argo", "--service-account", "runner", "--access", "direct"}},
		{name: "an explicit token credential is the default and is left out",
			target: Target{Broker: "https://b", IdentityDir: "/id", RequestSpec: apiv1.RequestSpec{Namespace: "argo", ServiceAccount: "runner", Credential: apiv1.CredentialToken}},
			want:   []string{"credential", "--broker", "https://b", "--identity-dir", "/id", "--namespace", "argo", "--service-account", "runner"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.want, tc.target.Args())
		})
	}
}

// brokerKubeconfig is a kubeconfig as the broker writes it, with a
// tls-server-name and a proxy-url.
const brokerKubeconfig = `apiVersion: v1
kind: Config
clusters:
- name: "east"
  cluster:
    server: "https://east.example.com:6443"
    certificate-authority-data: Zm9v
    tls-server-name: "api.east"
    proxy-url: "socks5://proxy:1080"
users:
- name: "runner@east"
  user:
    token: "tok-SECRET"
contexts:
- name: "argo/runner@east"
  context:
    cluster: "east"
    user: "runner@east"
    namespace: "argo"
current-context: "argo/runner@east"
`

func TestKubeconfigFromBrokerRunsThePluginAgainstTheBrokersCluster(t *testing.T) {
	t.Parallel()
	target := Target{Broker: "https://b:8443", IdentityDir: "/home/me/west", RequestSpec: apiv1.RequestSpec{Namespace: "argo", ServiceAccount: "runner", TTL: "8h"}}
	data, err := KubeconfigFromBroker([]byte(brokerKubeconfig), "/usr/local/bin/tokenbroker", target)
	require.NoError(t, err)
	require.NotContains(t, string(data), "SECRET", "nothing of the broker's user is kept")
	require.NotContains(t, string(data), "LocationOfOrigin")

	cfg, err := clientcmd.Load(data)
	require.NoError(t, err)
	require.NoError(t, clientcmd.Validate(*cfg), "kubectl accepts it")
	require.Equal(t, "argo/runner@east", cfg.CurrentContext)
	ctx := cfg.Contexts[cfg.CurrentContext]
	require.Equal(t, "argo", ctx.Namespace)
	cluster := cfg.Clusters[ctx.Cluster]
	require.Equal(t, "https://east.example.com:6443", cluster.Server)
	require.Equal(t, []byte("foo"), cluster.CertificateAuthorityData)
	require.Equal(t, "api.east", cluster.TLSServerName)
	require.Equal(t, "socks5://proxy:1080", cluster.ProxyURL)
	user := cfg.AuthInfos[ctx.AuthInfo]
	require.Empty(t, user.Token)
	require.Equal(t, &clientcmdapi.ExecConfig{
		APIVersion:      APIVersionV1,
		Command:         "/usr/local/bin/tokenbroker",
		Args:            target.Args(),
		InstallHint:     installHint,
		InteractiveMode: clientcmdapi.NeverExecInteractiveMode,
		// clientcmd fills these when it loads a kubeconfig.
		Env:                []clientcmdapi.ExecEnvVar(nil),
		ProvideClusterInfo: false,
	}, withoutLoadDefaults(user.Exec))
}

// withoutLoadDefaults drops what clientcmd.Load sets on an exec config
// that is not in the file.
func withoutLoadDefaults(e *clientcmdapi.ExecConfig) *clientcmdapi.ExecConfig {
	c := *e
	c.Config = nil
	c.StdinUnavailable, c.StdinUnavailableMessage = false, ""
	return &c
}

func TestKubeconfigRefusals(t *testing.T) {
	t.Parallel()
	good := Target{Broker: "https://b", IdentityDir: "/id", RequestSpec: apiv1.RequestSpec{Namespace: "argo", ServiceAccount: "runner"}}
	for _, tc := range []struct {
		name, kubeconfig, command string
		target                    Target
		err                       string
	}{
		{name: "a relative identity directory would be looked up in kubectl's working directory",
			kubeconfig: brokerKubeconfig, command: "tokenbroker", target: Target{Broker: "https://b", IdentityDir: "west", RequestSpec: apiv1.RequestSpec{Namespace: "argo", ServiceAccount: "r"}},
			err: "must be an absolute path"},
		{name: "an empty command is refused", kubeconfig: brokerKubeconfig, target: good, err: "command is empty"},
		{name: "a broker kubeconfig that does not parse is refused without quoting it",
			kubeconfig: "token: tok-SECRET\n\t:", command: "tokenbroker", target: good, err: "does not parse"},
		{name: "a broker kubeconfig without a current context is refused",
			kubeconfig: strings.Replace(brokerKubeconfig, `current-context: "argo/runner@east"`, "", 1), command: "tokenbroker", target: good, err: "no current context"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := KubeconfigFromBroker([]byte(tc.kubeconfig), tc.command, tc.target)
			require.ErrorContains(t, err, tc.err)
			require.NotContains(t, err.Error(), "SECRET")
		})
	}
}

func TestClusterOfKubeconfigIsTheCurrentContextsClusterAndNeverQuotesTheKubeconfig(t *testing.T) {
	t.Parallel()
	got, err := ClusterOfKubeconfig([]byte(brokerKubeconfig))
	require.NoError(t, err)
	require.Equal(t, ClusterRef{Server: "https://east.example.com:6443", CAData: []byte("foo")}, got)
	for _, tc := range []struct{ name, kubeconfig, err string }{
		{name: "a kubeconfig that does not parse", kubeconfig: "token: tok-SECRET\n\t:", err: "the broker's kubeconfig does not parse"},
		{name: "a kubeconfig without a current context",
			kubeconfig: strings.Replace(brokerKubeconfig, `current-context: "argo/runner@east"`, "", 1), err: "the broker's kubeconfig has no current context"},
		{name: "a current context whose cluster is missing",
			kubeconfig: strings.Replace(brokerKubeconfig, `cluster: "east"`, `cluster: "west"`, 1), err: "the broker's kubeconfig names no cluster"},
		{name: "a cluster without a server",
			kubeconfig: strings.Replace(brokerKubeconfig, `server: "https://east.example.com:6443"`, `server: ""`, 1), err: "the broker's kubeconfig names no cluster"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := ClusterOfKubeconfig([]byte(tc.kubeconfig))
			require.EqualError(t, err, tc.err)
		})
	}
}

func TestAClientCertificateKubeconfigNamesItsUserAfterTheCertificate(t *testing.T) {
	t.Parallel()
	data, err := Kubeconfig("east", &clientcmdapi.Cluster{Server: "https://east:6443"}, "/bin/tokenbroker",
		Target{Broker: "https://b", IdentityDir: "/id", RequestSpec: apiv1.RequestSpec{Namespace: "argo", Credential: apiv1.CredentialClientCertificate}})
	require.NoError(t, err)
	cfg, err := clientcmd.Load(data)
	require.NoError(t, err)
	require.Equal(t, "argo/client-certificate@east", cfg.CurrentContext)
	require.Contains(t, cfg.AuthInfos["client-certificate@east"].Exec.Args, "client-certificate")
}

// gatewayKubeconfig is a kubeconfig of a gateway lease as the broker
// writes it for a caller that sent its CSR: the gateway's URL and CA, and
// the lease certificate without a key.
const gatewayKubeconfig = `apiVersion: v1
kind: Config
clusters:
- name: "east"
  cluster:
    server: "https://gateway.east.example.com:8445"
    certificate-authority-data: Z3c=
users:
- name: "runner@east"
  user:
    client-certificate-data: Y2VydC1TRUNSRVQ=
contexts:
- name: "argo/runner@east"
  context:
    cluster: "east"
    user: "runner@east"
    namespace: "argo"
current-context: "argo/runner@east"
`

// An exec kubeconfig for a gateway target points at the gateway and runs
// the plugin for a gateway credential, so that the certificate the plugin
// hands out goes where it is good.
func TestAGatewayExecKubeconfigPointsAtTheGatewayAndAsksForIt(t *testing.T) {
	t.Parallel()
	target := Target{Broker: "https://b:8443", IdentityDir: "/home/me/west", RequestSpec: apiv1.RequestSpec{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessGateway}}
	data, err := KubeconfigFromBroker([]byte(gatewayKubeconfig), "/usr/local/bin/tokenbroker", target)
	require.NoError(t, err)
	require.NotContains(t, string(data), "Y2VydC1TRUNSRVQ=", "nothing of the broker's user is kept")
	cfg, err := clientcmd.Load(data)
	require.NoError(t, err)
	require.NoError(t, clientcmd.Validate(*cfg))
	ctx := cfg.Contexts[cfg.CurrentContext]
	require.Equal(t, "https://gateway.east.example.com:8445", cfg.Clusters[ctx.Cluster].Server)
	require.Equal(t, []byte("gw"), cfg.Clusters[ctx.Cluster].CertificateAuthorityData)
	args := cfg.AuthInfos[ctx.AuthInfo].Exec.Args
	require.Equal(t, []string{"--access", "gateway"}, args[len(args)-2:])
}
