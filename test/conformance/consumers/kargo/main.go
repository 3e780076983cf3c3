// Command kargo loads a kubeconfig Secret as Kargo v1.11.2 does, and lists
// ConfigMaps with the client it gets; with --watch it runs a client-go
// informer with it instead (check.InformerWatch).
//
// Kargo's chart (charts/kargo/templates/{api,controller}/deployment.yaml
// at v1.11.2) projects only the key kubeconfig.yaml of the Secret named by
// kubeconfigSecrets.kargo into a file, and sets KUBECONFIG to it; Kargo
// then reads that file once, at start, with GetRestConfig. This command
// projects the key the same way (a missing key fails, as the kubelet's
// projection does) and calls the mirror of GetRestConfig.
//
// Kargo's module cannot be required (the Go module proxy does not serve
// github.com/akuity/kargo), so this mirrors exactly one upstream function:
// GetRestConfig in pkg/server/kubernetes/client.go at tag v1.11.2 of
// github.com/akuity/kargo, without its debug logging.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/tokenbroker/tokenbroker/test/conformance/consumers/check"
)

// chartKey is the only key Kargo's chart projects.
const chartKey = "kubeconfig.yaml"

// main lists with the REST config Kargo's loader made and, in watch
// mode, runs a client-go informer of ConfigMaps on it, as Kargo's
// controllers watch through controller-runtime.
func main() { check.Loaded("kargo", load) }

// load projects the Secret's key as the chart does and loads it as
// Kargo does at start.
func load(ctx context.Context, a check.Args) (*rest.Config, error) {
	secret, err := check.SourceSecret(ctx, a)
	if err != nil {
		return nil, err
	}
	data, ok := secret.Data[chartKey]
	if !ok {
		return nil, check.ErrRefused{Err: fmt.Errorf("the Secret has no key %q, the only one Kargo's chart mounts", chartKey)}
	}
	dir, err := os.MkdirTemp("", "kargo-kubeconfigs")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, chartKey)
	if err := os.WriteFile(path, data, 0o644); err != nil { // the chart's mode
		return nil, err
	}
	cfg, err := GetRestConfig(ctx, path)
	if err != nil {
		return nil, check.ErrRefused{Err: err}
	}
	return cfg, nil
}

// GetRestConfig mirrors Kargo v1.11.2's function of that name
// (pkg/server/kubernetes/client.go), less its debug logging.
func GetRestConfig(_ context.Context, path string) (*rest.Config, error) {
	if path == "" {
		cfg, err := rest.InClusterConfig()
		if err != nil {
			return cfg, fmt.Errorf("error loading in-cluster REST config: %w", err)
		}
		return cfg, nil
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return cfg, fmt.Errorf("error loading REST config from %q: %w", path, err)
	}
	return cfg, nil
}
