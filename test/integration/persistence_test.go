package integration

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	authnv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const persistencePolicy = `
cluster: {name: east, server: "https://east.example.com:6443", caData: x}
peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    grants:
      - namespaces: [argo]
        serviceAccounts: [reader]
      - namespaces: [argo]
        serviceAccounts: [editor]
      - namespaces: [argo]
        serviceAccounts: [secret-maker]
      - namespaces: [argo]
        serviceAccounts: [token-maker]
      - namespaces: [argo]
        serviceAccounts: [secret-reader]
  - name: north
    identity: spiffe://it.tokenbroker.test/cluster/north
    grants:
      - namespaces: [argo]
        credential: clientCertificate
        role: reader
  - name: south
    identity: spiffe://it.tokenbroker.test/cluster/south
    grants:
      - namespaces: [argo]
        credential: clientCertificate
        clusterRole: edit
`

// TestPersistenceIsAskedOfTheRealAPIServer: what each grant's holder may do
// is the API server's RBAC decision (SubjectAccessReview), on the default
// roles as the API server bootstraps them and the controller manager
// aggregates them.
func TestPersistenceIsAskedOfTheRealAPIServer(t *testing.T) {
	c := testcluster.Start(t, testcluster.WithControllerManager("clusterrole-aggregation"))
	ctx := context.Background()
	ensureNamespace(t, c, "argo")
	rbac := c.Client.RbacV1()
	for _, sa := range []string{"reader", "editor", "secret-maker", "token-maker", "secret-reader"} {
		_, err := c.Client.CoreV1().ServiceAccounts("argo").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	role := func(name string, rules ...rbacv1.PolicyRule) {
		_, err := rbac.Roles("argo").Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	bind := func(sa, kind, name string) {
		_, err := rbac.RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: sa + "-" + name},
			Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: sa, Namespace: "argo"}},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: kind, Name: name},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	role("reader", rbacv1.PolicyRule{Verbs: []string{"get", "list", "watch"}, APIGroups: []string{"", "apps"}, Resources: []string{"configmaps", "pods", "deployments", "serviceaccounts"}})
	role("secret-maker", rbacv1.PolicyRule{Verbs: []string{"create"}, APIGroups: []string{""}, Resources: []string{"secrets"}})
	role("secret-reader", rbacv1.PolicyRule{Verbs: []string{"get", "list"}, APIGroups: []string{""}, Resources: []string{"secrets"}})
	role("token-maker", rbacv1.PolicyRule{Verbs: []string{"create"}, APIGroups: []string{""}, Resources: []string{"serviceaccounts/token"}})
	bind("reader", "Role", "reader")
	bind("editor", "ClusterRole", "edit")
	bind("secret-maker", "Role", "secret-maker")
	bind("token-maker", "Role", "token-maker")
	bind("secret-reader", "Role", "secret-reader")
	// Wait until the authorizer sees every binding, and edit aggregated
	// by the controller manager (empty until then).
	for sa, attrs := range map[string]authorizationv1.ResourceAttributes{
		"reader":        {Namespace: "argo", Verb: "list", Resource: "configmaps"},
		"editor":        {Namespace: "argo", Verb: "create", Resource: "secrets"},
		"secret-maker":  {Namespace: "argo", Verb: "create", Resource: "secrets"},
		"token-maker":   {Namespace: "argo", Verb: "create", Resource: "serviceaccounts", Subresource: "token"},
		"secret-reader": {Namespace: "argo", Verb: "get", Resource: "secrets"},
	} {
		user, groups := testcluster.ServiceAccountUser("argo", sa)
		require.NoError(t, testcluster.WaitAllowed(ctx, c.Client, user, groups, attrs))
	}

	p, err := policy.Parse([]byte(persistencePolicy))
	require.NoError(t, err)
	warnings, err := policy.CheckPersistence(ctx, p, policy.PersistenceClients{Reviews: c.Client.AuthorizationV1().SubjectAccessReviews(), RBAC: rbac})
	require.NoError(t, err)
	byGrant := map[string][]string{}
	for _, w := range warnings {
		byGrant[w.Field] = append(byGrant[w.Field], w.Detail)
	}
	all := func(field string) string { return strings.Join(byGrant[field], "\n") }

	t.Run("a ServiceAccount that may only get and list is not warned of", func(t *testing.T) {
		require.Empty(t, byGrant["peers[0].grants[0]"])
	})
	t.Run("a ServiceAccount bound to edit is warned of, and edit is named as growing", func(t *testing.T) {
		w := all("peers[0].grants[1]")
		require.Contains(t, w, "argo/editor can create secrets, get secrets, list secrets, create serviceaccounts/token")
		require.Contains(t, w, "create pods")
		require.Contains(t, w, "outlives the lease")
		require.Contains(t, w, "argo/editor: bound to the aggregated ClusterRole edit, which grows")
	})
	t.Run("a ServiceAccount with a role that creates Secrets is warned of", func(t *testing.T) {
		require.Len(t, byGrant["peers[0].grants[2]"], 1)
		require.True(t, strings.HasPrefix(all("peers[0].grants[2]"), "argo/secret-maker can create secrets: a credential made with it outlives the lease"), all("peers[0].grants[2]"))
	})
	t.Run("a ServiceAccount that may create tokens is warned of", func(t *testing.T) {
		require.Len(t, byGrant["peers[0].grants[3]"], 1)
		require.True(t, strings.HasPrefix(all("peers[0].grants[3]"), "argo/token-maker can create serviceaccounts/token: a credential made with it outlives the lease"), all("peers[0].grants[3]"))
	})
	t.Run("a ServiceAccount that may read Secrets is warned of (a legacy token Secret never expires)", func(t *testing.T) {
		require.Len(t, byGrant["peers[0].grants[4]"], 1)
		require.True(t, strings.HasPrefix(all("peers[0].grants[4]"), "argo/secret-reader can get secrets, list secrets: a credential made with it outlives the lease"), all("peers[0].grants[4]"))
	})
	t.Run("a ServiceAccount bound to edit is warned of exec, pod changes and workload patches", func(t *testing.T) {
		w := all("peers[0].grants[1]")
		for _, can := range []string{"create pods/exec", "get pods/exec", "patch pods", "patch deployments.apps", "update statefulsets.apps", "create replicasets.apps", "patch replicationcontrollers"} {
			require.Contains(t, w, can)
		}
	})
	t.Run("a certificate grant with a read-only role is not warned of", func(t *testing.T) {
		require.Empty(t, byGrant["peers[1].grants[0]"])
	})
	t.Run("a certificate grant of edit is warned of, and edit is named as growing", func(t *testing.T) {
		w := all("peers[2].grants[0]")
		require.Contains(t, w, "in argo the certificate's user can create secrets")
		require.Contains(t, w, "bound to the aggregated ClusterRole edit, which grows")
	})
	t.Run("nothing else is warned of", func(t *testing.T) {
		for field := range byGrant {
			require.Contains(t, []string{"peers[0].grants[1]", "peers[0].grants[2]", "peers[0].grants[3]", "peers[0].grants[4]", "peers[2].grants[0]"}, field)
		}
	})
	t.Run("a caller that may not review access gets an error, not a clean bill", func(t *testing.T) {
		// The reader's own token: it may not create SubjectAccessReviews.
		exp := int64(600)
		tr, err := c.Client.CoreV1().ServiceAccounts("argo").CreateToken(ctx, "reader",
			&authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
		require.NoError(t, err)
		cs, err := kubernetes.NewForConfig(c.TokenConfig(tr.Status.Token))
		require.NoError(t, err)
		_, err = policy.CheckPersistence(ctx, p, policy.PersistenceClients{Reviews: cs.AuthorizationV1().SubjectAccessReviews(), RBAC: cs.RbacV1()})
		require.ErrorContains(t, err, "forbidden")
	})
}
