package integration

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// Grants by namespace label against a real kube-apiserver: revocation that
// survives a broker restart (TokenReview decides whether the token still
// works), and a namespace relabelled by someone who does not own it.

// tenantNamespace creates a namespace with labels and owner references and
// a ServiceAccount "gitops" in it.
func tenantNamespace(t *testing.T, c *testcluster.Cluster, name string, labels map[string]string, owners ...metav1.OwnerReference) {
	t.Helper()
	ctx := context.Background()
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: name, Labels: labels, OwnerReferences: owners}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.CoreV1().ServiceAccounts(name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "gitops"}}, metav1.CreateOptions{})
	require.NoError(t, err)
}

func whoami(t *testing.T, s *stack, c *http.Client) apiv1.WhoAmI {
	t.Helper()
	var w apiv1.WhoAmI
	status, body := do(t, c, http.MethodGet, s.url+"/v1/whoami", nil, &w)
	require.Equal(t, http.StatusOK, status, string(body))
	return w
}

// matching returns the namespaces whoami lists for the caller's grant.
func matching(t *testing.T, s *stack, c *http.Client, grant string) []string {
	t.Helper()
	for _, g := range whoami(t, s, c).Grants {
		if g.Name == grant {
			return g.MatchingNamespaces
		}
	}
	t.Fatalf("whoami lists no grant %q", grant)
	return nil
}

func TestABrokerThatStartsAfterANamespaceLeftItsGrantRevokesTheLeaseWithItsGC(t *testing.T) {
	c := testcluster.Start(t)
	tenantNamespace(t, c, "oil-dev", map[string]string{"tenant": "oil"})
	tenantNamespace(t, c, "gas-dev", map[string]string{"tenant": "gas"})
	tenantNamespace(t, c, "oil-prod", map[string]string{"tenant": "oil"})
	const policy = `
peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    grants:
      - name: oil
        namespaceSelector: {matchLabels: {tenant: oil}}
        serviceAccounts: [gitops]
      - name: gas
        namespaceSelector: {matchLabels: {tenant: gas}}
        serviceAccounts: [gitops]
`
	first := startStack(t, c, policy)
	west := first.client(t, "west")
	require.Eventually(t, func() bool { return len(matching(t, first, west, "oil")) == 2 }, 10*time.Second, 50*time.Millisecond)
	relabelled := issue(t, first, west, apiv1.KubeconfigRequest{Namespace: "oil-dev", ServiceAccount: "gitops"})
	removed := issue(t, first, west, apiv1.KubeconfigRequest{Namespace: "gas-dev", ServiceAccount: "gitops"})
	kept := issue(t, first, west, apiv1.KubeconfigRequest{Namespace: "oil-prod", ServiceAccount: "gitops"})
	for _, r := range []apiv1.KubeconfigResponse{relabelled, removed, kept} {
		require.True(t, review(t, c.Client, r.Token).Authenticated)
	}

	// No broker runs while the namespace leaves and the grant goes.
	first.stop()
	_, err := c.Client.CoreV1().Namespaces().Patch(context.Background(), "oil-dev", types.MergePatchType,
		[]byte(`{"metadata":{"labels":{"tenant":null}}}`), metav1.PatchOptions{})
	require.NoError(t, err)
	withoutGas := strings.Replace(policy, "      - name: gas\n        namespaceSelector: {matchLabels: {tenant: gas}}\n        serviceAccounts: [gitops]\n", "", 1)
	require.NotEqual(t, policy, withoutGas)

	second := startStack(t, c, withoutGas)
	require.Eventually(t, func() bool { return second.broker.Ready(context.Background()) == nil }, 10*time.Second, 50*time.Millisecond)
	// A GC pass of the new broker finds both, whatever its start-up sweep
	// found.
	_, err = second.broker.CollectGarbage(context.Background())
	require.NoError(t, err)
	leaseIDs := func() []string {
		var ids []string
		for _, s := range leaseSecrets(t, c.Client) {
			ids = append(ids, s.Labels["tokenbroker.io/lease-id"])
		}
		return ids
	}
	require.Eventually(t, func() bool {
		ids := leaseIDs()
		return !slices.Contains(ids, relabelled.LeaseID) && !slices.Contains(ids, removed.LeaseID)
	}, 20*time.Second, 50*time.Millisecond, "leases left: %v", leaseIDs())
	require.Contains(t, leaseIDs(), kept.LeaseID, "a lease its grant still covers is kept")

	start := time.Now()
	require.Eventually(t, func() bool {
		return !review(t, c.Client, relabelled.Token).Authenticated && !review(t, c.Client, removed.Token).Authenticated
	}, 20*time.Second, 100*time.Millisecond, "the API server still accepts a revoked token")
	t.Logf("tokens refused %s after the GC pass", time.Since(start).Round(time.Millisecond))
	require.True(t, review(t, c.Client, kept.Token).Authenticated)
}

