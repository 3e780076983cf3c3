package policy

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

const workloadPolicy = `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    workloadIdentity:
      issuer: https://kubernetes.default.svc.cluster.local
      audiences: [tokenbroker.east]
      jwksFromPeer: true
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
        workloads: [{namespace: argo, serviceAccount: runner}]
      - namespaces: [argo]
        serviceAccounts: [reader]
`

func TestAGrantThatNamesWorkloadsMatchesOnlyThem(t *testing.T) {
	t.Parallel()
	p := parsed(t, workloadPolicy)
	const west = "spiffe://oc.example/cluster/west"
	runner := &WorkloadRef{Namespace: "argo", ServiceAccount: "runner"}
	other := &WorkloadRef{Namespace: "argo", ServiceAccount: "other"}
	// A workload proved by its own pod certificate, not over the peer's
	// connection: any namespace's ServiceAccount of the peer's cluster
	// may have one, so it never gets what the peer's agent gets.
	runnerAlone := &WorkloadRef{Namespace: "argo", ServiceAccount: "runner", Standalone: true}
	tenantAlone := &WorkloadRef{Namespace: "tenant-a", ServiceAccount: "mine", Standalone: true}
	tests := []struct {
		name     string
		workload *WorkloadRef
		sa       string
		allowed  bool
	}{
		{name: "the named workload gets the grant", workload: runner, sa: "runner", allowed: true},
		{name: "another workload of the peer does not", workload: other, sa: "runner"},
		{name: "the peer without a workload token does not", sa: "runner"},
		{name: "a grant without workloads applies to any workload", workload: other, sa: "reader", allowed: true},
		{name: "a grant without workloads applies without a token", sa: "reader", allowed: true},
		{name: "a pod certificate's workload gets the grant that names it", workload: runnerAlone, sa: "runner", allowed: true},
		{name: "a pod certificate's workload never gets a grant without workloads", workload: runnerAlone, sa: "reader"},
		{name: "nor does a tenant's, labelled by the tenant", workload: tenantAlone, sa: "reader"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := p.DecideFor(nil, west, tc.workload, "argo", tc.sa, "", 0, 0)
			if tc.allowed {
				require.NoError(t, err)
				return
			}
			require.Equal(t, problem.KindForbidden, problem.KindOf(err))
		})
	}
	_, grants := p.GrantsFor(west, other, true, nil)
	require.Len(t, grants, 1, "a workload sees only the grants that apply to it")
	_, grants = p.GrantsFor(west, runner, true, nil)
	require.Len(t, grants, 2)
	require.Equal(t, []apiv1.WorkloadRef{{Namespace: "argo", ServiceAccount: "runner"}}, grants[0].Workloads)
	_, grants = p.GrantsFor(west, runnerAlone, true, nil)
	require.Len(t, grants, 1, "a pod certificate's workload sees only the grant that names it")
	_, grants = p.GrantsFor(west, tenantAlone, true, nil)
	require.Empty(t, grants)
}

func TestWorkloadIdentityIsValidatedWithFieldPaths(t *testing.T) {
	t.Parallel()
	doc := `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    workloadIdentity:
      issuer: ""
      audiences: [" "]
      jwks: '{"keys":[]}'
      jwksFromPeer: true
      maxTokenAge: 8760h
      jwksOverlap: 1s
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
        workloads: [{namespace: Argo, serviceAccount: "bad name"}]
  - name: north
    identity: spiffe://oc.example/cluster/north
    grants:
      - namespaces: [argo]
        serviceAccounts: [runner]
        workloads: [{namespace: argo, serviceAccount: runner}]
`
	_, err := Parse([]byte(doc))
	var ve *apiv1.ValidationError
	require.ErrorAs(t, err, &ve)
	fields := map[string]bool{}
	for _, p := range ve.Problems {
		fields[p.Field] = true
	}
	for _, want := range []string{
		"peers[0].workloadIdentity.issuer", "peers[0].workloadIdentity.audiences[0]",
		"peers[0].workloadIdentity.jwks", "peers[0].workloadIdentity.maxTokenAge",
		"peers[0].grants[0].workloads[0].namespace", "peers[0].grants[0].workloads[0].serviceAccount",
		"peers[1].grants[0].workloads",
	} {
		require.True(t, fields[want], "missing problem for %s in %v", want, ve.Problems)
	}
}

