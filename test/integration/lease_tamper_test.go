package integration

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// secretsTenant is a user who may read, create and change Secrets in
// namespace and nothing else, as a tenant of a namespace a peer is
// granted may: the attacker of docs/security.md, "Tampered lease
// Secrets".
func secretsTenant(t *testing.T, c *testcluster.Cluster, namespace string) kubernetes.Interface {
	t.Helper()
	ctx := context.Background()
	rule := rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch"}}
	_, err := c.Client.RbacV1().Roles(namespace).Create(ctx, &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "tenant-secrets"},
		Rules: []rbacv1.PolicyRule{rule}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.RbacV1().RoleBindings(namespace).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "tenant-secrets"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "tenant-secrets"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: "tenant"}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	for _, verb := range []string{"patch", "update"} {
		r := rule
		r.Verbs = []string{verb}
		require.NoError(t, testcluster.WaitAllowed(ctx, c.Client, "tenant", nil, testcluster.RuleAttributes(r, namespace)))
	}
	_, cl := as(t, c, "tenant")
	return cl
}

// gatewayStatus is the status of a GET of argo's ConfigMaps through the
// gateway, 0 if the connection failed (the gateway ends a gone lease's
// connections).
func gatewayStatus(c *http.Client, host string) int {
	resp, err := c.Get(host + "/api/v1/namespaces/argo/configmaps")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode
}

