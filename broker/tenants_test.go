package broker

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/tenants"
)

func TestNamespaceSelectorGrantsAreValidatedWithFieldPaths(t *testing.T) {
	t.Parallel()
	const head = "cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n"
	tests := []struct{ name, grants, want string }{
		{"a named grant with matchLabels is valid", "  - {name: t, namespaceSelector: {matchLabels: {tenant: oil}}, serviceAccounts: [sa]}\n", ""},
		{"a selector alone needs no namespaces", "  - {name: t, namespaceSelector: {matchExpressions: [{key: tenant, operator: Exists}]}, serviceAccounts: [sa]}\n", ""},
		{"an empty selector is an error, not every namespace", "  - {name: t, namespaceSelector: {}, serviceAccounts: [sa]}\n",
			"peers[0].grants[0].namespaceSelector: must have matchLabels or matchExpressions"},
		{"a selector grant must be named", "  - {namespaceSelector: {matchLabels: {tenant: oil}}, serviceAccounts: [sa]}\n",
			"peers[0].grants[0].name: is required with namespaceSelector"},
		{"an unknown operator is reported at its path", "  - {name: t, namespaceSelector: {matchExpressions: [{key: tenant, operator: Like, values: [a]}]}, serviceAccounts: [sa]}\n",
			"peers[0].grants[0].namespaceSelector.matchExpressions[0].operator: Invalid value: \"Like\": not a valid selector operator"},
		{"In without values is reported at its path", "  - {name: t, namespaceSelector: {matchExpressions: [{key: tenant, operator: In}]}, serviceAccounts: [sa]}\n",
			"peers[0].grants[0].namespaceSelector.matchExpressions[0].values"},
		{"a label value that cannot be one is reported", "  - {name: t, namespaceSelector: {matchLabels: {tenant: 'not ok'}}, serviceAccounts: [sa]}\n",
			"peers[0].grants[0].namespaceSelector.matchLabels"},
		{"a selector is for token grants only", "  - {name: t, namespaceSelector: {matchLabels: {tenant: oil}}, credential: clientCertificate, clusterRole: view}\n",
			"peers[0].grants[0].namespaceSelector: is for token grants only"},
		{"revokeOnUnmatch needs a selector", "  - {namespaces: [a], serviceAccounts: [sa], revokeOnUnmatch: false}\n",
			"peers[0].grants[0].revokeOnUnmatch: only a grant with namespaceSelector"},
		{"revokeDelay is bounded by ttl.max", "  - {name: t, namespaceSelector: {matchLabels: {tenant: oil}}, serviceAccounts: [sa], revokeDelay: 48h}\n",
			"peers[0].grants[0].revokeDelay: must be between 0 and ttl.max"},
		{"grant names are unique within a peer", "  - {name: t, namespaces: [a], serviceAccounts: [sa]}\n  - {name: t, namespaces: [b], serviceAccounts: [sa]}\n",
			`peers[0].grants[1].name: duplicate grant name "t"`},
		{"a grant without namespaces or selector still grants nothing", "  - {serviceAccounts: [sa]}\n",
			"peers[0].grants[0].namespaces: must list at least one namespace (or set namespaceSelector)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := policy.Parse([]byte(head + tt.grants))
			if tt.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.want)
		})
	}
}

// nsMap is a namespace cache for pure decisions.
type nsMap map[string]labels.Set

func (m nsMap) NamespaceLabels(name string) (labels.Set, bool) {
	s, ok := m[name]
	return s, ok
}

