package broker

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	clocktesting "k8s.io/utils/clock/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/tenants"
)

// Races between an issuance and a namespace leaving its selector grant,
// and the GC's durable revocation, with the fake clientset: the
// interleavings are forced by hooks on the Secret calls, and nothing runs
// the revocation queue but the test. test/integration/tenants_test.go
// runs a restart in the middle against a real kube-apiserver.

// hookedSecrets calls before ahead of every create and patch of a Secret,
// so that a test can run something at that exact point of an issuance.
type hookedSecrets struct {
	corev1client.SecretsGetter
	before func(verb, namespace, name string)
}

func (h hookedSecrets) Secrets(namespace string) corev1client.SecretInterface {
	return hookedSecretInterface{SecretInterface: h.SecretsGetter.Secrets(namespace), h: h, ns: namespace}
}

type hookedSecretInterface struct {
	corev1client.SecretInterface
	h  hookedSecrets
	ns string
}

func (s hookedSecretInterface) Create(ctx context.Context, secret *corev1.Secret, opts metav1.CreateOptions) (*corev1.Secret, error) {
	s.h.before("create", s.ns, secret.Name)
	return s.SecretInterface.Create(ctx, secret, opts)
}

func (s hookedSecretInterface) Patch(ctx context.Context, name string, pt types.PatchType, data []byte, opts metav1.PatchOptions, sub ...string) (*corev1.Secret, error) {
	s.h.before("patch", s.ns, name)
	return s.SecretInterface.Patch(ctx, name, pt, data, opts, sub...)
}

// raceEnv is a broker with selector grants whose revocation queue only the
// test runs (runQueue), so that when a revocation happens is the test's
// choice.
type raceEnv struct {
	b      *Broker
	client *fake.Clientset
	nss    *fakeNamespaces
	store  *policy.Store
	clock  *clocktesting.FakeClock
	reg    *prometheus.Registry
	audit  *auditRecorder
	// hook, if set, runs before a Secret create or patch.
	mu   sync.Mutex
	hook func(verb, namespace, name string)
}

func newRaceEnv(t *testing.T, pol string, namespaces map[string]map[string]string, pool bool) *raceEnv {
	t.Helper()
	nss := newFakeNamespaces()
	for name, l := range namespaces {
		nss.set(name, l)
	}
	nss.synced = true
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	require.NoError(t, err)
	e := &raceEnv{
		client: fake.NewClientset(), nss: nss, store: policy.NewStore(mustPolicy(t, pol)),
		clock: clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)),
		reg:   reg, audit: newAuditRecorder(),
	}
	poolCfg := lease.PoolConfig{PerNamespace: -1}
	if pool {
		poolCfg = lease.PoolConfig{PerNamespace: 1}
	}
	e.b, err = New(Config{
		Secrets: hookedSecrets{SecretsGetter: e.client.CoreV1(), before: func(verb, ns, name string) {
			e.mu.Lock()
			h := e.hook
			e.mu.Unlock()
			if h != nil {
				h(verb, ns, name)
			}
		}},
		Issuers: map[string]Issuer{apiv1.CredentialToken: &fakeIssuer{}},
		Policy:  e.store, Logger: zap.NewNop(), Metrics: m, Clock: e.clock, Auditor: e.audit, Namespaces: nss, Pool: poolCfg,
	})
	require.NoError(t, err)
	if e.b.pool != nil {
		e.b.pool.SetRunning(true) // as RunPool does; the test tends it by hand
	}
	t.Cleanup(e.b.tenants.Queue.ShutDown)
	return e
}

func (e *raceEnv) setHook(h func(verb, namespace, name string)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.hook = h
}

// runQueue carries out every revocation that is due now, as RunTenants
// would.
func (e *raceEnv) runQueue(t *testing.T) {
	t.Helper()
	q := e.b.tenants.Queue
	for q.Len() > 0 {
		item, _ := q.Get()
		require.NoError(t, e.b.revoker().Revoke(context.Background(), item))
		q.Done(item)
	}
}

func (e *raceEnv) leases(t *testing.T, ns string) []corev1.Secret {
	t.Helper()
	l, err := e.client.CoreV1().Secrets(ns).List(context.Background(), metav1.ListOptions{LabelSelector: labels.Set{objects.LabelKind: objects.LeaseKind}.String()})
	require.NoError(t, err)
	return l.Items
}

func (e *raceEnv) request(c Caller, ns string) (*apiv1.KubeconfigResponse, error) {
	return e.b.IssueKubeconfig(context.Background(), c, apiv1.KubeconfigRequest{Namespace: ns, ServiceAccount: "gitops-reconciler"})
}

