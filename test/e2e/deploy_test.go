package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// manifest is one document of `kubectl kustomize deploy/base`.
type manifest struct {
	Kind     string `json:"kind"`
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	raw []byte
}

func splitManifests(t *testing.T, out string) []manifest {
	t.Helper()
	r := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(out)))
	var docs []manifest
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		var m manifest
		require.NoError(t, yaml.Unmarshal(doc, &m), string(doc))
		m.raw = doc
		docs = append(docs, m)
	}
	return docs
}

// requireHardened checks the security contexts of a single-container pod
// of deploy/: non-root, read-only root filesystem, no privilege
// escalation, every capability dropped, the runtime's seccomp profile.
func requireHardened(t *testing.T, pod corev1.PodSpec) {
	t.Helper()
	require.Len(t, pod.Containers, 1)
	sc := pod.Containers[0].SecurityContext
	require.NotNil(t, sc)
	require.Equal(t, ptrTo(true), sc.RunAsNonRoot)
	require.Equal(t, ptrTo(true), sc.ReadOnlyRootFilesystem)
	require.Equal(t, ptrTo(false), sc.AllowPrivilegeEscalation)
	require.NotNil(t, sc.Capabilities)
	require.Equal(t, []corev1.Capability{"ALL"}, sc.Capabilities.Drop)
	require.Empty(t, sc.Capabilities.Add)
	require.NotNil(t, sc.SeccompProfile)
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, sc.SeccompProfile.Type)
	require.NotNil(t, pod.SecurityContext)
	require.Equal(t, ptrTo(true), pod.SecurityContext.RunAsNonRoot)
	require.NotNil(t, pod.SecurityContext.SeccompProfile)
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, pod.SecurityContext.SeccompProfile.Type)
}

func findManifest(t *testing.T, docs []manifest, kind, name string) manifest {
	t.Helper()
	for _, d := range docs {
		if d.Kind == kind && (name == "" || d.Metadata.Name == name) {
			return d
		}
	}
	t.Fatalf("kustomize output has no %s %q", kind, name)
	return manifest{}
}

