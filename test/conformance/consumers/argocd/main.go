// Command argocd loads an Argo CD cluster Secret with Argo CD's own code
// (github.com/argoproj/argo-cd/v3 v3.2.12): util/db.SecretToCluster, the
// function the application controller and the API server use to read a
// declarative cluster Secret, then Cluster.RESTConfig(). It lists
// ConfigMaps with the REST config it got and prints a check.Result with
// what Argo CD read besides the credential (name, project, namespaces,
// clusterResources, shard, serverName, proxyUrl).
//
// With --watch it syncs the application controller's cluster cache
// (gitops-engine's pkg/cache, the release Argo CD v3.2.12 requires) with
// that REST config and the options controller/cache builds it with, and
// reports the ConfigMaps it holds and the watch events it gets
// (check.WithWatch).
package main

import (
	"context"
	"fmt"
	"time"

	clustercache "github.com/argoproj/gitops-engine/pkg/cache"
	"github.com/argoproj/gitops-engine/pkg/utils/kube"
	"golang.org/x/sync/semaphore"
	"k8s.io/client-go/rest"

	appv1 "github.com/argoproj/argo-cd/v3/pkg/apis/application/v1alpha1"
	"github.com/argoproj/argo-cd/v3/util/db"

	"github.com/tokenbroker/tokenbroker/test/conformance/consumers/check"
)

func main() { check.Main("argocd", run, check.WithWatch(watch)) }

// load reads the Secret as the controller and the API server do, and
// makes the REST config the controller's cluster cache uses.
func load(ctx context.Context, a check.Args) (*appv1.Cluster, *rest.Config, error) {
	secret, err := check.SourceSecret(ctx, a)
	if err != nil {
		return nil, nil, err
	}
	cluster, err := db.SecretToCluster(secret)
	if err != nil {
		return nil, nil, check.ErrRefused{Err: err}
	}
	cfg, err := cluster.RESTConfig()
	if err != nil {
		return nil, nil, check.ErrRefused{Err: err}
	}
	return cluster, cfg, nil
}

// watch syncs the cluster cache as the application controller's
// liveStateCache.getCluster (controller/cache/cache.go, v3.2.12) makes
// it: its list semaphore, page size, buffer and resync durations at their
// defaults, batch event processing on (its default), the Secret's
// namespaces and clusterResources, and respectRBAC "normal" (the
// argocd-cm setting resource.respectRBAC, without which a ServiceAccount
// confined to namespaces fails the sync at the first resource it may not
// list). Not built: the resource-tracking handlers and the argocd-cm
// resource exclusions.
func watch(ctx context.Context, a check.Args, w *check.Watcher) error {
	cluster, cfg, err := load(ctx, a)
	if err != nil {
		return err
	}
	w.Observe(cfg)
	cc := clustercache.NewClusterCache(cfg,
		clustercache.SetListSemaphore(semaphore.NewWeighted(50)),
		clustercache.SetListPageSize(500),
		clustercache.SetListPageBufferSize(1),
		clustercache.SetWatchResyncTimeout(10*time.Minute),
		clustercache.SetClusterSyncRetryTimeout(10*time.Second),
		clustercache.SetResyncTimeout(12*time.Hour),
		clustercache.SetNamespaces(cluster.Namespaces),
		clustercache.SetClusterResources(cluster.ClusterResources),
		clustercache.SetRetryOptions(1, false, clustercache.ListRetryFuncNever),
		clustercache.SetRespectRBAC(clustercache.RespectRbacNormal),
		clustercache.SetBatchEventsProcessing(true),
		clustercache.SetEventProcessingInterval(100*time.Millisecond),
	)
	if err := cc.EnsureSynced(); err != nil {
		return fmt.Errorf("sync the cluster cache: %w", err)
	}
	isConfigMap := func(r *clustercache.Resource) bool { return r.Ref.APIVersion == "v1" && r.Ref.Kind == "ConfigMap" }
	cc.OnResourceUpdated(func(newRes, oldRes *clustercache.Resource, _ map[kube.ResourceKey]*clustercache.Resource) {
		if oldRes == nil && newRes != nil && isConfigMap(newRes) {
			w.Added(newRes.Ref.Name)
		}
	})
	var names []string
	for _, r := range cc.FindResources(a.ListNamespace, isConfigMap) {
		names = append(names, r.Ref.Name)
	}
	w.Synced(cfg.Host, names)
	return nil
}

func run(ctx context.Context, a check.Args) (*check.Result, error) {
	cluster, cfg, err := load(ctx, a)
	if err != nil {
		return nil, err
	}
	r, err := check.ListWith(ctx, cfg, a)
	if err != nil {
		return nil, err
	}
	r.Cluster = map[string]any{
		"name":             cluster.Name,
		"server":           cluster.Server,
		"project":          cluster.Project,
		"namespaces":       cluster.Namespaces,
		"clusterResources": cluster.ClusterResources,
		"serverName":       cluster.Config.ServerName,
		"proxyUrl":         cluster.Config.ProxyUrl,
		"hasBearerToken":   cluster.Config.BearerToken != "",
		"hasCAData":        len(cluster.Config.CAData) > 0,
		"insecure":         cluster.Config.Insecure,
	}
	if cluster.Shard != nil {
		r.Cluster["shard"] = *cluster.Shard
	}
	return r, nil
}