func TestAnIssuanceRacingItsNamespaceOutOfTheGrantIsRefusedAndLeavesNoLease(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		caller Caller
		pool   bool
		// verb is the Secret call before which the namespace leaves the
		// grant and the revocation runs: the lease's create, or a pooled
		// Secret's claim.
		verb    string
		refused bool
		// reload: a policy reload removes the grant, instead of the
		// namespace losing its label.
		reload bool
	}{
		{"a revocation that listed the namespace before the lease Secret was created does not leave the lease alive", west, false, "create", true, false},
		{"a revocation that listed the namespace while a pooled Secret's claim was in flight does not leave the lease alive", west, true, "patch", true, false},
		{"a reload that removed the grant before the lease Secret was created does not leave the lease alive", west, false, "create", true, true},
		{"a grant with revokeOnUnmatch false keeps the lease, as one issued a moment earlier", north, false, "create", false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newRaceEnv(t, tenantPolicy, map[string]map[string]string{"oil-dev": oil}, tt.pool)
			ctx := context.Background()
			if tt.pool {
				// A first issuance asks for a pool in the namespace.
				_, err := e.request(tt.caller, "oil-dev")
				require.NoError(t, err)
				e.clock.Step(lease.PoolQuiet)
				e.b.poolKeeper().Tend(ctx)
			}
			var fired atomic.Bool
			e.setHook(func(verb, ns, _ string) {
				if verb != tt.verb || ns != "oil-dev" || !fired.CompareAndSwap(false, true) {
					return
				}
				// The label (or the grant) goes, and the revocation it
				// queues runs to the end, all between the decision and the
				// lease.
				if tt.reload {
					e.store.Store(mustPolicy(t, strings.Replace(tenantPolicy, "      - name: oil\n", "      - name: oil-renamed\n", 1)))
				} else {
					e.nss.set("oil-dev", nil)
				}
				e.runQueue(t)
			})
			resp, err := e.request(tt.caller, "oil-dev")
			require.True(t, fired.Load(), "the interleaving was forced")
			e.runQueue(t)
			if !tt.refused {
				require.NoError(t, err)
				require.Len(t, e.leases(t, "oil-dev"), 1)
				return
			}
			require.Equal(t, problem.KindForbidden, problem.KindOf(err), "answered as any request there is now")
			require.Nil(t, resp)
			require.Empty(t, e.leases(t, "oil-dev"), "the lease, and the credential bound to it, are gone")
			evs := e.audit.all()
			last := evs[len(evs)-1]
			require.Equal(t, audit.ActionIssue, last.Action)
			require.Equal(t, audit.DecisionDeny, last.Decision)
			require.Contains(t, last.Reason, "unmatched_during_issue")
		})
	}
}

// stepToRecheck moves the clock to the end of uncoveredRecheck and, if
// a revocation is due (queued), carries it out.
func (e *raceEnv) stepToRecheck(t *testing.T, queued bool) {
	t.Helper()
	e.clock.Step(tenants.UncoveredRecheck)
	if queued {
		require.Eventually(t, func() bool { return e.b.tenants.Queue.Len() > 0 }, 5*time.Second, time.Millisecond)
	}
	e.runQueue(t)
}

// leftLease creates a lease of grant "oil" of peer west in ns, as one
// issued before the broker stopped.
func (e *raceEnv) leftLease(t *testing.T, ns, id string, mark *string) {
	t.Helper()
	s := e.b.leaseSecret(id, west, policy.Decision{Peer: "west", Credential: apiv1.CredentialToken, Grant: "oil"},
		apiv1.KubeconfigRequest{Namespace: ns, ServiceAccount: "gitops-reconciler"}, e.clock.Now().Add(time.Hour))
	if mark != nil {
		s.Annotations["tokenbroker.io/revoke-on-unmatch"] = *mark
	}
	_, err := e.client.CoreV1().Secrets(ns).Create(context.Background(), s, metav1.CreateOptions{})
	require.NoError(t, err)
}