// TestDeployBase checks deploy/base against a real API server: it renders,
// the API server accepts every object in a server-side dry run (with the
// namespace's "restricted" Pod Security level in force), the Deployment is
// hardened and passes only flags `tokenbroker serve` knows, and the RBAC it
// grants is enough for a broker that runs as its ServiceAccount, both
// cluster-wide and scoped to the granted namespaces as docs/security.md
// describes.
func TestDeployBase(t *testing.T) {
	// A 1h cap on tokens makes the API server shorten a 2h request, so the
	// broker also has to patch the lease's expiry: every verb is exercised.
	c := testcluster.Start(t, testcluster.WithMaxTokenExpiration(time.Hour))
	kubectl := kubectlBinary(t)
	base := filepath.Join(repoRoot(t), "deploy", "base")
	admin := []string{"--kubeconfig", c.KubeconfigPath}

	rendered := run(t, kubectl, "kustomize", base)
	docs := splitManifests(t, rendered)
	policyCM := findManifest(t, docs, "ConfigMap", "")
	require.Regexp(t, `^tokenbroker-policy-[a-z0-9]+$`, policyCM.Metadata.Name, "the policy ConfigMap is generated with a hash suffix")

	// Only what is known to be needed is applied for real. A server-side dry
	// run persists nothing, not even the Namespace, so without this the
	// namespaced objects would fail with `namespaces "tokenbroker" not
	// found`; it also puts the namespace's Pod Security labels in force for
	// the dry run of the Deployment.
	nsFile := writeFile(t, filepath.Join(t.TempDir(), "namespace.yaml"), string(findManifest(t, docs, "Namespace", "tokenbroker").raw))
	run(t, kubectl, append(admin, "apply", "-f", nsFile)...)

	t.Run("a server-side dry run accepts every object, without Pod Security warnings", func(t *testing.T) {
		stdout, stderr, err := runErr(kubectl, append(admin, "apply", "-k", base, "--dry-run=server", "-o", "name")...)
		require.NoError(t, err, "stdout: %s\nstderr: %s", stdout, stderr)
		require.NotContains(t, stderr, "Warning", "the Deployment must meet the restricted Pod Security Standard")
		require.ElementsMatch(t, []string{
			"namespace/tokenbroker",
			"serviceaccount/tokenbroker",
			"clusterrole.rbac.authorization.k8s.io/tokenbroker-issue",
			"clusterrolebinding.rbac.authorization.k8s.io/tokenbroker-issue",
			"clusterrole.rbac.authorization.k8s.io/tokenbroker-namespaces",
			"clusterrolebinding.rbac.authorization.k8s.io/tokenbroker-namespaces",
			"role.rbac.authorization.k8s.io/tokenbroker-self",
			"rolebinding.rbac.authorization.k8s.io/tokenbroker-self",
			"configmap/" + policyCM.Metadata.Name,
			"service/tokenbroker",
			"deployment.apps/tokenbroker",
		}, strings.Fields(stdout))

		_, err = c.Client.AppsV1().Deployments("tokenbroker").Get(context.Background(), "tokenbroker", metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "a dry run must not create the Deployment: %v", err)
	})

	t.Run("the Deployment is hardened, probed on the ops port and mounts its inputs read-only", func(t *testing.T) {
		var d appsv1.Deployment
		require.NoError(t, yaml.UnmarshalStrict(findManifest(t, docs, "Deployment", "tokenbroker").raw, &d))
		pod := d.Spec.Template.Spec
		require.Len(t, pod.Containers, 1)
		ctr := pod.Containers[0]
		require.Equal(t, imageRef(t), ctr.Image, "the image make image tags")
		require.Equal(t, "tokenbroker", pod.ServiceAccountName)

		requireHardened(t, pod)

		ports := map[string]int32{}
		for _, p := range ctr.Ports {
			ports[p.Name] = p.ContainerPort
		}
		require.Equal(t, map[string]int32{"https": 8443, "ops": 9090}, ports)
		require.Equal(t, "/healthz", ctr.LivenessProbe.HTTPGet.Path)
		require.Equal(t, "ops", ctr.LivenessProbe.HTTPGet.Port.String())
		require.Equal(t, "/readyz", ctr.ReadinessProbe.HTTPGet.Path)
		require.Equal(t, "ops", ctr.ReadinessProbe.HTTPGet.Port.String())
		require.NotNil(t, ctr.Resources.Requests.Cpu())
		require.False(t, ctr.Resources.Limits.Memory().IsZero())

		require.NotEmpty(t, ctr.VolumeMounts)
		for _, m := range ctr.VolumeMounts {
			require.True(t, m.ReadOnly, "volume %s must be mounted read-only", m.Name)
		}
		for _, v := range pod.Volumes {
			if v.ConfigMap != nil {
				require.Equal(t, policyCM.Metadata.Name, v.ConfigMap.Name, "the Deployment refers to the generated policy ConfigMap")
			}
		}

		var svc corev1.Service
		require.NoError(t, yaml.UnmarshalStrict(findManifest(t, docs, "Service", "tokenbroker").raw, &svc))
		require.Len(t, svc.Spec.Ports, 1, "only the API is exposed")
		require.Equal(t, "https", svc.Spec.Ports[0].Name)
		require.Equal(t, int32(443), svc.Spec.Ports[0].Port)
		require.Equal(t, "https", svc.Spec.Ports[0].TargetPort.String())
	})

	t.Run("the Deployment passes only flags that tokenbroker serve knows", func(t *testing.T) {
		var d appsv1.Deployment
		require.NoError(t, yaml.Unmarshal(findManifest(t, docs, "Deployment", "tokenbroker").raw, &d))
		args := d.Spec.Template.Spec.Containers[0].Args
		require.NotEmpty(t, args)
		require.Equal(t, "serve", args[0])
		help := run(t, tokenbrokerBinary(t), "serve", "--help")
		for _, a := range args[1:] {
			name, _, _ := strings.Cut(a, "=")
			require.Regexp(t, `(?m)^\s+`+regexp.QuoteMeta(name)+`\s`, help, "unknown flag %s", name)
		}
		for _, required := range []string{"--tls-cert-file", "--tls-key-file", "--client-ca-file", "--policy-file"} {
			require.True(t, slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, required+"=") }), "missing %s", required)
		}
	})

	t.Run("the placeholder policy is a valid policy that denies everything", func(t *testing.T) {
		var cm corev1.ConfigMap
		require.NoError(t, yaml.Unmarshal(policyCM.raw, &cm))
		p, err := policy.Parse([]byte(cm.Data["policy.yaml"]))
		require.NoError(t, err)
		require.Empty(t, p.Peers)
	})

	// From here on the ServiceAccount and RBAC objects are applied for real
	// and a broker runs with nothing but the ServiceAccount's permissions.
	var rbac []manifest
	for _, d := range docs {
		if d.Kind == "ServiceAccount" || strings.HasPrefix(d.Kind, "ClusterRole") || strings.HasPrefix(d.Kind, "Role") {
			rbac = append(rbac, d)
		}
	}
	var rbacYAML strings.Builder
	for _, d := range rbac {
		rbacYAML.WriteString("---\n")
		rbacYAML.Write(d.raw)
	}
	run(t, kubectl, append(admin, "apply", "-f", writeFile(t, filepath.Join(t.TempDir(), "rbac.yaml"), rbacYAML.String()))...)
	setUpTarget(t, c)
	e := startBroker(t, &testcluster.Cluster{URL: c.URL, CAData: c.CAData, KubeconfigPath: serviceAccountKubeconfig(t, c, "tokenbroker", "tokenbroker")})
	west := filepath.Join(e.dir, "west")

	t.Run("the base's RBAC is enough to issue, list, revoke and collect leases", func(t *testing.T) {
		issueListRevoke(t, e, west)
		require.NotContains(t, e.proc.logs.String(), "lease garbage collection failed")
		require.NotContains(t, e.proc.logs.String(), "forbidden")
	})

	t.Run("the base's RBAC is enough to watch the revocation list", func(t *testing.T) {
		require.Contains(t, e.proc.logs.String(), "revocation list synced")
		require.NotContains(t, e.proc.logs.String(), "watch of the revocation ConfigMap failed")
	})

	t.Run("the base's RBAC is enough to watch namespaces, and gives nothing else on them", func(t *testing.T) {
		require.NotContains(t, e.proc.logs.String(), "watch of namespaces failed")
		sa := serviceAccountKubeconfig(t, c, "tokenbroker", "tokenbroker")
		as := []string{"--kubeconfig", sa, "auth", "can-i"}
		for _, verb := range []string{"list", "watch"} {
			out, _, err := runErr(kubectl, append(as, verb, "namespaces")...)
			require.NoError(t, err, out)
		}
		for _, verb := range []string{"get", "create", "update", "patch", "delete"} {
			out, _, _ := runErr(kubectl, append(as, verb, "namespaces")...)
			require.Equal(t, "no", strings.TrimSpace(out), verb)
		}
	})

	t.Run("scoped to the granted namespace with a RoleBinding, as docs/security.md shows, it still works", func(t *testing.T) {
		ctx := context.Background()
		require.NoError(t, c.Client.RbacV1().ClusterRoleBindings().Delete(ctx, "tokenbroker-issue", metav1.DeleteOptions{}))
		// Without the binding, issuing fails: the RBAC is really in force.
		require.Eventually(t, func() bool {
			status, _ := e.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner"}`)
			return status == 500
		}, 10*time.Second, 100*time.Millisecond, "issuing must fail without the tokenbroker-issue binding")

		_, err := c.Client.RbacV1().RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-issue"},
			RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "tokenbroker-issue"},
			Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "tokenbroker", Namespace: "tokenbroker"}},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		require.Eventually(t, func() bool {
			status, _ := e.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner"}`)
			return status == 201
		}, 10*time.Second, 100*time.Millisecond, "issuing must work again with the RoleBinding")
		issueListRevoke(t, e, west)
	})

	t.Run("scoped that way, the broker cannot read Secrets of any other namespace", func(t *testing.T) {
		sa := "system:serviceaccount:tokenbroker:tokenbroker"
		can := func(attr authzv1.ResourceAttributes) bool {
			r, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), &authzv1.SubjectAccessReview{
				Spec: authzv1.SubjectAccessReviewSpec{User: sa, ResourceAttributes: &attr},
			}, metav1.CreateOptions{})
			require.NoError(t, err)
			return r.Status.Allowed
		}
		require.True(t, can(authzv1.ResourceAttributes{Namespace: "argo", Verb: "list", Resource: "secrets"}))
		require.False(t, can(authzv1.ResourceAttributes{Verb: "list", Resource: "secrets"}), "no cluster-wide list")
		require.False(t, can(authzv1.ResourceAttributes{Namespace: "kube-system", Verb: "list", Resource: "secrets"}))
		require.False(t, can(authzv1.ResourceAttributes{Namespace: "argo", Verb: "get", Resource: "secrets"}))
	})

	t.Run("without tokenbroker-issue, the Role still lets the broker record used join tokens and read only its deny list", func(t *testing.T) {
		sa := "system:serviceaccount:tokenbroker:tokenbroker"
		can := func(attr authzv1.ResourceAttributes) bool {
			r, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), &authzv1.SubjectAccessReview{
				Spec: authzv1.SubjectAccessReviewSpec{User: sa, ResourceAttributes: &attr},
			}, metav1.CreateOptions{})
			require.NoError(t, err)
			return r.Status.Allowed
		}
		for _, attr := range []authzv1.ResourceAttributes{
			{Namespace: "tokenbroker", Verb: "create", Resource: "secrets"},
			{Namespace: "tokenbroker", Verb: "delete", Resource: "secrets"},
			{Namespace: "tokenbroker", Verb: "list", Resource: "configmaps", Name: "tokenbroker-revocations"},
			{Namespace: "tokenbroker", Verb: "watch", Resource: "configmaps", Name: "tokenbroker-revocations"},
		} {
			require.True(t, can(attr), "%+v", attr)
		}
		for _, attr := range []authzv1.ResourceAttributes{
			{Namespace: "tokenbroker", Verb: "list", Resource: "configmaps"},
			{Namespace: "tokenbroker", Verb: "get", Resource: "configmaps", Name: "tokenbroker-policy"},
			{Namespace: "tokenbroker", Verb: "update", Resource: "configmaps", Name: "tokenbroker-revocations"},
			{Namespace: "default", Verb: "create", Resource: "secrets"},
		} {
			require.False(t, can(attr), "%+v", attr)
		}
	})
}