func TestSelectorGrantsDecideFromTheNamespacesLabels(t *testing.T) {
	t.Parallel()
	p := mustPolicy(t, `
cluster: {name: east, server: "https://east.example.com:6443", caData: "x"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - name: in
        namespaceSelector: {matchExpressions: [{key: tenant, operator: In, values: [oil, gas]}]}
        serviceAccounts: [in]
      - name: notin
        namespaceSelector: {matchExpressions: [{key: tenant, operator: NotIn, values: [oil]}]}
        serviceAccounts: [notin]
      - name: exists
        namespaceSelector: {matchExpressions: [{key: tenant, operator: Exists}]}
        serviceAccounts: [exists]
      - name: absent
        namespaceSelector: {matchExpressions: [{key: tenant, operator: DoesNotExist}]}
        namespaces: [listed]
        serviceAccounts: [absent]
`)
	nss := nsMap{
		"oil-a":  {"tenant": "oil"},
		"gas-a":  {"tenant": "gas"},
		"water":  {"tenant": "water"},
		"plain":  {},
		"listed": {"tenant": "oil"},
	}
	const west = "spiffe://oc.example/cluster/west"
	tests := []struct {
		name, ns, sa string
		allowed      bool
	}{
		{"In matches a listed value", "gas-a", "in", true},
		{"In refuses another value", "water", "in", false},
		{"NotIn matches another value", "water", "notin", true},
		{"NotIn refuses the listed value", "oil-a", "notin", false},
		{"NotIn matches a namespace without the label, as Kubernetes does", "plain", "notin", true},
		{"Exists matches any value", "water", "exists", true},
		{"Exists refuses a namespace without the label", "plain", "exists", false},
		{"DoesNotExist matches a namespace without the label", "plain", "absent", true},
		{"DoesNotExist refuses a labelled namespace", "oil-a", "absent", false},
		{"a namespace listed by name is granted whatever its labels (the union)", "listed", "absent", true},
		{"a namespace the cache does not know matches no selector", "unknown", "exists", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			d, err := p.DecideIn(nss, west, tt.ns, tt.sa, "", 0, 0)
			if !tt.allowed {
				require.Equal(t, problem.KindForbidden, problem.KindOf(err))
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.sa, d.Grant)
		})
	}
	t.Run("without a namespace cache a selector grant matches nothing", func(t *testing.T) {
		t.Parallel()
		_, err := p.Decide(west, "oil-a", "in", "", 0, 0)
		require.Equal(t, problem.KindForbidden, problem.KindOf(err))
	})
}

// fakeNamespaces is a namespace informer for pure-logic tests: the test
// adds, changes and deletes namespaces and the handlers see it at once.
type fakeNamespaces struct {
	mu       sync.Mutex
	store    cache.Store
	handlers []cache.ResourceEventHandler
	synced   bool
}

func newFakeNamespaces() *fakeNamespaces {
	return &fakeNamespaces{store: cache.NewStore(cache.MetaNamespaceKeyFunc)}
}

func (f *fakeNamespaces) AddEventHandler(h cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.handlers = append(f.handlers, h)
	for _, obj := range f.store.List() {
		h.OnAdd(obj, true)
	}
	return nil, nil
}
func (f *fakeNamespaces) GetStore() cache.Store { return f.store }
func (f *fakeNamespaces) HasSynced() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.synced
}

func nsMeta(name string, lbls map[string]string) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls}}
}

func (f *fakeNamespaces) set(name string, lbls map[string]string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	obj := nsMeta(name, lbls)
	old, exists, _ := f.store.GetByKey(name)
	_ = f.store.Update(obj)
	for _, h := range f.handlers {
		if exists {
			h.OnUpdate(old, obj)
		} else {
			h.OnAdd(obj, false)
		}
	}
}

func (f *fakeNamespaces) remove(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	old, _, _ := f.store.GetByKey(name)
	_ = f.store.Delete(old)
	for _, h := range f.handlers {
		h.OnDelete(cache.DeletedFinalStateUnknown{Key: name, Obj: old})
	}
}

type tenantEnv struct {
	b       *Broker
	client  *fake.Clientset
	nss     *fakeNamespaces
	store   *policy.Store
	clock   *clocktesting.FakeClock
	reg     *prometheus.Registry
	audit   *auditRecorder
	cancel  context.CancelFunc
	stopped chan struct{}
}