func TestAGCPassRevokesLeasesTheirGrantNoLongerCovers(t *testing.T) {
	t.Parallel()
	withoutOil := strings.Replace(tenantPolicy, "      - name: oil\n", "      - name: oil-renamed\n", 1)
	tests := []struct {
		name, policy string
		labels       map[string]string
		mark         *string
		// back: the namespace matches again before the recheck, as a
		// namespace cache a moment behind another replica's would see it.
		back    bool
		revoked bool
	}{
		{"a lease in a namespace relabelled while no broker ran is revoked", tenantPolicy, nil, strPtr("0s"), false, true},
		{"a lease issued before leases were marked is revoked once its namespace left", tenantPolicy, nil, nil, false, true},
		{"a lease of a grant removed while no broker ran is revoked", withoutOil, oil, strPtr("0s"), false, true},
		{"a lease of a removed grant that recorded no mark is kept, as grants by name are", withoutOil, oil, nil, false, false},
		{"a lease its grant still covers is kept", tenantPolicy, oil, strPtr("0s"), false, false},
		{"a namespace that matches again by the recheck keeps its lease", tenantPolicy, nil, strPtr("0s"), true, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newRaceEnv(t, tt.policy, map[string]map[string]string{"oil-dev": tt.labels}, false)
			s := e.b.leaseSecret("aaaaaaaaaaaaaaaaaaaaaaaaaa", west, policy.Decision{Peer: "west", Credential: apiv1.CredentialToken, Grant: "oil"},
				apiv1.KubeconfigRequest{Namespace: "oil-dev", ServiceAccount: "gitops-reconciler"}, e.clock.Now().Add(time.Hour))
			if tt.mark != nil {
				s.Annotations["tokenbroker.io/revoke-on-unmatch"] = *tt.mark
			}
			_, err := e.client.CoreV1().Secrets("oil-dev").Create(context.Background(), s, metav1.CreateOptions{})
			require.NoError(t, err)

			_, err = e.b.CollectGarbage(context.Background())
			require.NoError(t, err)
			e.runQueue(t)
			require.Len(t, e.leases(t, "oil-dev"), 1, "not before the recheck")
			if tt.back {
				e.nss.set("oil-dev", oil)
			}
			e.stepToRecheck(t, tt.revoked || tt.back)
			if !tt.revoked {
				require.Len(t, e.leases(t, "oil-dev"), 1)
				return
			}
			require.Empty(t, e.leases(t, "oil-dev"))
			require.NoError(t, testutil.CollectAndCompare(e.reg, strings.NewReader(`
# HELP tokenbroker_unmatched_revocations_total Leases revoked because their namespace stopped being covered by their selector grant, by reason (label_changed, namespace_deleted, policy_narrowed, found_at_start, found_by_gc).
# TYPE tokenbroker_unmatched_revocations_total counter
tokenbroker_unmatched_revocations_total{reason="found_by_gc"} 1
`), "tokenbroker_unmatched_revocations_total"))
		})
	}
}

func TestAGCPassKeepsTheRecordedRevokeDelayOfARemovedGrant(t *testing.T) {
	t.Parallel()
	withoutOil := strings.Replace(tenantPolicy, "      - name: oil\n", "      - name: oil-renamed\n", 1)
	e := newRaceEnv(t, withoutOil, map[string]map[string]string{"oil-dev": oil}, false)
	e.leftLease(t, "oil-dev", "aaaaaaaaaaaaaaaaaaaaaaaaaa", strPtr("30s"))
	_, err := e.b.CollectGarbage(context.Background())
	require.NoError(t, err)
	e.runQueue(t)
	require.Len(t, e.leases(t, "oil-dev"), 1, "not before the delay")
	e.clock.Step(31 * time.Second)
	require.Eventually(t, func() bool { return e.b.tenants.Queue.Len() == 1 }, 5*time.Second, time.Millisecond)
	e.runQueue(t)
	require.Empty(t, e.leases(t, "oil-dev"))
}

func TestAGCPassJudgesNothingBeforeTheNamespaceCacheHasSynced(t *testing.T) {
	t.Parallel()
	e := newRaceEnv(t, tenantPolicy, map[string]map[string]string{"oil-dev": oil}, false)
	e.leftLease(t, "oil-dev", "aaaaaaaaaaaaaaaaaaaaaaaaaa", strPtr("0s"))
	e.nss.mu.Lock()
	e.nss.synced = false
	e.nss.store = cache.NewStore(cache.MetaNamespaceKeyFunc) // an empty cache covers nothing
	e.nss.mu.Unlock()
	_, err := e.b.CollectGarbage(context.Background())
	require.NoError(t, err)
	e.stepToRecheck(t, false)
	require.Zero(t, e.b.tenants.Queue.Len())
	require.Len(t, e.leases(t, "oil-dev"), 1)
}

func strPtr(s string) *string { return &s }

