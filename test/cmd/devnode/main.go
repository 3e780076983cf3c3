// Command devnode is the demo of `make dev NODE=1`: the broker as a Pod
// from its chart, on the node of a local cluster. bin/localcluster --node
// starts the cluster (with make image's archive imported into the node)
// and runs it:
//
//	localcluster --controller-manager --node --import-image dist/image/tokenbroker-v0.1.0-linux-amd64.tar -- \
//	  devnode --dir .dev --image ghcr.io/tokenbroker/tokenbroker:v0.1.0
//
// It makes what `tokenbroker dev` makes (the dev PKI, the demo namespace,
// ServiceAccount and policy), installs the chart with hostNetwork (the
// local API server listens on loopback), waits for the Pod, starts a Pod
// to exec into, prints the commands that use it, and waits for Ctrl-C.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/tokenbroker/tokenbroker/server"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const (
	namespace = "tokenbroker"
	probePod  = "probe"
)

func main() {
	fs := flag.NewFlagSet("devnode", flag.ContinueOnError)
	dir := fs.String("dir", ".dev", "directory of the dev PKI, the policy and the kubeconfigs the printed commands write")
	image := fs.String("image", "", "the image reference make image tags (make image-ref), imported into the node (required)")
	chart := fs.String("chart", "deploy/helm/tokenbroker", "the broker's chart")
	helm := fs.String("helm", "bin/helm", "helm")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "Usage: devnode --image REF [flags]  (run by bin/localcluster --node; make dev NODE=1)")
		fs.PrintDefaults()
	}
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		os.Exit(2)
	}
	if *image == "" || !strings.Contains(*image, ":") {
		fmt.Fprintln(os.Stderr, "devnode: --image REPOSITORY:TAG is required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dir, *image, *chart, *helm); err != nil {
		fmt.Fprintln(os.Stderr, "devnode:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, dir, image, chart, helm string) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	kubeconfig := os.Getenv("KUBECONFIG")
	admin, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("KUBECONFIG (set by localcluster): %w", err)
	}
	client, err := kubernetes.NewForConfig(admin)
	if err != nil {
		return err
	}
	https, err := freePort()
	if err != nil {
		return err
	}
	ops, err := freePort()
	if err != nil {
		return err
	}
	api := net.JoinHostPort("127.0.0.1", strconv.Itoa(https))
	files, policyFile, err := server.PrepareDev(ctx, client, admin, dir, api)
	if err != nil {
		return err
	}
	if err := createObjects(ctx, client, files, policyFile); err != nil {
		return err
	}
	apiPort := admin.Host[strings.LastIndex(admin.Host, ":")+1:]
	values := fmt.Sprintf(`image: {repository: %s, tag: %s, pullPolicy: Never}
replicaCount: 1
hostNetwork: true
containerPorts: {https: %d, ops: %d}
pki: {tlsSecret: tokenbroker-tls}
existingPolicyConfigMap: tokenbroker-dev-policy
clientCertificates: {enabled: true, roles: [%s]}
extraEnv:
  - {name: KUBERNETES_SERVICE_HOST, value: 127.0.0.1}
  - {name: KUBERNETES_SERVICE_PORT, value: "%s"}
`, image[:strings.LastIndex(image, ":")], image[strings.LastIndex(image, ":")+1:], https, ops, server.DevRole, apiPort)
	valuesFile := filepath.Join(dir, "node-values.yaml")
	if err := os.WriteFile(valuesFile, []byte(values), 0o600); err != nil {
		return err
	}
	if err := command(ctx, helm, "upgrade", "--install", "tokenbroker", chart, "-n", namespace, "-f", valuesFile); err != nil {
		return err
	}
	// Not helm's --wait: it deems one hostNetwork replica ready at once.
	if err := command(ctx, "kubectl", "-n", namespace, "rollout", "status", "deployment/tokenbroker", "--timeout=120s"); err != nil {
		return err
	}
	if err := command(ctx, "kubectl", "-n", server.DevNamespace, "wait", "--for=condition=Ready", "--timeout=60s", "pod/"+probePod); err != nil {
		return err
	}
	printCommands(dir, files, api)
	<-ctx.Done()
	return nil
}

// createObjects makes the broker's namespace, its TLS Secret and policy
// ConfigMap (with the cluster CA the policy names), and the Pod to exec
// into with the Role that lets the demo ServiceAccount do so.
func createObjects(ctx context.Context, c kubernetes.Interface, f server.DevFiles, policyFile string) error {
	read := func(p string) ([]byte, error) { return os.ReadFile(p) }
	tlsData := map[string][]byte{}
	for key, p := range map[string]string{"tls.crt": f.ServerCert, "tls.key": f.ServerKey, "ca.crt": f.CACert} {
		b, err := read(p)
		if err != nil {
			return err
		}
		tlsData[key] = b
	}
	policy, err := read(policyFile)
	if err != nil {
		return err
	}
	clusterCA, err := read(filepath.Join(filepath.Dir(policyFile), "cluster-ca.crt"))
	if err != nil {
		return err
	}
	nonroot, yes := int64(65532), true
	objects := []func() error{
		func() error {
			_, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := c.CoreV1().Secrets(namespace).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-tls"}, Type: corev1.SecretTypeTLS, Data: tlsData}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := c.CoreV1().ConfigMaps(namespace).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-dev-policy"},
				Data: map[string]string{"policy.yaml": string(policy), "cluster-ca.crt": string(clusterCA)}}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := c.RbacV1().Roles(server.DevNamespace).Create(ctx, &rbacv1.Role{
				ObjectMeta: metav1.ObjectMeta{Name: "demo-exec"},
				Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods/exec", "pods/attach", "pods/portforward"}, Verbs: []string{"get", "create"}}},
			}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := c.RbacV1().RoleBindings(server.DevNamespace).Create(ctx, &rbacv1.RoleBinding{
				ObjectMeta: metav1.ObjectMeta{Name: "demo-exec"},
				RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "demo-exec"},
				Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: server.DevServiceAccount, Namespace: server.DevNamespace}},
			}, metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := c.CoreV1().Pods(server.DevNamespace).Create(ctx, &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: probePod},
				Spec: corev1.PodSpec{
					AutomountServiceAccountToken: new(bool),
					SecurityContext:              &corev1.PodSecurityContext{RunAsUser: &nonroot, RunAsNonRoot: &yes},
					Containers: []corev1.Container{{
						Name: "probe", Image: testcluster.NodeImageRef, ImagePullPolicy: corev1.PullNever,
						Args: []string{"serve", "127.0.0.1:8080"}, Stdin: true,
					}},
				},
			}, metav1.CreateOptions{})
			return err
		},
	}
	for _, create := range objects {
		if err := create(); err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
	}
	return nil
}