func TestANamespaceRelabelledByAUserWhoDoesNotOwnItGetsNoCredential(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	// The Tenant: any cluster-scoped object serves as the owner here (a
	// ClusterRole, for the harness has no Capsule CRD); the broker
	// compares the reference's UID, kind, name and group.
	owner, err := c.Client.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "tenant-oil"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	ref := metav1.OwnerReference{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "ClusterRole", Name: owner.Name, UID: owner.UID}
	tenantNamespace(t, c, "oil-dev", map[string]string{"tenant": "oil"}, ref)
	tenantNamespace(t, c, "victim", nil)

	// mallory may patch namespaces, nothing more.
	_, err = c.Client.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "namespace-labeller"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get", "patch"}}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "mallory"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "namespace-labeller"},
		Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: "rbac.authorization.k8s.io", Name: "mallory"}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	cfg := rest.CopyConfig(c.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: "mallory"}
	mallory, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)

	pol := `
peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    grants:
      - name: oil
        namespaceSelector: {matchLabels: {tenant: oil}}
        namespaceOwner: {apiVersion: rbac.authorization.k8s.io/v1, kind: ClusterRole, name: tenant-oil, uid: ` + string(owner.UID) + `}
        serviceAccounts: [gitops]
  # north's grant goes by the label alone: it shows what the relabel buys
  # without namespaceOwner.
  - name: north
    identity: spiffe://it.tokenbroker.test/cluster/north
    grants:
      - name: oil-by-label
        namespaceSelector: {matchLabels: {tenant: oil}}
        serviceAccounts: [gitops]
`
	s := startStack(t, c, pol)
	west, north := s.client(t, "west"), s.client(t, "north")
	require.Eventually(t, func() bool { return slices.Equal(matching(t, s, west, "oil"), []string{"oil-dev"}) }, 10*time.Second, 50*time.Millisecond)

	_, err = mallory.CoreV1().Namespaces().Patch(ctx, "victim", types.MergePatchType, []byte(`{"metadata":{"labels":{"tenant":"oil"}}}`), metav1.PatchOptions{})
	require.NoError(t, err, "mallory may relabel the namespace")
	require.Eventually(t, func() bool { return slices.Contains(matching(t, s, north, "oil-by-label"), "victim") }, 10*time.Second, 50*time.Millisecond,
		"the broker's cache saw the label")

	require.Equal(t, []string{"oil-dev"}, matching(t, s, west, "oil"), "whoami does not list the relabelled namespace")
	w := whoami(t, s, west)
	require.Equal(t, &apiv1.NamespaceOwner{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "ClusterRole", Name: "tenant-oil", UID: string(owner.UID)}, w.Grants[0].NamespaceOwner)
	status, body := do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs", apiv1.KubeconfigRequest{Namespace: "victim", ServiceAccount: "gitops"}, nil)
	require.Equal(t, http.StatusForbidden, status, string(body))
	for _, l := range leaseSecrets(t, c.Client) {
		require.NotEqual(t, "victim", l.Namespace, "no lease was left in the relabelled namespace")
	}
	ok := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "oil-dev", ServiceAccount: "gitops"})
	require.True(t, review(t, c.Client, ok.Token).Authenticated, "the owned namespace is granted")

	// The label-only grant is what the owner check closes.
	stolen := issue(t, s, north, apiv1.KubeconfigRequest{Namespace: "victim", ServiceAccount: "gitops"})
	require.True(t, review(t, c.Client, stolen.Token).Authenticated)
}
