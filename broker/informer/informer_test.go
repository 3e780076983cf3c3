package informer_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/tokenbroker/tokenbroker/broker/informer"
)

func configMap(name string, labels map[string]string) *corev1.ConfigMap {
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "broker", Name: name, Labels: labels}}
}

func TestAnInformerListsAndWatchesOnlyWhatItsSelectorNarrowsItTo(t *testing.T) {
	t.Parallel()
	cs := fake.NewClientset(configMap("ours", map[string]string{"tokenbroker.io/kind": "ours"}), configMap("other", nil))
	var mu sync.Mutex
	var lists, watches []string
	var failures []error
	cs.PrependReactor("list", "configmaps", func(a k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		lists = append(lists, a.(k8stesting.ListAction).GetListRestrictions().Labels.String())
		return false, nil, nil
	})
	cs.PrependWatchReactor("configmaps", func(a k8stesting.Action) (bool, watch.Interface, error) {
		mu.Lock()
		defer mu.Unlock()
		watches = append(watches, a.(k8stesting.WatchAction).GetWatchRestrictions().Labels.String())
		return false, nil, nil
	})
	inf := informer.New(cs.CoreV1().ConfigMaps("broker"), &corev1.ConfigMap{},
		func(o *metav1.ListOptions) { o.LabelSelector = "tokenbroker.io/kind=ours" },
		func(err error) {
			mu.Lock()
			defer mu.Unlock()
			failures = append(failures, err)
		})
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	go inf.RunWithContext(ctx)
	require.True(t, cache.WaitForCacheSync(ctx.Done(), inf.HasSynced))
	require.Equal(t, []string{"broker/ours"}, inf.GetStore().ListKeys())
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(watches) > 0
	}, 5*time.Second, 10*time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"tokenbroker.io/kind=ours"}, lists)
	require.Equal(t, []string{"tokenbroker.io/kind=ours"}, watches)
	require.Empty(t, failures)
}