func TestAJWKSFileIsReadRelativeToThePolicyAndReloadedWhenItChanges(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	writeKeys := func() string {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		kid, err := pki.KubernetesKeyID(key.Public())
		require.NoError(t, err)
		raw, err := pki.EncodeJWKS(map[string]crypto.PublicKey{kid: key.Public()})
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, "west.jwks"), raw, 0o600))
		return kid
	}
	kid := writeKeys()
	path := filepath.Join(dir, "policy.yaml")
	require.NoError(t, os.WriteFile(path, []byte(`
cluster: {name: east, server: "https://east.example.com:6443", caData: "-----BEGIN CERTIFICATE-----\nMA==\n-----END CERTIFICATE-----\n"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    workloadIdentity: {issuer: "https://west", audiences: [tokenbroker.east], jwksFile: west.jwks}
`), 0o600))
	p, err := LoadFile(path)
	require.NoError(t, err)
	require.Equal(t, []string{kid}, p.Peers[0].WorkloadIdentity.StaticKeys().KeyIDs())

	store := NewStore(p)
	w, err := NewWatcher(path, store, zap.NewNop(), nil, time.Hour)
	require.NoError(t, err)
	kid2 := writeKeys()
	require.NoError(t, w.Check())
	require.Equal(t, []string{kid2}, store.Load().Peers[0].WorkloadIdentity.StaticKeys().KeyIDs())

	require.NoError(t, os.WriteFile(filepath.Join(dir, "west.jwks"), []byte(`{"keys":[]}`), 0o600))
	require.ErrorContains(t, w.Check(), "jwksFile")
	require.Equal(t, []string{kid2}, store.Load().Peers[0].WorkloadIdentity.StaticKeys().KeyIDs(), "a bad key file keeps the policy in force")
}

func TestLivePodsFromPeerNeedsUploadedKeysAndPodBinding(t *testing.T) {
	t.Parallel()
	peer := func(wi string) string {
		return `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    workloadIdentity: {issuer: "https://west.example", audiences: [tokenbroker.east], ` + wi + `}
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`
	}
	for _, tc := range []struct {
		wi, field, detail string
	}{
		{`jwks: '{"keys":[]}', livePodsFromPeer: true, requirePodBinding: true`, "livePodsFromPeer", "needs jwksFromPeer"},
		{`jwksFromPeer: true, livePodsFromPeer: true`, "livePodsFromPeer", "needs requirePodBinding"},
		{`jwksFromPeer: true, requirePodBinding: true, livePodsMaxAge: 1m`, "livePodsMaxAge", "only applies with livePodsFromPeer"},
		{`jwksFromPeer: true, requirePodBinding: true, livePodsFromPeer: true, livePodsMaxAge: 5s`, "livePodsMaxAge", "between 10s and 1h0m0s"},
		{`jwksFromPeer: true, requirePodBinding: true, livePodsFromPeer: true, livePodsMaxAge: 2h`, "livePodsMaxAge", "between 10s and 1h0m0s"},
	} {
		_, err := Parse([]byte(peer(tc.wi)))
		var ve *apiv1.ValidationError
		require.ErrorAs(t, err, &ve, tc.wi)
		var found bool
		for _, p := range ve.Problems {
			if p.Field == "peers[0].workloadIdentity."+tc.field && strings.Contains(p.Detail, tc.detail) {
				found = true
			}
		}
		require.True(t, found, "%s: want %s %q in %v", tc.wi, tc.field, tc.detail, ve.Problems)
	}

	p, err := Parse([]byte(peer(`jwksFromPeer: true, requirePodBinding: true, livePodsFromPeer: true`)))
	require.NoError(t, err)
	require.Equal(t, DefaultLivePodsMaxAge, p.Peers[0].WorkloadIdentity.EffectiveLivePodsMaxAge())
	p, err = Parse([]byte(peer(`jwksFromPeer: true, requirePodBinding: true, livePodsFromPeer: true, livePodsMaxAge: 30s`)))
	require.NoError(t, err)
	require.Equal(t, 30*time.Second, p.Peers[0].WorkloadIdentity.EffectiveLivePodsMaxAge())
}

