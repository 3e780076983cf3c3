// Command flux loads a kubeConfig Secret with Flux's own code
// (github.com/fluxcd/pkg/runtime v0.110.3, client.NewImpersonator with
// WithKubeConfig and WithServiceAccount, then GetClient), as
// kustomize-controller v1.9.6 does for spec.kubeConfig.secretRef: the
// Secret is read from the source cluster by a controller-runtime client,
// its key chosen as Flux chooses it (secretRef.key, else value, else
// value.yaml), the kubeconfig checked by Flux's ValidateKubeConfig and
// sanitised by KubeConfig. It lists ConfigMaps with the client it got.
package main

import (
	"context"
	"fmt"

	"github.com/fluxcd/pkg/apis/meta"
	runtimeclient "github.com/fluxcd/pkg/runtime/client"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/clientcmd"
	rc "sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/tokenbroker/tokenbroker/test/conformance/consumers/check"
)

func main() { check.Main("flux", run) }

func run(ctx context.Context, a check.Args) (*check.Result, error) {
	source, err := clientcmd.BuildConfigFromFlags("", a.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("source cluster: %w", err)
	}
	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	sc, err := rc.New(source, rc.Options{Scheme: scheme})
	if err != nil {
		return nil, fmt.Errorf("source cluster: %w", err)
	}
	// What kustomize-controller passes: the object's kubeConfig, its own
	// KubeConfigOptions (exec and insecure TLS off, the defaults of its
	// flags), and the object's namespace, which is the Secret's (a
	// secretRef is local) for both the Secret and the ServiceAccount it
	// impersonates on the target.
	ref := &meta.KubeConfigReference{SecretRef: &meta.SecretKeyReference{Name: a.Name, Key: a.Key}}
	imp := runtimeclient.NewImpersonator(sc,
		runtimeclient.WithScheme(scheme),
		runtimeclient.WithServiceAccount("", a.ServiceAccount, a.Namespace),
		runtimeclient.WithKubeConfig(ref, runtimeclient.KubeConfigOptions{UserAgent: "kustomize-controller"}, a.Namespace, nil),
	)
	target, _, err := imp.GetClient(ctx)
	r := &check.Result{}
	if err != nil {
		// GetClient reads the Secret and makes the client; discovery
		// happens later, so an error here is Flux refusing the Secret.
		return nil, check.ErrRefused{Err: err}
	}
	var list corev1.ConfigMapList
	if err := target.List(ctx, &list, rc.InNamespace(a.ListNamespace)); err != nil {
		return r.Failed(err), nil
	}
	for _, cm := range list.Items {
		r.ConfigMaps = append(r.ConfigMaps, cm.Name)
	}
	r.Status = 200
	return r, nil
}
