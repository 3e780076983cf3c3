package policy

import (
	"testing"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

const accessPolicy = `
cluster: {name: east, server: "https://east.example:6443", caData: x}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
        access: gateway
      - namespaces: [flux]
        serviceAccounts: [reconciler]
`

func TestAGrantsAccessModeDecidesAndARequestMayNameIt(t *testing.T) {
	t.Parallel()
	p := parsed(t, accessPolicy)
	const west = "spiffe://oc.example/cluster/west"
	for _, tc := range []struct {
		name, ns, sa, access string
		want                 string // the decided mode; "" for forbidden
	}{
		{name: "a request that names no mode gets the gateway grant's", ns: "argo", sa: "runner", want: apiv1.AccessGateway},
		{name: "a request for the gateway gets it", ns: "argo", sa: "runner", access: apiv1.AccessGateway, want: apiv1.AccessGateway},
		{name: "a direct request is refused by a gateway grant: its holder gets no bearer token", ns: "argo", sa: "runner", access: apiv1.AccessDirect},
		{name: "a grant without access is direct", ns: "flux", sa: "reconciler", want: apiv1.AccessDirect},
		{name: "a gateway request is refused by a direct grant", ns: "flux", sa: "reconciler", access: apiv1.AccessGateway},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := p.DecideAccess(nil, west, nil, tc.ns, tc.sa, "", tc.access, nil, 0, 0)
			if tc.want == "" {
				require.Equal(t, problem.KindForbidden, problem.KindOf(err), "%v", err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, d.Access)
		})
	}
	_, grants := p.Grants(west)
	require.Equal(t, apiv1.AccessGateway, grants[0].Access, "whoami tells the peer each grant's mode")
	require.Empty(t, grants[1].Access, "a direct grant says nothing, as before access existed")
}

func TestAGatewayGrantIsForTokensWithoutAudiences(t *testing.T) {
	t.Parallel()
	for name, grant := range map[string]string{
		"an unknown mode":                "{namespaces: [argo], serviceAccounts: [runner], access: proxy}",
		"a client certificate's gateway": "{namespaces: [argo], credential: clientCertificate, role: view, access: gateway}",
		"audiences through the gateway":  "{namespaces: [argo], serviceAccounts: [runner], audiences: [vault], access: gateway}",
	} {
		t.Run(name, func(t *testing.T) {
			_, err := Parse([]byte(`
cluster: {name: east, server: "https://east.example:6443", caData: x}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants: [` + grant + `]`))
			require.Error(t, err)
			require.Contains(t, err.Error(), "grants[0]")
		})
	}
}

func TestGatewayGrantsAreCounted(t *testing.T) {
	p, err := Parse([]byte(`
cluster: {name: east, server: "https://east.example:6443", caData: x}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - {namespaces: [a], serviceAccounts: [sa-x], access: gateway}
      - {namespaces: [a], serviceAccounts: [sa-y]}
  - name: north
    identity: spiffe://oc.example/cluster/north
    grants:
      - {namespaces: [b], serviceAccounts: [sa-z], access: gateway}
`))
	require.NoError(t, err)
	require.Equal(t, 2, p.GatewayGrants())
}
