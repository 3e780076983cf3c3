package broker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

const testPolicy = `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
ttl: {default: 1h, max: 24h}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - namespaces: [argo]
        serviceAccounts: [admiralty-source]
        maxTTL: 12h
      - namespaces: [argo, flux]
        serviceAccounts: [reader]
  - name: north
    identity: spiffe://oc.example/cluster/north
    grants:
      - namespaces: [argo]
        serviceAccounts: [admiralty-source]
        maxTTL: 30m
        credential: clientCertificate
`

func mustPolicy(t *testing.T, doc string) *Policy {
	t.Helper()
	p, err := ParsePolicy([]byte(doc))
	require.NoError(t, err)
	return p
}

func TestDecide(t *testing.T) {
	t.Parallel()
	p := mustPolicy(t, testPolicy)
	const west, north = "spiffe://oc.example/cluster/west", "spiffe://oc.example/cluster/north"
	tests := []struct {
		name                   string
		identity, ns, sa, cred string
		ttl, minTTL            time.Duration
		wantTTL                time.Duration
		wantClamp              string
		wantKind               Kind // 0 means success
	}{
		{name: "a granted request within the grant's max keeps its TTL", identity: west, ns: "argo", sa: "admiralty-source", ttl: 2 * time.Hour, wantTTL: 2 * time.Hour},
		{name: "no TTL means the policy default", identity: west, ns: "argo", sa: "admiralty-source", wantTTL: time.Hour},
		{name: "a TTL over the grant's max is clamped to it", identity: west, ns: "argo", sa: "admiralty-source", ttl: 20 * time.Hour, wantTTL: 12 * time.Hour, wantClamp: ClampedByGrant},
		{name: "a TTL over the policy max is clamped when the grant has no max", identity: west, ns: "flux", sa: "reader", ttl: 48 * time.Hour, wantTTL: 24 * time.Hour, wantClamp: ClampedByPolicy},
		{name: "a TTL under the TokenRequest minimum is raised to it", identity: west, ns: "argo", sa: "admiralty-source", ttl: time.Minute, wantTTL: 10 * time.Minute, wantClamp: ClampedByTokenMinimum},
		{name: "a minTTL the grant can give is accepted", identity: west, ns: "argo", sa: "admiralty-source", ttl: 20 * time.Hour, minTTL: 12 * time.Hour, wantTTL: 12 * time.Hour, wantClamp: ClampedByGrant},
		{name: "a minTTL above the grant's max is unprocessable", identity: west, ns: "argo", sa: "admiralty-source", ttl: 20 * time.Hour, minTTL: 13 * time.Hour, wantKind: KindUnprocessable},
		{name: "a minTTL above the requested TTL is unprocessable", identity: west, ns: "argo", sa: "admiralty-source", ttl: time.Hour, minTTL: 2 * time.Hour, wantKind: KindUnprocessable},
		{name: "an unknown identity is forbidden", identity: "spiffe://oc.example/cluster/south", ns: "argo", sa: "admiralty-source", wantKind: KindForbidden},
		{name: "a namespace outside the grant is forbidden", identity: west, ns: "kube-system", sa: "admiralty-source", wantKind: KindForbidden},
		{name: "a ServiceAccount outside the grant is forbidden", identity: west, ns: "argo", sa: "default", wantKind: KindForbidden},
		{name: "namespaces and ServiceAccounts of different grants do not combine", identity: west, ns: "flux", sa: "admiralty-source", wantKind: KindForbidden},
		{name: "a credential kind the grant does not give is forbidden", identity: west, ns: "argo", sa: "admiralty-source", cred: apiv1.CredentialClientCertificate, wantKind: KindForbidden},
		{name: "a grant for client certificates does not give tokens", identity: north, ns: "argo", sa: "admiralty-source", cred: apiv1.CredentialToken, wantKind: KindForbidden},
		{name: "a client certificate grant clamps to its own max", identity: north, ns: "argo", sa: "admiralty-source", cred: apiv1.CredentialClientCertificate, ttl: time.Hour, wantTTL: 30 * time.Minute, wantClamp: ClampedByGrant},
		{name: "an empty identity is forbidden", identity: "", ns: "argo", sa: "admiralty-source", wantKind: KindForbidden},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d, err := p.Decide(tc.identity, tc.ns, tc.sa, tc.cred, tc.ttl, tc.minTTL)
			if tc.wantKind != 0 {
				require.Error(t, err)
				require.Equal(t, tc.wantKind, KindOf(err))
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.wantTTL, d.TTL)
			require.Equal(t, tc.wantClamp, d.ClampedBy)
		})
	}
}

