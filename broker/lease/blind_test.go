package lease

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	metadatafake "k8s.io/client-go/metadata/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// fakeSecretsClient is a fake metadata client that serves objs as
// Secrets.
func fakeSecretsClient(t *testing.T, objs ...runtime.Object) *metadatafake.FakeMetadataClient {
	t.Helper()
	scheme := metadatafake.NewTestScheme()
	require.NoError(t, metav1.AddMetaToScheme(scheme))
	scheme.AddKnownTypeWithName(corev1.SchemeGroupVersion.WithKind("Secret"), &metav1.PartialObjectMetadata{})
	scheme.AddKnownTypeWithName(corev1.SchemeGroupVersion.WithKind("SecretList"), &metav1.PartialObjectMetadataList{})
	return metadatafake.NewSimpleMetadataClient(scheme, objs...)
}

// storedLease is heldLease as the API server stores it, in namespace.
func storedLease(namespace string, uid types.UID, expires time.Time) *metav1.PartialObjectMetadata {
	m := heldLease(uid, expires)
	m.Namespace = namespace
	m.TypeMeta = metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"}
	m.Labels[objects.LabelManagedBy] = objects.ManagedByValue
	return m
}

// watches are the watches the test hands the counter's reflectors, by
// namespace; while a namespace is cut, its watch is refused.
type watches struct {
	mu   sync.Mutex
	open map[string]*watch.RaceFreeFakeWatcher
	cut  map[string]bool
}

func (w *watches) react(a k8stesting.Action) (bool, watch.Interface, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.cut[a.GetNamespace()] {
		return true, nil, errors.New("connection refused")
	}
	fw := watch.NewRaceFreeFake()
	w.open[a.GetNamespace()] = fw
	return true, fw, nil
}

// breakWatch ends namespace's open watch and refuses the next ones.
func (w *watches) breakWatch(namespace string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.cut[namespace] = true
	w.open[namespace].Stop()
}

func (w *watches) mend(namespace string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.cut[namespace] = false
}

// The counter is blind to a namespace only once its watch has been closed
// longer than BlindAfter, and sees again as soon as a watch is open; a
// broken watch of one namespace blinds no other.
func TestTheCounterIsBlindWhileAWatchIsClosedPastTheBound(t *testing.T) {
	t.Parallel()
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	clk := clocktesting.NewFakePassiveClock(start)
	client := fakeSecretsClient(t, storedLease("argo", "uid-1", start.Add(time.Hour)))
	ws := &watches{open: map[string]*watch.RaceFreeFakeWatcher{}, cut: map[string]bool{}}
	client.PrependWatchReactor("secrets", ws.react)
	lc := NewCounter(client, clk, zap.NewNop())
	t.Cleanup(lc.stopWatches)
	require.False(t, lc.Blind("argo", start.Add(time.Hour)), "a counter that watches nothing holds nothing, and is not blind")

	lc.watch([]string{"argo", "flux"})
	open := func(ns string) bool {
		lc.mu.Lock()
		defer lc.mu.Unlock()
		return lc.watches[ns].open
	}
	require.Eventually(t, func() bool { return lc.Synced() && open("argo") && open("flux") }, 30*time.Second, time.Millisecond)
	require.False(t, lc.Blind("argo", start.Add(time.Hour)), "an open watch that has listed sees, however long it has been open")

	cut := start.Add(time.Minute)
	clk.SetTime(cut)
	ws.breakWatch("argo")
	require.Eventually(t, func() bool { return !open("argo") }, 30*time.Second, time.Millisecond)
	require.False(t, lc.Blind("argo", cut.Add(BlindAfter)), "a watch closed for BlindAfter may be re-opening")
	require.True(t, lc.Blind("argo", cut.Add(BlindAfter+time.Millisecond)))
	require.False(t, lc.Blind("flux", cut.Add(time.Hour)), "flux's watch is open")
	_, ok := lc.Holds("argo", "tokenbroker-lease-a", "uid-1", westID, cut.Add(BlindAfter+time.Millisecond))
	require.True(t, ok, "the memory still holds it: Blind is what tells the gateway not to trust it")

	ws.mend("argo")
	require.Eventually(t, func() bool { return open("argo") }, 30*time.Second, time.Millisecond, "the reflector watches again after its backoff")
	require.False(t, lc.Blind("argo", cut.Add(time.Hour)))
}

// A namespace whose first list has not come back is blind once the
// watch has been started longer than BlindAfter.
func TestANamespaceNeverListedIsBlindPastTheBound(t *testing.T) {
	t.Parallel()
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	client := fakeSecretsClient(t)
	client.PrependReactor("list", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("connection refused")
	})
	lc := NewCounter(client, clocktesting.NewFakePassiveClock(start), zap.NewNop())
	t.Cleanup(lc.stopWatches)
	lc.watch([]string{"argo"})
	require.False(t, lc.Blind("argo", start.Add(BlindAfter)))
	require.True(t, lc.Blind("argo", start.Add(BlindAfter+time.Millisecond)))
	require.False(t, lc.Synced())
}

