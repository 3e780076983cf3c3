// Command clusterprofile loads a ClusterProfile the tokenbroker agent
// wrote with cluster-inventory-api's own code, at the version Kueue
// v0.17.0 pins: credentials.NewFromFile reads a provider file whose
// "tokenbroker" provider runs the plugin, and BuildConfigFromCP turns the
// profile's access provider entry into a rest.Config, exactly as MultiKueue
// does. It lists ConfigMaps with the client it got. With --parallel N it
// builds N clients at once from N BuildConfigFromCP calls, each with its
// own client-go exec authenticator (as N controllers would), lists with
// each, and reports the first failure or the first success.
//
// The ClusterProfile is --namespace/--name in the --kubeconfig cluster;
// the provider file is $CLUSTERPROFILE_PROVIDER_FILE.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	"sigs.k8s.io/cluster-inventory-api/pkg/credentials"

	"github.com/tokenbroker/tokenbroker/test/conformance/consumers/check"
)

func main() { check.Main("clusterprofile", run) }

func run(ctx context.Context, a check.Args) (*check.Result, error) {
	providers, err := credentials.NewFromFile(os.Getenv("CLUSTERPROFILE_PROVIDER_FILE"))
	if err != nil {
		return nil, check.ErrRefused{Err: err}
	}
	source, err := clientcmd.BuildConfigFromFlags("", a.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("source cluster: %w", err)
	}
	dyn, err := dynamic.NewForConfig(source)
	if err != nil {
		return nil, err
	}
	gvr := v1alpha1.GroupVersion.WithResource("clusterprofiles")
	u, err := dyn.Resource(gvr).Namespace(a.Namespace).Get(ctx, a.Name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("read the ClusterProfile: %w", err)
	}
	var cp v1alpha1.ClusterProfile
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &cp); err != nil {
		return nil, fmt.Errorf("decode the ClusterProfile: %w", err)
	}
	n := 1
	if s := os.Getenv("CLUSTERPROFILE_PARALLEL"); s != "" {
		if n, err = strconv.Atoi(s); err != nil || n < 1 || n > 100 {
			return nil, errors.New("CLUSTERPROFILE_PARALLEL must be 1 to 100")
		}
	}
	results := make([]*check.Result, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			cfg, err := providers.BuildConfigFromCP(&cp)
			if err != nil {
				errs[i] = check.ErrRefused{Err: err}
				return
			}
			results[i], errs[i] = check.ListWith(ctx, cfg, a)
		})
	}
	wg.Wait()
	for i := range n {
		if errs[i] != nil {
			return nil, errs[i]
		}
		if results[i].Status != 200 {
			return results[i], nil
		}
	}
	return results[0], nil
}
