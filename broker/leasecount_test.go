package broker

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
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
		m.Labels[objects.LabelManagedBy] = objects.ManagedByValue
		m.Annotations[objects.AnnotationGrant] = "oil"
		if marked {
			m.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
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

// TestWithoutAClusterWideListTheGCRevokesWhatTheCounterSaw: with
// per-namespace RBAC a full GC pass's cluster-wide list is forbidden; the
// leases the counter saw in a namespace that left its grant are revoked
// all the same.
func TestWithoutAClusterWideListTheGCRevokesWhatTheCounterSaw(t *testing.T) {
	t.Parallel()
	client := fake.NewClientset()
	client.PrependReactor("list", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetNamespace() == "" {
			return true, nil, apierrors.NewForbidden(corev1.Resource("secrets"), "", errors.New("no cluster-wide list"))
		}
		return false, nil, nil
	})
	nss := newFakeNamespaces()
	nss.set("oil-dev", nil) // left the grant
	nss.synced = true
	clk := clocktesting.NewFakeClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	lc := NewLeaseCounter(nil, clk, zap.NewNop())
	b, err := New(Config{Secrets: client.CoreV1(), Policy: policy.NewStore(mustPolicy(t, tenantPolicy)), Logger: zap.NewNop(),
		Clock: clk, Namespaces: nss, Leases: lc, Pool: PoolConfig{PerNamespace: -1}})
	require.NoError(t, err)
	t.Cleanup(b.tenants.queue.ShutDown)
	s := b.leaseSecret("aaaaaaaaaaaaaaaaaaaaaaaaaa", west, policy.Decision{Peer: "west", Credential: apiv1.CredentialToken, Grant: "oil"},
		apiv1.KubeconfigRequest{Namespace: "oil-dev", ServiceAccount: "gitops-reconciler"}, clk.Now().Add(time.Hour))
	s.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
	_, err = client.CoreV1().Secrets("oil-dev").Create(context.Background(), s, metav1.CreateOptions{})
	require.NoError(t, err)
	lc.add(&metav1.PartialObjectMetadata{ObjectMeta: s.ObjectMeta})

	_, err = b.CollectGarbage(context.Background()) // the first pass is a full one
	require.NoError(t, err)
	clk.Step(uncoveredRecheck)
	require.Eventually(t, func() bool { return b.tenants.queue.Len() > 0 }, 5*time.Second, time.Millisecond)
	for b.tenants.queue.Len() > 0 {
		item, _ := b.tenants.queue.Get()
		require.NoError(t, b.revokeUnmatched(context.Background(), item))
		b.tenants.queue.Done(item)
	}
	l, err := client.CoreV1().Secrets("oil-dev").List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	require.Empty(t, l.Items)
}