func TestPodCertificatesAloneNeedNoTokenTrust(t *testing.T) {
	t.Parallel()
	peer := func(wi string) string {
		return `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    workloadIdentity: ` + wi + `
    grants: [{namespaces: [argo], serviceAccounts: [runner], workloads: [{namespace: argo, serviceAccount: runner}]}]
`
	}
	p, err := Parse([]byte(peer(`{podCertificates: true}`)))
	require.NoError(t, err)
	wi := p.Peers[0].WorkloadIdentity
	require.True(t, wi.PodCertificates)
	require.False(t, wi.TrustsTokens())

	// Token settings without the token trust they apply to are refused.
	var ve *apiv1.ValidationError
	for _, wi := range []string{
		`{podCertificates: true, requirePodBinding: true}`,
		`{podCertificates: true, maxTokenAge: 1h}`,
		`{podCertificates: true, jwksOverlap: 1h}`,
	} {
		_, err = Parse([]byte(peer(wi)))
		require.ErrorAs(t, err, &ve, wi)
		require.Equal(t, "peers[0].workloadIdentity", ve.Problems[0].Field, wi)
		require.Contains(t, ve.Problems[0].Detail, "need the token trust too", wi)
	}

	// Half a token trust is still refused as before.
	_, err = Parse([]byte(peer(`{podCertificates: true, issuer: "https://west.example"}`)))
	require.ErrorAs(t, err, &ve)

	// Both: tokens as before, and pod certificates.
	p, err = Parse([]byte(peer(`{podCertificates: true, issuer: "https://west.example", audiences: [tokenbroker.east], jwksFromPeer: true}`)))
	require.NoError(t, err)
	require.True(t, p.Peers[0].WorkloadIdentity.TrustsTokens())

	// Without workloadIdentity a grant's workloads prove nothing.
	_, err = Parse([]byte(strings.Replace(peer(`{}`), "    workloadIdentity: {}\n", "", 1)))
	require.ErrorAs(t, err, &ve)
	require.Contains(t, ve.Problems[0].Detail, "by token or pod certificate")
}

