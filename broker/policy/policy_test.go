package policy

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/policy/policytest"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

func TestDecide(t *testing.T) {
	t.Parallel()
	p := parsed(t, policytest.Basic)
	const west, north = "spiffe://oc.example/cluster/west", "spiffe://oc.example/cluster/north"
	tests := []struct {
		name                   string
		identity, ns, sa, cred string
		ttl, minTTL            time.Duration
		wantTTL                time.Duration
		wantClamp              string
		wantKind               problem.Kind // 0 means success
	}{
		{name: "a granted request within the grant's max keeps its TTL", identity: west, ns: "argo", sa: "admiralty-source", ttl: 2 * time.Hour, wantTTL: 2 * time.Hour},
		{name: "no TTL means the policy default", identity: west, ns: "argo", sa: "admiralty-source", wantTTL: time.Hour},
		{name: "a TTL over the grant's max is clamped to it", identity: west, ns: "argo", sa: "admiralty-source", ttl: 20 * time.Hour, wantTTL: 12 * time.Hour, wantClamp: ClampedByGrant},
		{name: "a TTL over the policy max is clamped when the grant has no max", identity: west, ns: "flux", sa: "reader", ttl: 48 * time.Hour, wantTTL: 24 * time.Hour, wantClamp: ClampedByPolicy},
		{name: "a TTL under the issuer's minimum is the issuer's to raise, not the policy's", identity: west, ns: "argo", sa: "admiralty-source", ttl: time.Minute, wantTTL: time.Minute},
		{name: "a minTTL the grant can give is accepted", identity: west, ns: "argo", sa: "admiralty-source", ttl: 20 * time.Hour, minTTL: 12 * time.Hour, wantTTL: 12 * time.Hour, wantClamp: ClampedByGrant},
		{name: "a minTTL above the grant's max is unprocessable", identity: west, ns: "argo", sa: "admiralty-source", ttl: 20 * time.Hour, minTTL: 13 * time.Hour, wantKind: problem.KindUnprocessable},
		{name: "a minTTL above the requested TTL is unprocessable", identity: west, ns: "argo", sa: "admiralty-source", ttl: time.Hour, minTTL: 2 * time.Hour, wantKind: problem.KindUnprocessable},
		{name: "an unknown identity is forbidden", identity: "spiffe://oc.example/cluster/south", ns: "argo", sa: "admiralty-source", wantKind: problem.KindForbidden},
		{name: "a namespace outside the grant is forbidden", identity: west, ns: "kube-system", sa: "admiralty-source", wantKind: problem.KindForbidden},
		{name: "a ServiceAccount outside the grant is forbidden", identity: west, ns: "argo", sa: "default", wantKind: problem.KindForbidden},
		{name: "namespaces and ServiceAccounts of different grants do not combine", identity: west, ns: "flux", sa: "admiralty-source", wantKind: problem.KindForbidden},
		{name: "a credential kind the grant does not give is forbidden", identity: west, ns: "argo", cred: apiv1.CredentialClientCertificate, wantKind: problem.KindForbidden},
		{name: "a client certificate grant does not give the token of a ServiceAccount", identity: north, ns: "argo", sa: "admiralty-source", wantKind: problem.KindForbidden},
		{name: "a grant for client certificates does not give tokens", identity: north, ns: "argo", sa: "admiralty-source", cred: apiv1.CredentialToken, wantKind: problem.KindForbidden},
		{name: "a client certificate grant clamps to its own max", identity: north, ns: "argo", cred: apiv1.CredentialClientCertificate, ttl: time.Hour, wantTTL: 30 * time.Minute, wantClamp: ClampedByGrant},
		{name: "a client certificate grant names no ServiceAccount", identity: north, ns: "argo", sa: "admiralty-source", cred: apiv1.CredentialClientCertificate, wantKind: problem.KindForbidden},
		{name: "an empty identity is forbidden", identity: "", ns: "argo", sa: "admiralty-source", wantKind: problem.KindForbidden},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d, err := p.Decide(tc.identity, tc.ns, tc.sa, tc.cred, tc.ttl, tc.minTTL)
			if tc.wantKind != 0 {
				require.Error(t, err)
				require.Equal(t, tc.wantKind, problem.KindOf(err))
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
	p := parsed(t, policytest.Basic)
	_, e1 := p.Decide("spiffe://oc.example/cluster/south", "argo", "admiralty-source", "", 0, 0)
	_, e2 := p.Decide("spiffe://oc.example/cluster/west", "kube-system", "admiralty-source", "", 0, 0)
	require.Equal(t, e1.Error(), e2.Error())
}

func TestParsePolicyReportsEveryProblemWithItsPath(t *testing.T) {
	t.Parallel()
	doc := `
cluster: {name: East, server: "http://x", tlsServerName: "east:6443", proxyURL: "ftp://proxy"}
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
	_, err := Parse([]byte(doc))
	var ve *apiv1.ValidationError
	require.ErrorAs(t, err, &ve)
	fields := map[string]bool{}
	for _, p := range ve.Problems {
		fields[p.Field] = true
	}
	for _, want := range []string{
		"cluster.name", "cluster.server", "cluster.tlsServerName", "cluster.proxyURL", "cluster.caFile", "ttl.max", "ttl.default",
		"peers[0].identity", "peers[0].grants[0].namespaces", "peers[0].grants[0].serviceAccounts[0]",
		"peers[0].grants[0].maxTTL", "peers[0].grants[0].credential", "peers[1].name",
	} {
		require.True(t, fields[want], "missing problem for %s in %v", want, ve.Problems)
	}
}

func TestTheClusterIsReachedOnlyByURLsAndNamesEveryClientReadsAlike(t *testing.T) {
	t.Parallel()
	const server = "https://east.example.com:6443"
	tests := []struct {
		name       string
		cluster    ClusterSpec // Name and CAData are filled in
		wantField  string      // "" when the policy is valid
		wantDetail string
	}{
		{name: "an https URL with a host and port is valid", cluster: ClusterSpec{Server: server}},
		{name: "an https URL with a path, as capsule-proxy and Rancher serve, is valid", cluster: ClusterSpec{Server: "https://rancher.example.com/k8s/clusters/c-m-abc123"}},
		{name: "an https URL with an IPv4 address is valid", cluster: ClusterSpec{Server: "https://10.0.0.1:6443"}},
		{name: "an https URL with an IPv6 address is valid", cluster: ClusterSpec{Server: "https://[2001:db8::1]:6443"}},
		{name: "an upper-case scheme and host are valid", cluster: ClusterSpec{Server: "HTTPS://East.Example.com"}},
		{name: "a C1 control character in the path is refused", cluster: ClusterSpec{Server: server + "/a\u0085b"}, wantField: "cluster.server", wantDetail: "byte 0xc2 at offset 31"},
		{name: "a space is refused", cluster: ClusterSpec{Server: server + "/a b"}, wantField: "cluster.server", wantDetail: "printable ASCII"},
		{name: "a trailing newline is refused", cluster: ClusterSpec{Server: server + "\n"}, wantField: "cluster.server", wantDetail: "printable ASCII"},
		{name: "a DEL is refused", cluster: ClusterSpec{Server: server + "/\x7f"}, wantField: "cluster.server", wantDetail: "byte 0x7f"},
		{name: "a non-ASCII host is refused", cluster: ClusterSpec{Server: "https://ex\u0430mple.com"}, wantField: "cluster.server", wantDetail: "printable ASCII"},
		{name: "a percent-encoded non-ASCII host is refused", cluster: ClusterSpec{Server: "https://ex%D0%B0mple.com"}, wantField: "cluster.server", wantDetail: "host must be a DNS name or an IP address"},
		{name: "a host with an IPv6 zone is refused", cluster: ClusterSpec{Server: "https://[fe80::1%25eth0]:6443"}, wantField: "cluster.server", wantDetail: "host must be a DNS name or an IP address"},
		{name: "user info is refused and not repeated", cluster: ClusterSpec{Server: "https://admin:hunter2@east.example.com"}, wantField: "cluster.server", wantDetail: "must not have user info"},
		{name: "a URL that does not parse is refused without repeating its password", cluster: ClusterSpec{Server: "https://admin:hunter2@east.example.com:x"}, wantField: "cluster.server", wantDetail: "is not a URL"},
		{name: "a query is refused", cluster: ClusterSpec{Server: server + "/?timeout=5s"}, wantField: "cluster.server", wantDetail: "must not have a query"},
		{name: "an empty query is refused", cluster: ClusterSpec{Server: server + "?"}, wantField: "cluster.server", wantDetail: "must not have a query"},
		{name: "a fragment is refused", cluster: ClusterSpec{Server: server + "#top"}, wantField: "cluster.server", wantDetail: "must not have a fragment"},
		{name: "an empty fragment is refused", cluster: ClusterSpec{Server: server + "#"}, wantField: "cluster.server", wantDetail: "must not have a fragment"},
		{name: "the http scheme is refused", cluster: ClusterSpec{Server: "http://east.example.com:6443"}, wantField: "cluster.server", wantDetail: "must be an https:// URL"},
		{name: "a host without a scheme is refused", cluster: ClusterSpec{Server: "east.example.com:6443"}, wantField: "cluster.server", wantDetail: "must be an https:// URL"},
		{name: "a URL without a host is refused", cluster: ClusterSpec{Server: "https:///api"}, wantField: "cluster.server", wantDetail: "must have a host"},
		{name: "a port without a host is refused", cluster: ClusterSpec{Server: "https://:6443"}, wantField: "cluster.server", wantDetail: "host must be"},
		{name: "a port out of range is refused", cluster: ClusterSpec{Server: "https://east.example.com:65536"}, wantField: "cluster.server", wantDetail: "port must be"},
		{name: "an empty port is refused", cluster: ClusterSpec{Server: "https://east.example.com:"}, wantField: "cluster.server", wantDetail: "port must be"},
		{name: "a port that is not a number is refused without repeating the URL", cluster: ClusterSpec{Server: "https://east.example.com:https"}, wantField: "cluster.server", wantDetail: "is not a URL: invalid port"},

		{name: "a DNS name as TLS server name is valid", cluster: ClusterSpec{Server: server, TLSServerName: "east.internal"}},
		{name: "an IP address as TLS server name is valid", cluster: ClusterSpec{Server: server, TLSServerName: "10.0.0.1"}},
		{name: "a TLS server name with a port is refused", cluster: ClusterSpec{Server: server, TLSServerName: "east.internal:6443"}, wantField: "cluster.tlsServerName", wantDetail: "must be a DNS name or an IP address"},
		{name: "a URL as TLS server name is refused", cluster: ClusterSpec{Server: server, TLSServerName: "https://east.internal"}, wantField: "cluster.tlsServerName", wantDetail: "must be a DNS name or an IP address"},
		{name: "a wildcard TLS server name is refused", cluster: ClusterSpec{Server: server, TLSServerName: "*.example.com"}, wantField: "cluster.tlsServerName", wantDetail: "must be a DNS name or an IP address"},
		{name: "a non-ASCII TLS server name is refused", cluster: ClusterSpec{Server: server, TLSServerName: "ex\u0430mple.com"}, wantField: "cluster.tlsServerName", wantDetail: "must be a DNS name or an IP address"},
		{name: "a TLS server name with a C1 control character is refused", cluster: ClusterSpec{Server: server, TLSServerName: "east\u0085"}, wantField: "cluster.tlsServerName", wantDetail: "must be a DNS name or an IP address"},

		{name: "an http proxy is valid", cluster: ClusterSpec{Server: server, ProxyURL: "http://proxy.example.com:3128"}},
		{name: "an https proxy is valid", cluster: ClusterSpec{Server: server, ProxyURL: "https://proxy.example.com"}},
		{name: "a socks5 proxy is valid", cluster: ClusterSpec{Server: server, ProxyURL: "socks5://127.0.0.1:1080"}},
		{name: "a proxy with a scheme client-go does not know is refused", cluster: ClusterSpec{Server: server, ProxyURL: "socks4://proxy.example.com:1080"}, wantField: "cluster.proxyURL", wantDetail: "must be an http://, https:// or socks5:// URL"},
		{name: "a proxy without a scheme is refused", cluster: ClusterSpec{Server: server, ProxyURL: "proxy.example.com:3128"}, wantField: "cluster.proxyURL", wantDetail: "must be an http://, https:// or socks5:// URL"},
		{name: "a proxy with a space is refused", cluster: ClusterSpec{Server: server, ProxyURL: "http://proxy.example.com :3128"}, wantField: "cluster.proxyURL", wantDetail: "printable ASCII"},
		{name: "a proxy with a password is refused and the password not repeated", cluster: ClusterSpec{Server: server, ProxyURL: "http://user:hunter2@proxy.example.com:3128"}, wantField: "cluster.proxyURL", wantDetail: "must not have user info"},
		{name: "a proxy with a query is refused", cluster: ClusterSpec{Server: server, ProxyURL: "http://proxy.example.com:3128?x=1"}, wantField: "cluster.proxyURL", wantDetail: "must not have a query"},
		{name: "a proxy with a fragment is refused", cluster: ClusterSpec{Server: server, ProxyURL: "http://proxy.example.com:3128#x"}, wantField: "cluster.proxyURL", wantDetail: "must not have a fragment"},
		{name: "a proxy without a host is refused", cluster: ClusterSpec{Server: server, ProxyURL: "http://"}, wantField: "cluster.proxyURL", wantDetail: "must have a host"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := &Policy{Cluster: tc.cluster}
			p.Cluster.Name, p.Cluster.CAData = "east", "x"
			p.defaults()
			err := p.Validate()
			if tc.wantField == "" {
				require.NoError(t, err)
				// And the same through the JSON names, as a policy file is read.
				js, err := json.Marshal(p)
				require.NoError(t, err)
				parsed, err := Parse(js)
				require.NoError(t, err)
				require.Equal(t, p.Cluster, parsed.Cluster)
				return
			}
			var ve *apiv1.ValidationError
			require.ErrorAs(t, err, &ve)
			require.Len(t, ve.Problems, 1, "%v", ve.Problems)
			require.Equal(t, tc.wantField, ve.Problems[0].Field)
			require.Contains(t, ve.Problems[0].Detail, tc.wantDetail)
			require.NotContains(t, err.Error(), "hunter2")
		})
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
			_, err := Parse([]byte(tc.doc))
			require.Error(t, err)
		})
	}
}

func TestAClusterNameThatIsTheUnboundJoinTokenAudienceIsRejected(t *testing.T) {
	t.Parallel()
	// Without --broker-name the broker answers to cluster.name in a join
	// token's aud: this name would let it take every unbound token.
	_, err := Parse([]byte("cluster: {name: " + pki.JoinTokenAudience + ", server: 'https://a', caData: x}\n"))
	require.ErrorContains(t, err, "cluster.name")
	require.ErrorContains(t, err, "is the audience of unbound join tokens")
}

func TestEmptyPolicyDeniesEverything(t *testing.T) {
	t.Parallel()
	p := parsed(t, "cluster: {name: a, server: 'https://a', caData: x}\n")
	_, err := p.Decide("spiffe://a/cluster/w", "default", "default", "", 0, 0)
	require.Equal(t, problem.KindForbidden, problem.KindOf(err))
	peer, grants := p.Grants("spiffe://a/cluster/w")
	require.Empty(t, peer)
	require.NotNil(t, grants)
	require.Empty(t, grants)
}

func TestGrantsListsEffectiveMaxTTL(t *testing.T) {
	t.Parallel()
	p := parsed(t, policytest.Basic)
	peer, grants := p.Grants("spiffe://oc.example/cluster/west")
	require.Equal(t, "west", peer)
	require.Len(t, grants, 2)
	require.Equal(t, "12h0m0s", grants[0].MaxTTL)
	require.Equal(t, "24h0m0s", grants[1].MaxTTL)
	require.Equal(t, apiv1.CredentialToken, grants[1].Credential)
}

func FuzzParsePolicy(f *testing.F) {
	f.Add([]byte(policytest.Basic))
	f.Add([]byte("cluster: {name: a}\n"))
	f.Add([]byte("{}"))
	// U+0085 (NEL) is a line break to YAML: escaped, raw and in JSON.
	f.Add([]byte(`cluster: {name: east, server: "https://east.example.com:6443/a\u0085b", caData: x}` + "\n"))
	f.Add([]byte("cluster: {name: east, server: \"https://east.example.com:6443/a\u0085b\", caData: x}\n"))
	f.Add([]byte(`{"cluster": {"name": "east", "server": "https://east.example.com:6443/a\u0085b", "caData": "x"}}`))
	f.Add([]byte(`cluster: {name: east, server: "https://10.0.0.1:6443/k8s", tlsServerName: east.internal, proxyURL: "socks5://proxy:1080", caData: x}` + "\n"))
	// The namespace selector section: every operator, an empty selector,
	// revocation settings.
	f.Add([]byte(policytest.Tenants))
	f.Add([]byte("cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n  - {name: t, namespaceSelector: {matchExpressions: [{key: tenant, operator: In, values: [oil]}, {key: x, operator: NotIn, values: [y]}, {key: e, operator: Exists}, {key: d, operator: DoesNotExist}]}, serviceAccounts: [sa], revokeDelay: 30s}\n"))
	f.Add([]byte("cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n  - {name: t, namespaceSelector: {}, serviceAccounts: [sa]}\n"))
	f.Add([]byte(`{"cluster":{"name":"a","server":"https://a","caData":"x"},"peers":[{"name":"w","identity":"spiffe://a/cluster/w","grants":[{"name":"t","namespaceSelector":{"matchLabels":{"a/b":"c"}},"serviceAccounts":["sa"],"revokeOnUnmatch":false}]}]}`))
	// A grant's namespaceOwner: valid, without a UID, hostile values.
	f.Add([]byte(policytest.Owned))
	f.Add([]byte("cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n  - {name: t, namespaceSelector: {matchLabels: {a: b}}, serviceAccounts: [sa], namespaceOwner: {apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: oil}}\n"))
	f.Add([]byte("cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n  - {name: t, namespaceSelector: {matchLabels: {a: b}}, serviceAccounts: [sa], namespaceOwner: {apiVersion: \"/\\u0085\", kind: \"T\\u0000\", name: \"..\", uid: \"6f1f3c1e-2f0e-4a57-9d43-0c6b1f1d2a1\\u00e9\"}}\n"))
	f.Add([]byte(`{"cluster":{"name":"a","server":"https://a","caData":"x"},"peers":[{"name":"w","identity":"spiffe://a/cluster/w","grants":[{"namespaces":["a"],"serviceAccounts":["sa"],"namespaceOwner":{"apiVersion":"v1","kind":"Namespace","name":"p","uid":"6f1f3c1e-2f0e-4a57-9d43-0c6b1f1d2a10"}}]}]}`))
	// The limits section: top level and per peer, in and out of range.
	f.Add([]byte(policytest.Limits))
	f.Add([]byte("cluster: {name: a, server: 'https://a', caData: x}\nlimits: {issuancesPerMinute: 0, burst: -1, maxLiveLeases: 1000001, enrollmentsPerMinute: 1}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  limits: {renewalsPerMinute: 1, enrollmentsPerMinute: 2}\n"))
	// Grant audiences: listed, empty, a wildcard, on a certificate grant.
	f.Add([]byte(policytest.Audiences))
	f.Add([]byte("cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n  - {namespaces: [a], serviceAccounts: [s], audiences: ['*', '', 'sts.amazonaws.com', \"a\\u0085b\"]}\n  - {namespaces: [b], credential: clientCertificate, role: r, audiences: [vault]}\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := Parse(data)
		if err != nil {
			return
		}
		require.NoError(t, p.Validate())
		// A valid grant's audiences are literals a peer must name
		// exactly; a grant that lists none allows no named audience; a
		// certificate grant has none.
		for _, peer := range p.Peers {
			for _, g := range peer.Grants {
				require.True(t, g.allowsAudiences(nil))
				require.False(t, g.allowsAudiences([]string{"sts.amazonaws.com\x00"}))
				if len(g.Audiences) == 0 {
					require.False(t, g.allowsAudiences([]string{"sts.amazonaws.com"}))
				}
				if g.Credential == apiv1.CredentialClientCertificate {
					require.Empty(t, g.Audiences)
				}
				require.LessOrEqual(t, len(g.Audiences), apiv1.MaxAudiences)
				for _, a := range g.Audiences {
					require.NotEqual(t, "*", a)
					require.True(t, printableASCII(a), "%q", a)
				}
			}
		}
		// Every limit in force is a positive, bounded figure: no policy
		// that validates can switch a limit off or overflow it.
		for i := range append(p.Peers, PeerSpec{}) {
			var peer *PeerSpec
			if i < len(p.Peers) {
				peer = &p.Peers[i]
			}
			l := p.LimitsFor(peer)
			for _, v := range []int{l.IssuancesPerMinute, l.Burst, l.RenewalsPerMinute, l.MaxLiveLeases, p.EnrollmentsPerMinute()} {
				require.True(t, v >= 1 && v <= maxLimit, "limit %d", v)
			}
		}
		// A valid selector grant is named, compiled and never empty: it
		// cannot grant every namespace.
		for _, peer := range p.Peers {
			for _, g := range peer.Grants {
				if g.NamespaceSelector == nil {
					require.Nil(t, g.Selector)
					continue
				}
				require.NotEmpty(t, g.Name)
				require.NotNil(t, g.Selector)
				require.False(t, g.Selector.Empty(), "%+v", g.NamespaceSelector)
			}
		}
		// A valid namespaceOwner belongs to a selector grant, names its
		// owner completely, and owns a namespace only through its UID.
		for _, peer := range p.Peers {
			for _, g := range peer.Grants {
				o := g.NamespaceOwner
				if o == nil {
					continue
				}
				require.NotNil(t, g.NamespaceSelector)
				require.True(t, pki.ValidUID(strings.ToLower(string(o.UID))), "%q", o.UID)
				require.True(t, kindName(o.Kind), "%q", o.Kind)
				require.NotEmpty(t, o.Name)
				ref := metav1.OwnerReference{APIVersion: o.APIVersion, Kind: o.Kind, Name: o.Name, UID: o.UID}
				require.True(t, o.owns([]metav1.OwnerReference{ref}))
				ref.UID = "00000000-0000-0000-0000-000000000000"
				require.Equal(t, o.UID == ref.UID, o.owns([]metav1.OwnerReference{ref}))
				require.False(t, o.owns(nil))
			}
		}
		// What a valid policy puts in a kubeconfig is printable ASCII, so
		// every client reads it alike, and reads back as it was.
		c := p.Cluster
		for field, v := range map[string]string{"server": c.Server, "tlsServerName": c.TLSServerName, "proxyURL": c.ProxyURL} {
			for i := 0; i < len(v); i++ {
				require.True(t, v[i] >= 0x21 && v[i] <= 0x7e, "cluster.%s %q has byte 0x%02x at offset %d", field, v, v[i], i)
			}
		}
	})
}

func TestAClientCertificateGrantBindsExactlyOneRoleAndNamesNoServiceAccount(t *testing.T) {
	t.Parallel()
	const head = "cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n"
	tests := []struct{ name, grants, want string }{
		{"a role is enough", "  - {namespaces: [argo], credential: clientCertificate, role: reader}\n", ""},
		{"a cluster role is enough", "  - {namespaces: [argo], credential: clientCertificate, clusterRole: view}\n", ""},
		{"no role says what is missing", "  - {namespaces: [argo], credential: clientCertificate}\n",
			"peers[0].grants[0].role: a clientCertificate grant names exactly one of role and clusterRole"},
		{"both roles are one too many", "  - {namespaces: [argo], credential: clientCertificate, role: a, clusterRole: b}\n",
			"peers[0].grants[0].role: a clientCertificate grant names exactly one"},
		{"a ServiceAccount has no place in it", "  - {namespaces: [argo], credential: clientCertificate, role: a, serviceAccounts: [x]}\n",
			"peers[0].grants[0].serviceAccounts: must be empty for a clientCertificate grant"},
		{"a token grant binds no role", "  - {namespaces: [argo], serviceAccounts: [x], role: a}\n",
			"peers[0].grants[0].role: only a clientCertificate grant binds a role"},
		{"a system: role is never bound", "  - {namespaces: [argo], credential: clientCertificate, clusterRole: 'system:masters'}\n",
			"peers[0].grants[0].clusterRole: must not be a system: role"},
		{"one namespace in two certificate grants would leave the role to chance",
			"  - {namespaces: [argo], credential: clientCertificate, role: a}\n  - {namespaces: [flux, argo], credential: clientCertificate, role: b}\n",
			`peers[0].grants[1].namespaces[1]: "argo" is in another clientCertificate grant of this peer`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p, err := Parse([]byte(head + tc.grants))
			if tc.want == "" {
				require.NoError(t, err)
				d, err := p.Decide("spiffe://a/cluster/w", "argo", "", apiv1.CredentialClientCertificate, 0, 0)
				require.NoError(t, err)
				require.NotEmpty(t, d.Role.Name)
				require.Contains(t, []string{"Role", "ClusterRole"}, d.Role.Kind)
				return
			}
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// problemDetail is what the caller is told of err.
func problemDetail(err error) string {
	var pe *problem.Error
	if errors.As(err, &pe) && pe.Detail != "" {
		return pe.Detail
	}
	return err.Error()
}