func printCommands(dir string, f server.DevFiles, api string) {
	kc := filepath.Join(dir, "kubeconfig")
	body := fmt.Sprintf(`{"namespace":"%s","serviceAccount":"%s","ttl":"1h"}`, server.DevNamespace, server.DevServiceAccount)
	fmt.Printf("\nThe broker runs as a Pod from its chart (kubectl -n %s get pods), on the node's network at https://%s.\n\n", namespace, api)
	fmt.Printf("Ask it for a kubeconfig (as the peer %q):\n\n", server.DevPeer)
	fmt.Printf("  curl -sS --fail-with-body --cert %s --key %s --cacert %s -H 'Content-Type: application/json' -H 'Accept: application/yaml' -d '%s' https://%s/v1/kubeconfigs -o %s\n\n",
		f.ClientCert, f.ClientKey, f.CACert, body, api, kc)
	fmt.Printf("Use it:\n\n  kubectl --kubeconfig %s get configmaps\n\n", kc)
	fmt.Printf("Exec into a Pod with it (a line you type comes back; revoke the lease and see that the session goes on, docs/security.md):\n\n")
	fmt.Printf("  kubectl --kubeconfig %s exec -i %s -- /nodeprobe cat\n\n", kc, probePod)
	fmt.Println("Ctrl-C stops the local cluster and its node.")
}

func command(ctx context.Context, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%s %s: %w", name, strings.Join(args, " "), err)
	}
	return nil
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer func() { _ = l.Close() }()
	return l.Addr().(*net.TCPAddr).Port, nil
}
