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