func TestForbiddenErrorsDoNotTellWhy(t *testing.T) {
	t.Parallel()
	p := mustPolicy(t, testPolicy)
	_, e1 := p.Decide("spiffe://oc.example/cluster/south", "argo", "admiralty-source", "", 0, 0)
	_, e2 := p.Decide("spiffe://oc.example/cluster/west", "kube-system", "admiralty-source", "", 0, 0)
	require.Equal(t, e1.Error(), e2.Error())
}

func TestParsePolicyReportsEveryProblemWithItsPath(t *testing.T) {
	t.Parallel()
	doc := `
cluster: {name: East, server: "http://x"}
ttl: {default: 1m, max: 5m}
peers:
  - name: west
    identity: https://oc.example/cluster/west
    grants:
      - namespaces: []
        serviceAccounts: [Bad_Name]
        maxTTL: 48h
        credential: password
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants: []
`
	_, err := ParsePolicy([]byte(doc))
	var ve *apiv1.ValidationError
	require.ErrorAs(t, err, &ve)
	fields := map[string]bool{}
	for _, p := range ve.Problems {
		fields[p.Field] = true
	}
	for _, want := range []string{
		"cluster.name", "cluster.server", "cluster.caFile", "ttl.max", "ttl.default",
		"peers[0].identity", "peers[0].grants[0].namespaces", "peers[0].grants[0].serviceAccounts[0]",
		"peers[0].grants[0].maxTTL", "peers[0].grants[0].credential", "peers[1].name",
	} {
		require.True(t, fields[want], "missing problem for %s in %v", want, ve.Problems)
	}
}

func TestParsePolicyRejects(t *testing.T) {
	t.Parallel()
	tests := []struct{ name, doc string }{
		{"an unknown field is rejected so a typo never changes a grant", "cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grant: []\n"},
		{"a TTL that is not a duration is rejected", "cluster: {name: a, server: 'https://a', caData: x}\nttl: {default: 1d}\n"},
		{"a document that is not YAML is rejected", "cluster: [\n"},
		{"two identities for one peer entry are rejected", "cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- {name: w, identity: spiffe://a/cluster/w, grants: []}\n- {name: v, identity: spiffe://a/cluster/w, grants: []}\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := ParsePolicy([]byte(tc.doc))
			require.Error(t, err)
		})
	}
}

func TestEmptyPolicyDeniesEverything(t *testing.T) {
	t.Parallel()
	p := mustPolicy(t, "cluster: {name: a, server: 'https://a', caData: x}\n")
	_, err := p.Decide("spiffe://a/cluster/w", "default", "default", "", 0, 0)
	require.Equal(t, KindForbidden, KindOf(err))
	peer, grants := p.Grants("spiffe://a/cluster/w")
	require.Empty(t, peer)
	require.NotNil(t, grants)
	require.Empty(t, grants)
}

func TestGrantsListsEffectiveMaxTTL(t *testing.T) {
	t.Parallel()
	p := mustPolicy(t, testPolicy)
	peer, grants := p.Grants("spiffe://oc.example/cluster/west")
	require.Equal(t, "west", peer)
	require.Len(t, grants, 2)
	require.Equal(t, "12h0m0s", grants[0].MaxTTL)
	require.Equal(t, "24h0m0s", grants[1].MaxTTL)
	require.Equal(t, apiv1.CredentialToken, grants[1].Credential)
}

func FuzzParsePolicy(f *testing.F) {
	f.Add([]byte(testPolicy))
	f.Add([]byte("cluster: {name: a}\n"))
	f.Add([]byte("{}"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := ParsePolicy(data)
		if err == nil {
			require.NoError(t, p.Validate())
		}
	})
}