// Recheck applies Holds' checks to what the API server has now.
func TestRecheckAnswersFromTheAPIServerAsHoldsDoes(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	exp := now.Add(time.Hour)
	rules := &Rules{Peers: map[string]PeerRule{"west": {Identity: westID, Namespaces: map[string]struct{}{"argo": {}, "oil": {}}}}}
	deleting := storedLease("argo", "uid-del", exp)
	deleting.Name = "tokenbroker-lease-del"
	deleting.DeletionTimestamp = &metav1.Time{Time: now}
	deleting.Finalizers = []string{"tenant.example/keep"}
	pooled := storedLease("argo", "uid-pool", exp)
	pooled.Name = "tokenbroker-lease-pool"
	pooled.Labels[objects.LabelKind] = objects.PoolKind
	noExpiry := storedLease("argo", "uid-noexp", exp)
	noExpiry.Name = "tokenbroker-lease-noexp"
	delete(noExpiry.Annotations, objects.AnnotationExpiresAt)
	ungranted := storedLease("tenant", "uid-1", exp)
	client := fakeSecretsClient(t, storedLease("argo", "uid-1", exp), deleting, pooled, noExpiry, ungranted)
	lc := NewCounter(client, clocktesting.NewFakePassiveClock(now), zap.NewNop())
	lc.SetRules(func() *Rules { return rules })
	ctx := context.Background()

	for _, tc := range []struct {
		name, namespace, secret string
		uid                     types.UID
		identity                string
		at                      time.Time
		ok                      bool
	}{
		{"A live lease of the certificate's peer is live until its expiry.", "argo", "tokenbroker-lease-a", "uid-1", westID, now, true},
		{"Not at its expiry.", "argo", "tokenbroker-lease-a", "uid-1", westID, exp, false},
		{"A certificate of another peer holds nothing.", "argo", "tokenbroker-lease-a", "uid-1", "spiffe://oc.example/cluster/east", now, false},
		{"Another UID is another Secret.", "argo", "tokenbroker-lease-a", "uid-2", westID, now, false},
		{"A lease being deleted is gone.", "argo", "tokenbroker-lease-del", "uid-del", westID, now, false},
		{"A pooled Secret is no lease.", "argo", "tokenbroker-lease-pool", "uid-pool", westID, now, false},
		{"A lease without a readable expiry is not held.", "argo", "tokenbroker-lease-noexp", "uid-noexp", westID, now, false},
		{"A lease in a namespace the policy does not grant is not held.", "tenant", "tokenbroker-lease-a", "uid-1", westID, now, false},
		{"A Secret the API server does not have is gone.", "oil", "tokenbroker-lease-a", "uid-1", westID, now, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok, err := lc.Recheck(ctx, tc.namespace, tc.secret, tc.uid, tc.identity, tc.at)
			require.NoError(t, err)
			require.Equal(t, tc.ok, ok)
			if ok {
				require.Equal(t, exp, got)
			}
		})
	}
}

// Recheck only reads: an error of the API server says nothing, and a
// lease it no longer has is left to the watch, which ends its connections
// when it is back (ending them from here would close the asking request's
// own connection before its answer).
func TestRecheckOnlyReads(t *testing.T) {
	t.Parallel()
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	client := fakeSecretsClient(t)
	var fail bool
	var mu sync.Mutex
	client.PrependReactor("list", "secrets", func(k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		if fail {
			return true, nil, errors.New("connection refused")
		}
		return false, nil, nil
	})
	lc := NewCounter(client, clocktesting.NewFakePassiveClock(now), zap.NewNop())
	g := &goneRecorder{}
	lc.OnGone(g.record)
	lc.Observe(heldLease("uid-1", now.Add(time.Hour))) // deleted while the counter was blind

	mu.Lock()
	fail = true
	mu.Unlock()
	_, ok, err := lc.Recheck(context.Background(), "argo", "tokenbroker-lease-a", "uid-1", westID, now)
	require.Error(t, err)
	require.False(t, ok)

	mu.Lock()
	fail = false
	mu.Unlock()
	_, ok, err = lc.Recheck(context.Background(), "argo", "tokenbroker-lease-a", "uid-1", westID, now)
	require.NoError(t, err)
	require.False(t, ok, "the API server has no such Secret")
	require.Empty(t, g.gone)
}

// With streaming lists (client-go's WatchListClient) a relist is a watch
// whose initial events reach the counter only at their Replace: until
// then the memory is the old one, and an open watch does not make it
// current.
func TestAStreamingRelistSeesOnlyOnceItsInitialEventsAreIn(t *testing.T) {
	t.Parallel()
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	clk := clocktesting.NewFakePassiveClock(start)
	lc := NewCounter(nil, clk, zap.NewNop())
	w := &nsWatch{stop: make(chan struct{}), since: start}
	lc.watches["argo"] = w
	store := &counterStore{lc: lc, ns: "argo", w: w}

	first := lc.tracked(w, watch.NewRaceFreeFake(), true)
	require.True(t, lc.Blind("argo", start.Add(BlindAfter+time.Millisecond)), "open, but its initial list is not in")
	clk.SetTime(start.Add(time.Minute))
	require.NoError(t, store.Replace(nil, ""))
	require.False(t, lc.Blind("argo", start.Add(time.Hour)), "caught up: it sees for as long as the watch is open")

	closedAt := start.Add(2 * time.Minute)
	clk.SetTime(closedAt)
	first.Stop()
	require.Eventually(t, func() bool { return lc.Blind("argo", closedAt.Add(BlindAfter+time.Millisecond)) }, 10*time.Second, time.Millisecond)
	require.False(t, lc.Blind("argo", closedAt.Add(BlindAfter)))

	// The relist streams for longer than the bound: blind from the
	// close, however open its watch.
	second := lc.tracked(w, watch.NewRaceFreeFake(), true)
	defer second.Stop()
	require.True(t, lc.Blind("argo", closedAt.Add(BlindAfter+time.Millisecond)))
	clk.SetTime(closedAt.Add(10 * time.Second))
	require.NoError(t, store.Replace(nil, ""))
	require.False(t, lc.Blind("argo", closedAt.Add(time.Hour)))
}
