package main

import (
	"fmt"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// restConfig loads a Kubernetes client configuration with kubectl's rules,
// the same for every command: the file named by --kubeconfig, else
// $KUBECONFIG, else ~/.kube/config, else the in-cluster configuration (a
// pod's ServiceAccount); in the given context, or the current one.
func restConfig(kubeconfig, context string) (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: context}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("load Kubernetes client config: %w", err)
	}
	rc.UserAgent = "tokenbroker/" + version
	return rc, nil
}
