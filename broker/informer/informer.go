// Package informer builds the informers by which the broker follows a few
// of its own objects: one kind in one namespace, narrowed by a selector,
// listed and watched through the narrowest typed client, with a failed
// watch reported and retried.
package informer

import (
	"context"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// ListWatcher is what an informer needs of a typed client of one
// namespace (corev1client.ConfigMapInterface, SecretInterface): L is the
// client's list type.
type ListWatcher[L runtime.Object] interface {
	List(ctx context.Context, opts metav1.ListOptions) (L, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// New returns an informer of the objects of obj's type that c lists and
// watches, every list and watch narrowed by narrow (which sets a label or
// field selector), so that it holds those objects and no others. A failed
// list or watch is retried with the informer's backoff and passed to
// onWatchError, unless the informer's run is over. The caller adds its
// handlers and runs it (RunWithContext).
func New[L runtime.Object](c ListWatcher[L], obj runtime.Object, narrow func(*metav1.ListOptions), onWatchError func(error)) cache.SharedIndexInformer {
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			narrow(&o)
			return c.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			narrow(&o)
			return c.Watch(ctx, o)
		},
	}
	inf := cache.NewSharedIndexInformerWithOptions(lw, obj, cache.SharedIndexInformerOptions{})
	_ = inf.SetWatchErrorHandlerWithContext(func(ctx context.Context, _ *cache.Reflector, err error) {
		if ctx.Err() == nil {
			onWatchError(err)
		}
	}) // fails only once the informer runs
	return inf
}
