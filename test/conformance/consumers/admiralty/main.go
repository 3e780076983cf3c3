// Command admiralty loads a Target's kubeconfigSecret as Admiralty v0.17.0
// does, and lists ConfigMaps with the client it gets; with --watch it runs
// a client-go informer with it instead (check.InformerWatch).
//
// Admiralty's module cannot be required (the Go module proxy does not
// serve admiralty.io/multicluster-scheduler), so this mirrors exactly one
// upstream function: getConfigFromKubeconfigSecretOrDie in
// pkg/config/agent/agent.go at tag v0.17.0 of
// github.com/admiraltyio/admiralty, which addTarget and addClusterTarget
// call with the Target's spec.kubeconfigSecret {name, key, context}. Only
// the function's body is mirrored, with the client-go release Admiralty
// v0.17.0 pins; nothing else of Admiralty's is.
package main

import (
	"context"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/tokenbroker/tokenbroker/test/conformance/consumers/check"
)

// main lists with the REST config Admiralty's loader made and, in watch
// mode, runs a client-go informer of ConfigMaps on it, as Admiralty's
// controllers watch their targets.
func main() { check.Loaded("admiralty", load) }

// load turns the Secret into a REST config as addTarget does.
func load(ctx context.Context, a check.Args) (*rest.Config, error) {
	k, err := check.SourceClient(a)
	if err != nil {
		return nil, err
	}
	// A Target's kubeconfigSecret has no context: the current one is used.
	cfg, err := getConfigFromKubeconfigSecretOrDie(ctx, k, a.Namespace, a.Name, a.Key, "")
	if err != nil {
		return nil, check.ErrRefused{Err: err}
	}
	return cfg, nil
}

// getConfigFromKubeconfigSecretOrDie mirrors Admiralty v0.17.0's function
// of that name (pkg/config/agent/agent.go), statement for statement.
func getConfigFromKubeconfigSecretOrDie(ctx context.Context, k *kubernetes.Clientset, namespace, name, key, context string) (*rest.Config, error) {
	if key == "" {
		key = "config"
	}

	s, err := k.CoreV1().Secrets(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}

	cfg0, err := clientcmd.Load(s.Data[key])
	if err != nil {
		return nil, err
	}

	cfg1 := clientcmd.NewDefaultClientConfig(*cfg0, &clientcmd.ConfigOverrides{CurrentContext: context})

	cfg2, err := cfg1.ClientConfig()
	if err != nil {
		return nil, err
	}

	return cfg2, nil
}
