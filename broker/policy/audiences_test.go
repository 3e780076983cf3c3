package policy

import (
	"fmt"
	"github.com/tokenbroker/tokenbroker/broker/policy/policytest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
)

func TestAudiencesAreThePolicysNotThePeers(t *testing.T) {
	t.Parallel()
	p := parsed(t, policytest.Audiences)
	const west = "spiffe://oc.example/cluster/west"
	tests := []struct {
		name      string
		ns        string
		audiences []string
		wantTTL   time.Duration // the grant that decided, by its maxTTL
		// wantAudienceRefusal: forbidden because of the audiences alone.
		wantAudienceRefusal bool
		wantForbidden       bool
	}{
		{name: "a request that names no audience is allowed by a grant that lists none", ns: "argo", wantTTL: 2 * time.Hour},
		{name: "a request for sts.amazonaws.com under a grant that lists no audience is refused", ns: "argo", audiences: []string{"sts.amazonaws.com"}, wantAudienceRefusal: true},
		{name: "a request for the API server's own audience, named, is refused unless listed", ns: "argo", audiences: []string{"https://kubernetes.default.svc"}, wantAudienceRefusal: true},
		{name: "a request for a listed audience is allowed by the grant that lists it", ns: "vault", audiences: []string{"vault.example"}, wantTTL: time.Hour},
		{name: "a request for every listed audience is allowed", ns: "vault", audiences: []string{"https://kubernetes.default.svc", "vault.example"}, wantTTL: time.Hour},
		{name: "a request that names one listed and one unlisted audience is refused", ns: "vault", audiences: []string{"vault.example", "sts.amazonaws.com"}, wantAudienceRefusal: true},
		{name: "audiences are compared exactly, not ignoring case", ns: "vault", audiences: []string{"Vault.example"}, wantAudienceRefusal: true},
		{name: "audiences are compared exactly, not ignoring a trailing slash", ns: "vault", audiences: []string{"https://kubernetes.default.svc/"}, wantAudienceRefusal: true},
		{name: "a more generous grant that does not list the audience does not decide", ns: "vault", audiences: []string{"vault.example"}, wantTTL: time.Hour},
		{name: "without audiences the more generous grant decides", ns: "vault", wantTTL: 12 * time.Hour},
		{name: "a namespace no grant covers is refused for that, not for its audiences", ns: "kube-system", audiences: []string{"sts.amazonaws.com"}, wantForbidden: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			d, err := p.DecideAudiences(nil, west, nil, tc.ns, "runner", "", tc.audiences, 24*time.Hour, 0)
			switch {
			case tc.wantAudienceRefusal:
				require.Equal(t, problem.KindForbidden, problem.KindOf(err))
				require.ErrorIs(t, err, ErrAudienceNotGranted)
				require.Equal(t, "no grant allows this request", problemDetail(err), "the caller is told no more than for any refusal")
			case tc.wantForbidden:
				require.Equal(t, problem.KindForbidden, problem.KindOf(err))
				require.NotErrorIs(t, err, ErrAudienceNotGranted)
			default:
				require.NoError(t, err)
				require.Equal(t, tc.wantTTL, d.TTL)
			}
		})
	}
}

func TestGrantAudiencesAreValidated(t *testing.T) {
	t.Parallel()
	grant := func(extra string) string {
		return `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - namespaces: [argo]
` + extra
	}
	var seventeen []string
	for i := range 17 {
		seventeen = append(seventeen, fmt.Sprintf("aud%d", i))
	}
	tests := []struct {
		name, doc, field, detail string
	}{
		{"a client certificate grant lists no audiences", grant("        clusterRole: view\n        credential: clientCertificate\n        audiences: [vault]\n"),
			"peers[0].grants[0].audiences", "only a token grant lists audiences"},
		{"a grant lists at most sixteen audiences", grant("        serviceAccounts: [runner]\n        audiences: [" + strings.Join(seventeen, ", ") + "]\n"),
			"peers[0].grants[0].audiences", "at most 16 audiences"},
		{"an empty audience is refused", grant("        serviceAccounts: [runner]\n        audiences: [\"\"]\n"),
			"peers[0].grants[0].audiences[0]", "printable ASCII"},
		{"an audience with a space is refused", grant("        serviceAccounts: [runner]\n        audiences: [\"a b\"]\n"),
			"peers[0].grants[0].audiences[0]", "printable ASCII"},
		{"an audience with a NUL byte is refused", grant("        serviceAccounts: [runner]\n        audiences: [\"a\\0b\"]\n"),
			"peers[0].grants[0].audiences[0]", "printable ASCII"},
		{"an audience over 256 characters is refused", grant("        serviceAccounts: [runner]\n        audiences: [" + strings.Repeat("a", 257) + "]\n"),
			"peers[0].grants[0].audiences[0]", "printable ASCII"},
		{"a wildcard is not an audience", grant("        serviceAccounts: [runner]\n        audiences: [\"*\"]\n"),
			"peers[0].grants[0].audiences[0]", "is not a wildcard"},
		{"a look-alike Unicode audience is refused", grant("        serviceAccounts: [runner]\n        audiences: [\"st\u0455.amazonaws.com\"]\n"),
			"peers[0].grants[0].audiences[0]", "printable ASCII"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse([]byte(tc.doc))
			var ve *apiv1.ValidationError
			require.ErrorAs(t, err, &ve)
			found := false
			for _, p := range ve.Problems {
				if p.Field == tc.field && strings.Contains(p.Detail, tc.detail) {
					found = true
				}
			}
			require.True(t, found, "want %s: %s in %+v", tc.field, tc.detail, ve.Problems)
		})
	}
	t.Run("a grant's audiences are shown by whoami", func(t *testing.T) {
		t.Parallel()
		_, gs := parsed(t, policytest.Audiences).Grants("spiffe://oc.example/cluster/west")
		require.Empty(t, gs[0].Audiences)
		require.Equal(t, []string{"vault.example", "https://kubernetes.default.svc"}, gs[1].Audiences)
	})
}

// FuzzDecideAudiences asks policytest.Audiences for hostile audiences: a request
// is allowed only if the grant that decided lists every audience it names,
// byte for byte.
func FuzzDecideAudiences(f *testing.F) {
	f.Add("vault", "vault.example", "")
	f.Add("vault", "vault.example", "https://kubernetes.default.svc")
	f.Add("argo", "sts.amazonaws.com", "")
	f.Add("vault", "Vault.example", "vault.example\x00")
	f.Add("vault", "*", "vault.example ")
	f.Add("vault", "st\u0455.amazonaws.com", "")
	p, err := Parse([]byte(policytest.Audiences))
	require.NoError(f, err)
	const west = "spiffe://oc.example/cluster/west"
	peer := p.Peer(west)
	f.Fuzz(func(t *testing.T, ns, a1, a2 string) {
		var auds []string
		for _, a := range []string{a1, a2} {
			if a != "" {
				auds = append(auds, a)
			}
		}
		d, err := p.DecideAudiences(nil, west, nil, ns, "runner", "", auds, 0, 0)
		if err != nil {
			require.Equal(t, problem.KindForbidden, problem.KindOf(err))
			return
		}
		var grant *GrantSpec
		for i := range peer.Grants {
			if peer.GrantRef(&peer.Grants[i]) == d.Grant {
				grant = &peer.Grants[i]
			}
		}
		require.NotNil(t, grant, d.Grant)
		for _, a := range auds {
			require.Contains(t, grant.Audiences, a)
		}
	})
}
