// Command argocd loads an Argo CD cluster Secret with Argo CD's own code
// (github.com/argoproj/argo-cd/v3 v3.2.12): util/db.SecretToCluster, the
// function the application controller and the API server use to read a
// declarative cluster Secret, then Cluster.RESTConfig(). It lists
// ConfigMaps with the REST config it got and prints a check.Result with
// what Argo CD read besides the credential (name, project, namespaces,
// clusterResources, shard, serverName, proxyUrl).
package main

import (
	"context"

	"github.com/argoproj/argo-cd/v3/util/db"

	"github.com/tokenbroker/tokenbroker/test/conformance/consumers/check"
)

func main() { check.Main("argocd", run) }

func run(ctx context.Context, a check.Args) (*check.Result, error) {
	secret, err := check.SourceSecret(ctx, a)
	if err != nil {
		return nil, err
	}
	cluster, err := db.SecretToCluster(secret)
	if err != nil {
		return nil, check.ErrRefused{Err: err}
	}
	cfg, err := cluster.RESTConfig()
	if err != nil {
		return nil, check.ErrRefused{Err: err}
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