// TestAStaleReplicaRevokesOnlyWhatItCanJudge: a replica whose policy is
// older than a lease, or whose namespace cache lags the API server, must
// not revoke a lease another replica issued rightly.
func TestAStaleReplicaRevokesOnlyWhatItCanJudge(t *testing.T) {
	t.Parallel()
	withoutOil := strings.Replace(tenantPolicy, "      - name: oil\n", "      - name: oil-renamed\n", 1)
	withoutWest := strings.Replace(tenantPolicy, "  - name: west\n", "  - name: west-renamed\n", 1)
	tests := []struct {
		name, policy string
		// created is the lease's creation time relative to when the
		// replica took its policy.
		created time.Duration
		// cached are the namespace's labels in this replica's cache; live,
		// if exists, on the API server.
		cached, live map[string]string
		exists       bool
		revoked      bool
	}{
		{name: "a lease of a grant the replica's policy lacks, issued after that policy was taken, is kept",
			policy: withoutOil, created: time.Minute, cached: oil, live: oil, exists: true},
		{name: "a lease of a grant the replica's policy lacks, issued before that policy was taken, is revoked",
			policy: withoutOil, created: -time.Hour, cached: oil, live: oil, exists: true, revoked: true},
		{name: "a lease of a peer the replica's policy lacks, issued after that policy was taken, is kept",
			policy: withoutWest, created: time.Minute, cached: oil, live: oil, exists: true},
		{name: "a lease of a peer the replica's policy lacks, issued before that policy was taken, is revoked",
			policy: withoutWest, created: -time.Hour, cached: oil, live: oil, exists: true, revoked: true},
		{name: "a namespace the lagging cache has out of the grant but the API server has in it keeps its lease",
			policy: tenantPolicy, created: -time.Hour, cached: nil, live: oil, exists: true},
		{name: "a namespace out of the grant on the API server too loses its lease",
			policy: tenantPolicy, created: -time.Hour, cached: nil, live: map[string]string{"capsule.clastix.io/tenant": "gas"}, exists: true, revoked: true},
		{name: "a namespace the API server no longer has loses its lease",
			policy: tenantPolicy, created: -time.Hour, cached: nil, revoked: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			e := newRaceEnv(t, tt.policy, map[string]map[string]string{"oil-dev": tt.cached}, false)
			e.b.tenants.Live = e.client.CoreV1()
			if tt.exists {
				_, err := e.client.CoreV1().Namespaces().Create(context.Background(),
					&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "oil-dev", Labels: tt.live}}, metav1.CreateOptions{})
				require.NoError(t, err)
			}
			s := e.b.leaseSecret("aaaaaaaaaaaaaaaaaaaaaaaaaa", west, policy.Decision{Peer: "west", Credential: apiv1.CredentialToken, Grant: "oil"},
				apiv1.KubeconfigRequest{Namespace: "oil-dev", ServiceAccount: "gitops-reconciler"}, e.clock.Now().Add(2*time.Hour))
			s.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
			s.CreationTimestamp = metav1.NewTime(e.clock.Now().Add(tt.created))
			_, err := e.client.CoreV1().Secrets("oil-dev").Create(context.Background(), s, metav1.CreateOptions{})
			require.NoError(t, err)

			_, err = e.b.CollectGarbage(context.Background())
			require.NoError(t, err)
			e.runQueue(t)
			require.Len(t, e.leases(t, "oil-dev"), 1, "not before the recheck")
			e.stepToRecheck(t, true)
			if tt.revoked {
				require.Empty(t, e.leases(t, "oil-dev"))
				return
			}
			require.Len(t, e.leases(t, "oil-dev"), 1)
		})
	}
}

func TestALeaseIssuedBeforeTheReloadThatRemovedItsGrantIsRevoked(t *testing.T) {
	t.Parallel()
	withoutOil := strings.Replace(tenantPolicy, "      - name: oil\n", "      - name: oil-renamed\n", 1)
	e := newRaceEnv(t, tenantPolicy, map[string]map[string]string{"oil-dev": oil}, false)
	e.clock.Step(time.Minute)
	s := e.b.leaseSecret("aaaaaaaaaaaaaaaaaaaaaaaaaa", west, policy.Decision{Peer: "west", Credential: apiv1.CredentialToken, Grant: "oil"},
		apiv1.KubeconfigRequest{Namespace: "oil-dev", ServiceAccount: "gitops-reconciler"}, e.clock.Now().Add(2*time.Hour))
	s.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
	s.CreationTimestamp = metav1.NewTime(e.clock.Now())
	_, err := e.client.CoreV1().Secrets("oil-dev").Create(context.Background(), s, metav1.CreateOptions{})
	require.NoError(t, err)

	e.clock.Step(time.Minute)
	e.store.Store(mustPolicy(t, withoutOil))
	_, err = e.b.CollectGarbage(context.Background())
	require.NoError(t, err)
	e.stepToRecheck(t, true)
	require.Empty(t, e.leases(t, "oil-dev"), "the reload is newer than the lease: this replica judges it")
}