// TestATenantEditedLeaseIsStillRevokedByItsOwner: a tenant who may patch
// Secrets in argo strips or rewrites the labels and annotations the
// broker's lookups used to depend on. Against the real API server the
// owner's DELETE still revokes each such lease (204, the Secret gone, its
// token refused), the gateway refuses a gateway lease so edited at once,
// and the broker's GC revokes a lease someone else edited without any
// DELETE.
func TestATenantEditedLeaseIsStillRevokedByItsOwner(t *testing.T) {
	s, west := setUpGateway(t)
	c := s.cluster
	ctx := context.Background()
	tenant := secretsTenant(t, c, "argo")
	direct := apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "direct-runner"}

	// seen waits until the broker knows lease id (its lease counter has
	// seen it intact), so that what follows is an edit of a lease it knew.
	seen := func(t *testing.T, id string) {
		t.Helper()
		require.Eventually(t, func() bool {
			st, _, err := tryDo(west, http.MethodGet, s.url+"/v1/leases/"+id, "", nil, nil)
			return err == nil && st == http.StatusOK
		}, 20*time.Second, 20*time.Millisecond)
	}
	// edit has the tenant merge-patch lease id's Secret.
	edit := func(t *testing.T, id, patch string) {
		t.Helper()
		_, err := tenant.CoreV1().Secrets("argo").Patch(ctx, objects.LeaseSecretPrefix+id, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		require.NoError(t, err, "a tenant who may patch Secrets edits a lease")
	}
	gone := func(t *testing.T, id string) {
		t.Helper()
		_, err := c.Client.CoreV1().Secrets("argo").Get(ctx, objects.LeaseSecretPrefix+id, metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "the lease Secret is gone: %v", err)
	}
	refused := func(t *testing.T, token string) {
		t.Helper()
		// The API server caches an authentication for about 10 s.
		require.Eventually(t, func() bool { return !review(t, c.Client, token).Authenticated }, 30*time.Second, 250*time.Millisecond,
			"the API server refuses the token of the revoked lease")
	}

	t.Run("Stripped of its lease-id label, a direct lease is revoked by its owner's DELETE and its token refused.", func(t *testing.T) {
		l := issue(t, s, west, direct)
		require.True(t, review(t, c.Client, l.Token).Authenticated, "the token works")
		seen(t, l.LeaseID)
		edit(t, l.LeaseID, `{"metadata":{"labels":{"tokenbroker.io/lease-id":null}}}`)
		sec, err := c.Client.CoreV1().Secrets("argo").Get(ctx, objects.LeaseSecretPrefix+l.LeaseID, metav1.GetOptions{})
		require.NoError(t, err)
		require.NotContains(t, sec.Labels, objects.LabelLeaseID, "the label is gone")

		status, body := do(t, west, http.MethodDelete, s.url+"/v1/leases/"+l.LeaseID, nil, nil)
		require.Equal(t, http.StatusNoContent, status, string(body))
		gone(t, l.LeaseID)
		refused(t, l.Token)
	})

	t.Run("However else a tenant edits a direct lease, its owner's DELETE revokes it.", func(t *testing.T) {
		edits := map[string]string{
			"its peer label stripped":                `{"metadata":{"labels":{"tokenbroker.io/peer":null}}}`,
			"its managed-by and kind labels gone":    `{"metadata":{"labels":{"app.kubernetes.io/managed-by":null,"tokenbroker.io/kind":null}}}`,
			"made a pooled Secret":                   `{"metadata":{"labels":{"tokenbroker.io/kind":"lease-pool"}}}`,
			"its identity rewritten":                 `{"metadata":{"annotations":{"tokenbroker.io/identity":"spiffe://it.tokenbroker.test/cluster/mallory"}}}`,
			"its lease-id and peer labels rewritten": `{"metadata":{"labels":{"tokenbroker.io/lease-id":"aaaaaaaaaaaaaaaaaaaaaaaaaa","tokenbroker.io/peer":"south"}}}`,
		}
		tokens := map[string]string{}
		for name, patch := range edits {
			l := issue(t, s, west, direct)
			seen(t, l.LeaseID)
			edit(t, l.LeaseID, patch)
			start := time.Now()
			status, body := do(t, west, http.MethodDelete, s.url+"/v1/leases/"+l.LeaseID, nil, nil)
			require.Equal(t, http.StatusNoContent, status, "%s: %s", name, body)
			t.Logf("%s: revoked by its owner in %s", name, time.Since(start).Round(time.Millisecond))
			gone(t, l.LeaseID)
			tokens[name] = l.Token
		}
		for name, token := range tokens {
			require.False(t, review(t, c.Client, token).Authenticated, "%s: never used, so refused at once", name)
		}
	})

	t.Run("Stripped of its lease-id label, a gateway lease is refused by the gateway at once and revoked by its owner's DELETE.", func(t *testing.T) {
		l := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner", Access: apiv1.AccessGateway})
		cl, host := rawGatewayClient(t, l.Kubeconfig)
		require.Eventually(t, func() bool { code, _ := gatewayGet(t, cl, host); return code == http.StatusOK }, 20*time.Second, 50*time.Millisecond,
			"the gateway serves the lease")
		seen(t, l.LeaseID)
		edit(t, l.LeaseID, `{"metadata":{"labels":{"tokenbroker.io/lease-id":null}}}`)
		start := time.Now()
		// The gateway also ends the lease's open connections: a request
		// on one may fail before the refusal is answered on a new one.
		require.Eventually(t, func() bool { return gatewayStatus(cl, host) == http.StatusUnauthorized }, 5*time.Second, 10*time.Millisecond,
			"the gateway holds no lease someone else edited")
		t.Logf("the gateway refused the edited lease %s after the edit", time.Since(start).Round(time.Millisecond))

		status, body := do(t, west, http.MethodDelete, s.url+"/v1/leases/"+l.LeaseID, nil, nil)
		require.Equal(t, http.StatusNoContent, status, string(body))
		gone(t, l.LeaseID)
		require.Eventually(t, func() bool { return gatewayStatus(cl, host) == http.StatusUnauthorized }, 5*time.Second, 10*time.Millisecond)
	})

	t.Run("A lease a tenant edited is revoked by the broker's GC without any DELETE, and audited as its holder's.", func(t *testing.T) {
		l := issue(t, s, west, direct)
		seen(t, l.LeaseID)
		edit(t, l.LeaseID, `{"metadata":{"labels":{"tokenbroker.io/peer":"south"},"annotations":{"tokenbroker.io/identity":"spiffe://it.tokenbroker.test/cluster/south"}}}`)
		// The pass that follows the counter's sight of the edit revokes it.
		require.Eventually(t, func() bool {
			if _, err := s.broker.CollectGarbage(ctx); err != nil {
				return false
			}
			_, err := c.Client.CoreV1().Secrets("argo").Get(ctx, objects.LeaseSecretPrefix+l.LeaseID, metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		}, 10*time.Second, 50*time.Millisecond, "the GC revokes the edited lease")
		require.False(t, review(t, c.Client, l.Token).Authenticated, "never used, so refused at once")
		var found bool
		for _, ev := range readAudit(t, s.auditLog) {
			if ev["action"] == "revoke" && ev["lease_id"] == l.LeaseID && strings.Contains(ev["reason"].(string), "edited by someone other than the broker") {
				found = true
				require.Equal(t, "allow", ev["decision"])
				require.Equal(t, identity(t, "west"), ev["identity"], "the holder it was issued to, not the edited annotation")
				require.Equal(t, "west", ev["peer"])
			}
		}
		require.True(t, found, "the revocation is in the audit log")
		status, _ := do(t, west, http.MethodDelete, s.url+"/v1/leases/"+l.LeaseID, nil, nil)
		require.Equal(t, http.StatusNotFound, status, "nothing left to revoke")
	})
}