func newTenantEnv(t *testing.T, pol string, namespaces map[string]map[string]string) *tenantEnv {
	t.Helper()
	nss := newFakeNamespaces()
	for name, l := range namespaces {
		nss.set(name, l)
	}
	nss.synced = true
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	e := &tenantEnv{
		client: fake.NewClientset(), nss: nss, store: policy.NewStore(mustPolicy(t, pol)),
		clock: clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)),
		reg:   reg, audit: newAuditRecorder(), stopped: make(chan struct{}),
	}
	e.b, err = New(Config{
		Secrets: e.client.CoreV1(), Issuers: map[string]Issuer{apiv1.CredentialToken: &fakeIssuer{}},
		Policy: e.store, Logger: zap.NewNop(), Metrics: m, Clock: e.clock, Auditor: e.audit, Namespaces: nss,
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	e.cancel = cancel
	go func() { defer close(e.stopped); e.b.RunTenants(ctx) }()
	t.Cleanup(func() { cancel(); <-e.stopped })
	return e
}

var north = Caller{Identity: "spiffe://oc.example/cluster/north"}

func (e *tenantEnv) issue(t *testing.T, c Caller, ns string) string {
	t.Helper()
	resp, err := e.b.IssueKubeconfig(context.Background(), c, apiv1.KubeconfigRequest{Namespace: ns, ServiceAccount: "gitops-reconciler"})
	require.NoError(t, err)
	return resp.LeaseID
}

func (e *tenantEnv) live(t *testing.T, ns, id string) bool {
	t.Helper()
	_, err := e.client.CoreV1().Secrets(ns).Get(context.Background(), objects.LeaseSecretPrefix+id, metav1.GetOptions{})
	return err == nil
}

// requireRevoked waits for the revoking goroutine; nothing sleeps on the
// wall clock, the fake clock decides when delays end.
func (e *tenantEnv) requireRevoked(t *testing.T, ns, id string) {
	t.Helper()
	require.Eventually(t, func() bool { return !e.live(t, ns, id) }, 5*time.Second, time.Millisecond, "lease %s/%s not revoked", ns, id)
}

var oil = map[string]string{"capsule.clastix.io/tenant": "oil"}

func TestANamespaceThatLeavesASelectorGrantLosesItsLeases(t *testing.T) {
	t.Parallel()
	e := newTenantEnv(t, tenantPolicy, map[string]map[string]string{"oil-dev": oil, "oil-prod": oil, "argo": nil})
	dev := e.issue(t, west, "oil-dev")
	prod := e.issue(t, west, "oil-prod")
	byName := e.issue(t, west, "argo")
	kept := e.issue(t, north, "oil-dev")

	s, err := e.client.CoreV1().Secrets("oil-dev").Get(context.Background(), objects.LeaseSecretPrefix+dev, metav1.GetOptions{})
	require.NoError(t, err)
	require.Equal(t, "oil", s.Annotations[objects.AnnotationGrant], "the lease records its grant")

	e.nss.set("oil-dev", map[string]string{"capsule.clastix.io/tenant": "gas"})
	e.requireRevoked(t, "oil-dev", dev)
	require.True(t, e.live(t, "oil-prod", prod), "a namespace still matching keeps its lease")
	require.True(t, e.live(t, "argo", byName), "a grant by name is not touched")
	require.True(t, e.live(t, "oil-dev", kept), "revokeOnUnmatch: false keeps the other peer's lease")

	_, err = e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: "oil-dev", ServiceAccount: "gitops-reconciler"})
	require.Equal(t, problem.KindForbidden, problem.KindOf(err), "new requests are refused")

	require.NoError(t, testutil.CollectAndCompare(e.reg, strings.NewReader(`
# HELP tokenbroker_unmatched_revocations_total Leases revoked because their namespace stopped being covered by their selector grant, by reason (label_changed, namespace_deleted, policy_narrowed, found_at_start, found_by_gc).
# TYPE tokenbroker_unmatched_revocations_total counter
tokenbroker_unmatched_revocations_total{reason="label_changed"} 1
`), "tokenbroker_unmatched_revocations_total"))
	var revoked []audit.Event
	for _, ev := range e.audit.all() {
		if ev.Action == audit.ActionRevoke {
			revoked = append(revoked, ev)
		}
	}
	require.Len(t, revoked, 1)
	require.Equal(t, dev, revoked[0].LeaseID)
	require.Equal(t, "oil", revoked[0].Grant)
	require.Equal(t, west.Identity, revoked[0].Identity)
	require.Contains(t, revoked[0].Reason, "label_changed")

	e.nss.remove("oil-prod")
	e.requireRevoked(t, "oil-prod", prod)
	require.NoError(t, testutil.CollectAndCompare(e.reg, strings.NewReader(`
# HELP tokenbroker_unmatched_revocations_total Leases revoked because their namespace stopped being covered by their selector grant, by reason (label_changed, namespace_deleted, policy_narrowed, found_at_start, found_by_gc).
# TYPE tokenbroker_unmatched_revocations_total counter
tokenbroker_unmatched_revocations_total{reason="label_changed"} 1
tokenbroker_unmatched_revocations_total{reason="namespace_deleted"} 1
`), "tokenbroker_unmatched_revocations_total"))
}

