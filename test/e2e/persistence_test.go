package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	authzv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestCLIConfigValidateWarnsOfGrantsWhoseHoldersOutliveTheLease runs the
// real binary's "config validate --kubeconfig" against a real API server:
// the grant whose ServiceAccount may create and read Secrets is warned of,
// the one whose ServiceAccount may only read ConfigMaps is not, and the
// exit status stays 0.
func TestCLIConfigValidateWarnsOfGrantsWhoseHoldersOutliveTheLease(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "argo"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	for name, rule := range map[string]rbacv1.PolicyRule{
		"reader": {Verbs: []string{"get", "list"}, APIGroups: []string{""}, Resources: []string{"configmaps"}},
		"maker":  {Verbs: []string{"get", "create"}, APIGroups: []string{""}, Resources: []string{"secrets", "configmaps"}},
	} {
		_, err := c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = c.Client.RbacV1().Roles("argo").Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: name},
			Rules: []rbacv1.PolicyRule{rule}}, metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = c.Client.RbacV1().RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: name},
			Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: name, Namespace: "argo"}},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name}}, metav1.CreateOptions{})
		require.NoError(t, err)
		// config validate asks the authorizer, which sees the binding a
		// moment after it is written.
		var attrs []authzv1.ResourceAttributes
		for _, verb := range rule.Verbs {
			for _, resource := range rule.Resources {
				attrs = append(attrs, authzv1.ResourceAttributes{Namespace: "argo", Verb: verb, Resource: resource})
			}
		}
		user, groups := testcluster.ServiceAccountUser("argo", name)
		require.NoError(t, testcluster.WaitAllowed(ctx, c.Client, user, groups, attrs...))
	}
	file := filepath.Join(t.TempDir(), "policy.yaml")
	require.NoError(t, os.WriteFile(file, []byte(`cluster: {name: east, server: "https://east.example.com:6443", caData: "`+strings.ReplaceAll(string(c.CAData), "\n", `\n`)+`"}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - {namespaces: [argo], serviceAccounts: [reader]}
      - {namespaces: [argo], serviceAccounts: [maker]}
`), 0o600))

	out, stderr, err := runErr(tokenbrokerBinary(t), "config", "validate", "--kubeconfig", c.KubeconfigPath, file)
	require.NoError(t, err, "warnings do not fail the check\n%s%s", out, stderr)
	require.Equal(t, file+": valid policy config\n", out)
	require.Contains(t, stderr, file+": peers[0].grants[1]: warning: argo/maker can create secrets, get secrets: a credential made with it outlives the lease")
	require.NotContains(t, stderr, "peers[0].grants[0]")

	// A cluster the check cannot ask is a failure, not a clean bill.
	bad := filepath.Join(t.TempDir(), "nobody.kubeconfig")
	require.NoError(t, os.WriteFile(bad, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "`+c.Config.Host+`", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: not-a-token}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`), 0o600))
	_, stderr, err = runErr(tokenbrokerBinary(t), "config", "validate", "--kubeconfig", bad, file)
	require.Error(t, err)
	require.Contains(t, stderr, "check the grants against the cluster")
}
