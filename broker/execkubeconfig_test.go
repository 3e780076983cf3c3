package broker

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

// An exec kubeconfig is decided like an issuance and creates nothing: its
// user runs the plugin with the request against the broker's URL, and
// client-go's own loader accepts it.
func TestAnExecKubeconfigIsDecidedButIssuesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec
	req := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "2h"}
	kc, err := e.b.ExecKubeconfig(context.Background(), west, req, "https://broker.example:8443")
	require.NoError(t, err)
	require.Zero(t, e.leaseCount(t))
	require.Empty(t, e.iss.got)

	cfg, err := clientcmd.Load(kc)
	require.NoError(t, err)
	require.NoError(t, clientcmd.Validate(*cfg))
	rc, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err)
	require.Equal(t, "https://east.example.com:6443", rc.Host)
	require.Empty(t, rc.BearerToken)
	require.Equal(t, "tokenbroker", rc.ExecProvider.Command)
	require.Equal(t, []string{"credential", "--broker", "https://broker.example:8443", "--namespace", "argo",
		"--service-account", "admiralty-source", "--ttl", "2h"}, rc.ExecProvider.Args)
	require.Equal(t, "Never", string(rc.ExecProvider.InteractiveMode))
	require.Equal(t, "argo/admiralty-source@east", cfg.CurrentContext)
	evs := rec.all()
	require.Len(t, evs, 1)
	require.Equal(t, audit.ActionExecKubeconfig, evs[0].Action)
	require.Equal(t, audit.DecisionAllow, evs[0].Decision)
	require.Equal(t, "west", evs[0].Peer)
	require.Empty(t, evs[0].LeaseID)
}

func TestAnExecKubeconfigTheGrantsDoNotAllowIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, err := e.b.ExecKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "kube-system", ServiceAccount: "admin"}, "https://b.example")
	require.Equal(t, problem.KindForbidden, problem.KindOf(err))
	_, err = e.b.ExecKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "admiralty-source", TTL: "24h", MinTTL: "13h"}, "https://b.example")
	require.Equal(t, problem.KindUnprocessable, problem.KindOf(err), "the grant's maxTTL 12h cannot reach minTTL 13h")
}

// gatewayPolicy grants south runner in argo through the lease gateway,
// and directly with a longer maxTTL (the more generous grant).
const gatewayPolicy = testPolicy + `
  - name: south
    identity: spiffe://oc.example/cluster/south
    grants:
      - {namespaces: [argo], serviceAccounts: [runner], access: gateway, maxTTL: 2h}
      - {namespaces: [argo], serviceAccounts: [runner], maxTTL: 12h}
`

var south = Caller{Identity: "spiffe://oc.example/cluster/south"}

// An exec kubeconfig of a gateway decision names the gateway (its URL and
// the CAs of its serving certificate), where the plugin's lease
// certificate is good, and runs the plugin for a gateway credential.
func TestAnExecKubeconfigForTheGatewayPointsAtTheGateway(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.b.cfg.Policy.Store(mustPolicy(t, gatewayPolicy))
	e.b.cfg.Gateway = &Gateway{Issuer: &fakeIssuer{}, Server: "https://gateway.east.example.com:8445",
		CAData: func() []byte { return []byte("gateway CA") }}
	rec := newAuditRecorder()
	e.b.cfg.Auditor = rec

	req := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", TTL: "1h", Access: apiv1.AccessGateway}
	kc, err := e.b.ExecKubeconfig(context.Background(), south, req, "https://broker.example:8443")
	require.NoError(t, err)
	require.Zero(t, e.leaseCount(t))
	cfg, err := clientcmd.Load(kc)
	require.NoError(t, err)
	require.NoError(t, clientcmd.Validate(*cfg))
	rc, err := clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err)
	require.Equal(t, "https://gateway.east.example.com:8445", rc.Host)
	require.Equal(t, []byte("gateway CA"), rc.CAData)
	require.Equal(t, []string{"credential", "--broker", "https://broker.example:8443", "--namespace", "argo",
		"--service-account", "runner", "--ttl", "1h", "--access", "gateway"}, rc.ExecProvider.Args)
	require.Equal(t, "argo/runner@east", cfg.CurrentContext, "named after the policy's cluster, as an issued gateway kubeconfig is")
	evs := rec.all()
	require.Len(t, evs, 1)
	require.Equal(t, apiv1.AccessGateway, evs[0].Access)

	// Asking for direct access names the API server, and the plugin asks
	// for direct access too.
	req.Access = apiv1.AccessDirect
	kc, err = e.b.ExecKubeconfig(context.Background(), south, req, "https://broker.example:8443")
	require.NoError(t, err)
	cfg, err = clientcmd.Load(kc)
	require.NoError(t, err)
	rc, err = clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err)
	require.Equal(t, "https://east.example.com:6443", rc.Host)
	require.Equal(t, []string{"--access", "direct"}, rc.ExecProvider.Args[len(rc.ExecProvider.Args)-2:])

	// Without access the grant's mode decides (the most generous grant,
	// here the direct one) and the plugin is left to ask the same way.
	req.Access = ""
	kc, err = e.b.ExecKubeconfig(context.Background(), south, req, "https://broker.example:8443")
	require.NoError(t, err)
	cfg, err = clientcmd.Load(kc)
	require.NoError(t, err)
	rc, err = clientcmd.NewDefaultClientConfig(*cfg, nil).ClientConfig()
	require.NoError(t, err)
	require.Equal(t, "https://east.example.com:6443", rc.Host)
	require.NotContains(t, rc.ExecProvider.Args, "--access")
}

func TestAnExecKubeconfigForTheGatewayOfABrokerWithoutOneIsUnprocessable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.b.cfg.Policy.Store(mustPolicy(t, gatewayPolicy))
	_, err := e.b.ExecKubeconfig(context.Background(), south,
		apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessGateway}, "https://b.example")
	require.Equal(t, problem.KindUnprocessable, problem.KindOf(err))
	require.ErrorContains(t, err, "runs no lease gateway")
}

// A gateway whose serving certificate verifies to no CA now has no cluster
// entry to give: the exec kubeconfig is refused as the issuance is, rather
// than written with a CA that would make the plugin's guard refuse later.
func TestAnExecKubeconfigForAGatewayWithoutCAsIsUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.b.cfg.Policy.Store(mustPolicy(t, gatewayPolicy))
	e.b.cfg.Gateway = &Gateway{Issuer: &fakeIssuer{}, Server: "https://gateway.east.example.com:8445", CAData: func() []byte { return nil }}
	_, err := e.b.ExecKubeconfig(context.Background(), south,
		apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessGateway}, "https://b.example")
	require.Equal(t, problem.KindUnavailable, problem.KindOf(err))
}