func TestAnUnchangedNamespaceSeenAgainRevokesNothing(t *testing.T) {
	t.Parallel()
	e := newTenantEnv(t, tenantPolicy, map[string]map[string]string{"oil-dev": oil})
	id := e.issue(t, west, "oil-dev")
	// What an informer's re-list after an API server restart delivers.
	e.nss.set("oil-dev", oil)
	e.nss.set("oil-dev", map[string]string{"capsule.clastix.io/tenant": "oil", "other": "x"})
	e.b.tenants.Queue.ShutDownWithDrain()
	require.True(t, e.live(t, "oil-dev", id))
	require.Zero(t, metricValue(t, e.reg, "tokenbroker_unmatched_revocations_total", "reason", tenants.UnmatchLabelChanged))
}

func TestTheDelayRidesOutARelabel(t *testing.T) {
	t.Parallel()
	pol := strings.Replace(tenantPolicy, "        maxTTL: 4h\n", "        maxTTL: 4h\n        revokeDelay: 30s\n", 1)
	e := newTenantEnv(t, pol, map[string]map[string]string{"oil-dev": oil, "oil-prod": oil})
	dev, prod := e.issue(t, west, "oil-dev"), e.issue(t, west, "oil-prod")

	e.nss.set("oil-dev", nil)
	e.nss.set("oil-prod", nil)
	e.nss.set("oil-dev", oil) // relabelled back within the delay
	require.Eventually(t, func() bool { return e.clock.HasWaiters() }, 5*time.Second, time.Millisecond)
	e.clock.Step(29 * time.Second)
	require.True(t, e.live(t, "oil-prod", prod), "not before the delay")
	e.clock.Step(2 * time.Second)
	e.requireRevoked(t, "oil-prod", prod)
	require.True(t, e.live(t, "oil-dev", dev), "a namespace that matches again when the delay ends keeps its lease")
}

func TestAReloadThatNarrowsAGrantRevokesWhatItNoLongerCovers(t *testing.T) {
	t.Parallel()
	e := newTenantEnv(t, tenantPolicy, map[string]map[string]string{"oil-dev": oil, "oil-system": nil})
	dev, sys := e.issue(t, west, "oil-dev"), e.issue(t, west, "oil-system")

	narrowed := strings.Replace(tenantPolicy, "        matchLabels: {capsule.clastix.io/tenant: oil}\n        namespaces: [oil-system]\n",
		"        matchLabels: {capsule.clastix.io/tenant: oil, tier: prod}\n        namespaces: [oil-system]\n", 1)
	require.NotEqual(t, tenantPolicy, narrowed)
	e.store.Store(mustPolicy(t, narrowed))
	e.requireRevoked(t, "oil-dev", dev)
	require.True(t, e.live(t, "oil-system", sys), "still listed by name")
	// Counted once the deletion returns, a moment after the lease is gone.
	require.Eventually(t, func() bool {
		return metricValue(t, e.reg, "tokenbroker_unmatched_revocations_total", "reason", tenants.UnmatchPolicy) == 1
	}, 5*time.Second, time.Millisecond)

	// Removing the grant altogether narrows it to nothing.
	e.store.Store(mustPolicy(t, strings.Replace(narrowed, "namespaces: [oil-system]", "namespaces: [other]", 1)))
	e.requireRevoked(t, "oil-system", sys)
}

