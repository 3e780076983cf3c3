package broker

import (
	"context"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metadatafake "k8s.io/client-go/metadata/fake"
	clocktesting "k8s.io/utils/clock/testing"
)

// TestTheCounterKeepsWatchingANamespaceThatStillHoldsLeasesToRevoke: with
// per-namespace RBAC the counter is the GC's only sight of a namespace that
// left its selector grant; dropping its watch would forget the leases the GC
// is to revoke there.
func TestTheCounterKeepsWatchingANamespaceThatStillHoldsLeasesToRevoke(t *testing.T) {
	t.Parallel()
	exp := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	secret := func(ns, name string, marked bool) *metav1.PartialObjectMetadata {
		m := leaseMeta(ns, name, "west", exp)
		m.TypeMeta = metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"}
		m.Labels[LabelManagedBy] = ManagedByValue
		m.Annotations[AnnotationGrant] = "oil"
		if marked {
			m.Annotations[AnnotationRevokeOnUnmatch] = "0s"
		}
		return m
	}
	scheme := metadatafake.NewTestScheme()
	require.NoError(t, metav1.AddMetaToScheme(scheme))
	scheme.AddKnownTypeWithName(corev1.SchemeGroupVersion.WithKind("Secret"), &metav1.PartialObjectMetadata{})
	scheme.AddKnownTypeWithName(corev1.SchemeGroupVersion.WithKind("SecretList"), &metav1.PartialObjectMetadataList{})
	client := metadatafake.NewSimpleMetadataClient(scheme,
		secret("oil-dev", "tokenbroker-lease-a", true), secret("oil-old", "tokenbroker-lease-b", false), secret("argo", "tokenbroker-lease-c", false))
	lc := NewLeaseCounter(client, clocktesting.NewFakePassiveClock(exp.Add(-time.Hour)), zap.NewNop())
	t.Cleanup(lc.stopWatches)
	rules := func(namespaces ...string) *leaseRules {
		r := &leaseRules{peers: map[string]leasePeerRule{"west": {namespaces: map[string]struct{}{}}}}
		for _, ns := range namespaces {
			r.peers["west"].namespaces[ns] = struct{}{}
		}
		return r
	}
	var mu sync.Mutex
	current := rules("argo", "oil-dev", "oil-old")
	lc.setRules(func() *leaseRules { mu.Lock(); defer mu.Unlock(); return current })
	watching := func() []string {
		lc.mu.Lock()
		defer lc.mu.Unlock()
		return slices.Sorted(maps.Keys(lc.watches))
	}
	lc.watch([]string{"argo", "oil-dev", "oil-old"})
	require.Eventually(t, func() bool { own, _ := lc.Live("west"); return lc.Synced() && own == 3 }, 5*time.Second, time.Millisecond)

	// oil-dev and oil-old left the grant: the policy no longer grants
	// them, so their leases stop counting; the GC is still to revoke them.
	mu.Lock()
	current = rules("argo")
	mu.Unlock()
	lc.sweep()
	own, _ := lc.Live("west")
	require.Equal(t, 1, own, "leases in namespaces the policy no longer grants do not count")
	lc.watch([]string{"argo"})
	require.Equal(t, []string{"argo", "oil-dev"}, watching(), "the namespace with a marked lease is still watched")
	require.Contains(t, lc.leaseRefs(), leaseRef{namespace: "oil-dev", peer: "west", grant: "oil", mark: "0s", marked: true})

	require.NoError(t, client.Resource(secretsGVR).Namespace("oil-dev").Delete(context.Background(), "tokenbroker-lease-a", metav1.DeleteOptions{}))
	require.Eventually(t, func() bool {
		return !slices.ContainsFunc(lc.leaseRefs(), func(l leaseRef) bool { return l.namespace == "oil-dev" })
	}, 5*time.Second, time.Millisecond)
	lc.watch([]string{"argo"})
	require.Equal(t, []string{"argo"}, watching(), "once revoked, the namespace is dropped")
}
