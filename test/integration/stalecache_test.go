package integration

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// frozenNamespaces is a namespace cache that lags the API server for ever:
// it holds what it was given and never hears of a change.
type frozenNamespaces struct{ store cache.Store }

func (f frozenNamespaces) AddEventHandler(cache.ResourceEventHandler) (cache.ResourceEventHandlerRegistration, error) {
	return nil, nil
}
func (f frozenNamespaces) GetStore() cache.Store { return f.store }
func (f frozenNamespaces) HasSynced() bool       { return true }

// TestALaggingNamespaceCacheRevokesNothingTheAPIServerStillCovers: a
// replica whose namespace cache has a namespace out of a selector grant
// asks the API server before it revokes, and keeps the lease while the API
// server has the namespace in the grant; once the API server has it out
// too, the lease is revoked.
func TestALaggingNamespaceCacheRevokesNothingTheAPIServerStillCovers(t *testing.T) {
	c := testcluster.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tenantNamespace(t, c, "oil-dev", map[string]string{"tenant": "oil"})
	tenantNamespace(t, c, "oil-other", map[string]string{"tenant": "oil"}) // a namespace the live read must not take for oil-dev

	p, err := policy.Parse([]byte(`
cluster: {name: east, server: "https://east.example.com:6443", caData: x}
peers:
  - name: west
    identity: ` + identity(t, "west") + `
    grants:
      - name: oil
        namespaceSelector: {matchLabels: {tenant: oil}}
        serviceAccounts: [gitops]
`))
	require.NoError(t, err)
	stale := cache.NewStore(cache.MetaNamespaceKeyFunc)
	require.NoError(t, stale.Add(&metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{Name: "oil-dev"}})) // no tenant label
	b, err := broker.New(broker.Config{
		Secrets: c.Client.CoreV1(), Policy: policy.NewStore(p), Logger: zap.NewNop(),
		Namespaces: frozenNamespaces{store: stale}, LiveNamespaces: c.Client.CoreV1(),
	})
	require.NoError(t, err)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); b.RunTenants(ctx) }()
	defer wg.Wait()
	defer cancel()

	l := forgedLease("oil-dev", "stalecache0000000000000aaa", "west", identity(t, "west"), objects.SecretTypeLease, time.Now().Add(time.Hour))
	l.Labels[objects.LabelManagedBy] = objects.ManagedByValue
	l.Annotations[objects.AnnotationGrant] = "oil"
	l.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
	l.Annotations[objects.AnnotationSA] = "gitops"
	_, err = c.Client.CoreV1().Secrets("oil-dev").Create(ctx, l, metav1.CreateOptions{})
	require.NoError(t, err)
	present := func() bool {
		_, err := c.Client.CoreV1().Secrets("oil-dev").Get(ctx, l.Name, metav1.GetOptions{})
		return err == nil
	}

	// The GC finds the lease uncovered by the cache and queues its
	// revocation 5 s on; the API server still has oil-dev in the grant.
	_, err = b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Never(t, func() bool { return !present() }, 8*time.Second, 200*time.Millisecond, "revoked on the cache's word")

	_, err = c.Client.CoreV1().Namespaces().Patch(ctx, "oil-dev", types.MergePatchType, []byte(`{"metadata":{"labels":{"tenant":null}}}`), metav1.PatchOptions{})
	require.NoError(t, err)
	_, err = b.CollectGarbage(ctx)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return !present() }, 15*time.Second, 100*time.Millisecond, "the API server has it out of the grant too")
}