func TestWhoAmIListsTheNamespacesASelectorMatchesNow(t *testing.T) {
	t.Parallel()
	e := newTenantEnv(t, tenantPolicy, map[string]map[string]string{"oil-b": oil, "oil-a": oil, "gas": {"capsule.clastix.io/tenant": "gas"}})
	_, grants := e.b.WhoAmI(west)
	require.Equal(t, "oil", grants[0].Name)
	require.Equal(t, []string{"oil-a", "oil-b"}, grants[0].MatchingNamespaces)
	require.Equal(t, map[string]string{"capsule.clastix.io/tenant": "oil"}, grants[0].NamespaceSelector.MatchLabels)
	require.True(t, *grants[0].RevokeOnUnmatch)
	require.Nil(t, grants[1].NamespaceSelector)

	e.nss.set("gas", oil)
	_, grants = e.b.WhoAmI(west)
	require.Equal(t, []string{"gas", "oil-a", "oil-b"}, grants[0].MatchingNamespaces)
}

func TestThePeerListsItsLeasesInMatchingNamespaces(t *testing.T) {
	t.Parallel()
	e := newTenantEnv(t, tenantPolicy, map[string]map[string]string{"oil-dev": oil})
	id := e.issue(t, west, "oil-dev")
	leases, err := allLeases(context.Background(), e.b, west)
	require.NoError(t, err)
	require.Len(t, leases, 1)
	require.Equal(t, id, leases[0].ID)
	require.Equal(t, "oil", leases[0].Grant)
}

func TestTheBrokerIsNotReadyUntilTheNamespaceCacheHasSynced(t *testing.T) {
	t.Parallel()
	e := newTenantEnv(t, tenantPolicy, nil)
	e.nss.mu.Lock()
	e.nss.synced = false
	e.nss.mu.Unlock()
	require.ErrorContains(t, e.b.Ready(context.Background()), "namespace cache not synced")
}

func TestAtStartLeasesLeftInNamespacesThatNoLongerMatchAreRevoked(t *testing.T) {
	t.Parallel()
	// A lease of grant "oil" in a namespace that lost its label while no
	// broker watched.
	e := newTenantEnv(t, tenantPolicy, map[string]map[string]string{"oil-dev": nil})
	_, err := e.client.CoreV1().Secrets("oil-dev").Create(context.Background(), e.b.leaseSecret("aaaaaaaaaaaaaaaaaaaaaaaaaa", west,
		policy.Decision{Peer: "west", Credential: apiv1.CredentialToken, Grant: "oil"},
		apiv1.KubeconfigRequest{Namespace: "oil-dev", ServiceAccount: "gitops-reconciler"}, e.clock.Now().Add(time.Hour)), metav1.CreateOptions{})
	require.NoError(t, err)
	e.b.revoker().Sweep(context.Background())
	e.clock.Step(tenants.UncoveredRecheck) // the cache is looked at again then
	e.requireRevoked(t, "oil-dev", "aaaaaaaaaaaaaaaaaaaaaaaaaa")
	require.Eventually(t, func() bool {
		return metricValue(t, e.reg, "tokenbroker_unmatched_revocations_total", "reason", tenants.UnmatchFoundAtStart) == 1
	}, 5*time.Second, time.Millisecond, "counted once the deletion returns")
}

// BenchmarkDecideWithManyNamespaces shows that a selector grant decides in
// the same time with 5,000 namespaces as with 5: one cache lookup, not a
// scan.
func BenchmarkDecideWithManyNamespaces(b *testing.B) {
	for _, n := range []int{5, 5000} {
		b.Run(fmt.Sprintf("namespaces=%d", n), func(b *testing.B) {
			nss := newFakeNamespaces()
			for i := range n {
				nss.set(fmt.Sprintf("oil-%d", i), oil)
			}
			p, err := policy.Parse([]byte(tenantPolicy))
			require.NoError(b, err)
			tn, err := tenants.NewTracker(nss, policy.NewStore(p), clocktesting.NewFakeClock(time.Now()), zap.NewNop(), nil, nil)
			require.NoError(b, err)
			b.ResetTimer()
			for i := range b.N {
				if _, err := p.DecideIn(tn, west.Identity, fmt.Sprintf("oil-%d", i%n), "gitops-reconciler", "", 0, 0); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