// issueListRevoke issues a kubeconfig that the API server shortens (so the
// lease's expiry is patched), finds its lease in the listing, revokes it
// and checks that it is gone.
func issueListRevoke(t *testing.T, e *brokerEnv, client string) {
	t.Helper()
	status, body := e.postKubeconfig(t, client, `{"namespace":"argo","serviceAccount":"runner","ttl":"2h"}`)
	require.Equal(t, 201, status, body)
	var resp apiv1.KubeconfigResponse
	require.NoError(t, json.Unmarshal([]byte(body), &resp))
	require.Equal(t, policy.ClampedByAPIServer, resp.ClampedBy, "the cluster caps tokens at 1h")

	status, body, err := e.curl(t, client, "https://"+e.api+"/v1/leases")
	require.NoError(t, err)
	require.Equal(t, 200, status, body)
	require.Contains(t, body, resp.LeaseID)

	status, body, err = e.curl(t, client, "-X", "DELETE", "https://"+e.api+"/v1/leases/"+resp.LeaseID)
	require.NoError(t, err)
	require.Equal(t, 204, status, body)
	status, _, err = e.curl(t, client, "https://"+e.api+"/v1/leases/"+resp.LeaseID)
	require.NoError(t, err)
	require.Equal(t, 404, status)
}

// serviceAccountKubeconfig writes a kubeconfig that authenticates as the
// ServiceAccount namespace/name with a one-hour token, so that a broker
// started with it has exactly that ServiceAccount's permissions.
func serviceAccountKubeconfig(t *testing.T, c *testcluster.Cluster, namespace, name string) string {
	t.Helper()
	exp := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(context.Background(), name,
		&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	require.NoError(t, err)
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["target"] = &clientcmdapi.Cluster{Server: c.URL, CertificateAuthorityData: c.CAData}
	cfg.AuthInfos[name] = &clientcmdapi.AuthInfo{Token: tr.Status.Token}
	cfg.Contexts["target"] = &clientcmdapi.Context{Cluster: "target", AuthInfo: name}
	cfg.CurrentContext = "target"
	path := filepath.Join(t.TempDir(), "broker.kubeconfig")
	require.NoError(t, clientcmd.WriteToFile(*cfg, path))
	require.NoError(t, os.Chmod(path, 0o600))
	return path
}

func ptrTo[T any](v T) *T { return &v }