// TestLivePodsApplyToPodCertificatesAlone: a peer that trusts pod
// certificates only may have its agent report its live Pods, with no key
// set and no pod binding (which are about tokens), and livePodsMaxAge is
// checked as for tokens.
func TestLivePodsApplyToPodCertificatesAlone(t *testing.T) {
	t.Parallel()
	peer := func(wi string) string {
		return `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    workloadIdentity: ` + wi + `
    grants: [{namespaces: [argo], serviceAccounts: [runner], workloads: [{namespace: argo, serviceAccount: runner}]}]
`
	}
	p, err := Parse([]byte(peer(`{podCertificates: true, livePodsFromPeer: true}`)))
	require.NoError(t, err)
	wi := p.Peers[0].WorkloadIdentity
	require.True(t, wi.LivePodsFromPeer)
	require.False(t, wi.TrustsTokens(), "still no token trust")
	require.Equal(t, DefaultLivePodsMaxAge, wi.EffectiveLivePodsMaxAge())

	p, err = Parse([]byte(peer(`{podCertificates: true, livePodsFromPeer: true, livePodsMaxAge: 30s}`)))
	require.NoError(t, err)
	require.Equal(t, 30*time.Second, p.Peers[0].WorkloadIdentity.EffectiveLivePodsMaxAge())

	for _, tc := range []struct{ wi, field, detail string }{
		{`{podCertificates: true, livePodsMaxAge: 1m}`, "livePodsMaxAge", "only applies with livePodsFromPeer"},
		{`{podCertificates: true, livePodsFromPeer: true, livePodsMaxAge: 5s}`, "livePodsMaxAge", "between 10s and 1h0m0s"},
		// With token trust the rules for tokens hold, pod certificates or not.
		{`{podCertificates: true, issuer: "https://west.example", audiences: [tokenbroker.east], jwks: '{"keys":[]}', livePodsFromPeer: true, requirePodBinding: true}`, "livePodsFromPeer", "needs jwksFromPeer"},
		{`{podCertificates: true, issuer: "https://west.example", audiences: [tokenbroker.east], jwksFromPeer: true, livePodsFromPeer: true}`, "livePodsFromPeer", "needs requirePodBinding"},
	} {
		_, err := Parse([]byte(peer(tc.wi)))
		var ve *apiv1.ValidationError
		require.ErrorAs(t, err, &ve, tc.wi)
		require.True(t, slices.ContainsFunc(ve.Problems, func(p apiv1.FieldError) bool {
			return p.Field == "peers[0].workloadIdentity."+tc.field && strings.Contains(p.Detail, tc.detail)
		}), "%s: want %s %q in %v", tc.wi, tc.field, tc.detail, ve.Problems)
	}
}

func TestAPeersAgentNamesOneWorkloadOfItsCluster(t *testing.T) {
	t.Parallel()
	const head = `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants: [{namespaces: [argo], serviceAccounts: [runner]}]
`
	p := parsed(t, head+"    agent: {namespace: tokenbroker-agent, serviceAccount: tokenbroker-agent}\n")
	west := p.Peer("spiffe://oc.example/cluster/west")
	require.True(t, west.IsAgent("tokenbroker-agent", "tokenbroker-agent"), "it needs no workloadIdentity")
	require.False(t, west.IsAgent("other", "tokenbroker-agent"), "the same ServiceAccount in another namespace is not")
	require.False(t, west.IsAgent("tokenbroker-agent", "other"))
	require.False(t, parsed(t, head).Peer("spiffe://oc.example/cluster/west").IsAgent("tokenbroker-agent", "tokenbroker-agent"), "no agent: none is")
	require.False(t, (*PeerSpec)(nil).IsAgent("tokenbroker-agent", "tokenbroker-agent"), "no peer: none is")

	tests := []struct {
		name, agent string
		want        map[string]string
	}{
		{name: "both fields are required", agent: "{}", want: map[string]string{
			"peers[0].agent.namespace": "is required", "peers[0].agent.serviceAccount": "is required"}},
		{name: "the namespace is a DNS-1123 label", agent: "{namespace: Tokenbroker.Agent, serviceAccount: agent}", want: map[string]string{
			"peers[0].agent.namespace": "RFC 1123 label"}},
		{name: "the ServiceAccount is a DNS-1123 subdomain", agent: `{namespace: agent, serviceAccount: "bad name"}`, want: map[string]string{
			"peers[0].agent.serviceAccount": "RFC 1123 subdomain"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := Parse([]byte(head + "    agent: " + tc.agent + "\n"))
			var ve *apiv1.ValidationError
			require.ErrorAs(t, err, &ve)
			got := map[string]string{}
			for _, p := range ve.Problems {
				got[p.Field] = p.Detail
			}
			require.Len(t, got, len(tc.want), "%v", ve.Problems)
			for field, detail := range tc.want {
				require.Contains(t, got[field], detail)
			}
		})
	}
	_, err := Parse([]byte(head + "    agent: {namespace: a, serviceAccount: b, pod: c}\n"))
	require.ErrorContains(t, err, `unknown field "pod"`)
}
