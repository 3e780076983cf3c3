package integration

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// forgeryPolicy lets each peer hold two leases: west in forge-a, south in
// forge-b; forge-c is granted to nobody.
const forgeryPolicy = `limits: {issuancesPerMinute: 1000000, burst: 1000000, maxLiveLeases: 2}
peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    grants:
      - {namespaces: [forge-a], serviceAccounts: [runner]}
  - name: south
    identity: spiffe://it.tokenbroker.test/cluster/south
    grants:
      - {namespaces: [forge-b], serviceAccounts: [runner]}
`

// forgedLease is a Secret that looks like a lease of peer (identity) in
// namespace, as anyone who may create Secrets there can make one.
func forgedLease(namespace, id, peer, identity string, typ corev1.SecretType, expires time.Time) *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name: "tokenbroker-lease-" + id, Namespace: namespace,
			Labels: map[string]string{
				objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.LeaseKind,
				objects.LabelLeaseID: id, objects.LabelPeer: peer,
			},
			Annotations: map[string]string{
				objects.AnnotationExpiresAt: expires.UTC().Format(time.RFC3339),
				objects.AnnotationIdentity:  identity, objects.AnnotationSA: "runner", objects.AnnotationCred: apiv1.CredentialToken,
			},
		},
		Type: typ,
	}
}

// TestForgedLeaseSecretsCountForNothingAndHideNoLease forges lease Secrets
// the way a tenant who may create Secrets could (another type, a namespace
// no grant or only another peer's grant names, another peer's identity,
// copies of a real lease's name elsewhere), more than the global quota, and
// shows that against the real API server none takes a place in a quota and
// none stops the owner from getting and revoking its lease.
func TestForgedLeaseSecretsCountForNothingAndHideNoLease(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	for _, ns := range []string{"forge-a", "forge-b", "forge-c"} {
		ensureNamespace(t, c, ns)
		_, err := c.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	s := startStack(t, c, forgeryPolicy, withMaxLiveLeases(10))
	west, south := s.client(t, "west"), s.client(t, "south")
	westID, southID := identity(t, "west"), identity(t, "south")
	issue := func(cl *http.Client, ns string) (int, apiv1.KubeconfigResponse, []byte) {
		var resp apiv1.KubeconfigResponse
		status, body := do(t, cl, http.MethodPost, s.url+"/v1/kubeconfigs", apiv1.KubeconfigRequest{Namespace: ns, ServiceAccount: "runner"}, &resp)
		return status, resp, body
	}
	status, mine, body := issue(west, "forge-a")
	require.Equal(t, http.StatusCreated, status, string(body))

	// 22 forgeries, more than --max-live-leases (10) and west's quota (2).
	soon := time.Now().Add(time.Hour)
	secrets := c.Client.CoreV1()
	var forged []*corev1.Secret
	for i := range 5 {
		id := func(kind string) string { return fmt.Sprintf("%s%0*d", kind, 26-len(kind), i) }
		forged = append(forged,
			forgedLease("forge-a", id("opaque"), "west", westID, corev1.SecretTypeOpaque, soon),
			forgedLease("forge-c", id("nogrant"), "west", westID, objects.SecretTypeLease, soon),
			forgedLease("forge-b", id("otherpeer"), "west", westID, objects.SecretTypeLease, soon),
			forgedLease("forge-a", id("otheridentity"), "west", southID, objects.SecretTypeLease, soon),
		)
	}
	// Copies of west's real lease, its id and all, in the other namespaces.
	forged = append(forged,
		forgedLease("forge-b", mine.LeaseID, "west", westID, objects.SecretTypeLease, soon),
		forgedLease("forge-c", mine.LeaseID, "west", westID, objects.SecretTypeLease, soon),
	)
	for _, f := range forged {
		_, err := secrets.Secrets(f.Namespace).Create(ctx, f, metav1.CreateOptions{})
		require.NoError(t, err, f.Namespace+"/"+f.Name)
	}
	// A last one south may hold: once the broker finds it by id, its
	// cluster-wide watch has delivered every forgery before it.
	sentinel := forgedLease("forge-b", "sentinelaaaaaaaaaaaaaaaaaa", "south", southID, objects.SecretTypeLease, soon)
	_, err := secrets.Secrets("forge-b").Create(ctx, sentinel, metav1.CreateOptions{})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		st, _, err := tryDo(south, http.MethodGet, s.url+"/v1/leases/sentinelaaaaaaaaaaaaaaaaaa", "", nil, nil)
		return err == nil && st == http.StatusOK
	}, 30*time.Second, 100*time.Millisecond, "the broker never saw the sentinel")

	t.Run("The owner gets its lease, not a copy.", func(t *testing.T) {
		var l apiv1.Lease
		status, body := do(t, west, http.MethodGet, s.url+"/v1/leases/"+mine.LeaseID, nil, &l)
		require.Equal(t, http.StatusOK, status, string(body))
		require.Equal(t, "forge-a", l.Namespace)
	})

	t.Run("Forgeries take no place in the peer's quota or the global one.", func(t *testing.T) {
		status, _, body := issue(west, "forge-a")
		require.Equal(t, http.StatusCreated, status, "west's second lease: %s", body)
		status, _, body = issue(west, "forge-a")
		require.Equal(t, http.StatusTooManyRequests, status, "west's third: the quota still counts real leases: %s", body)
		status, _, body = issue(south, "forge-b")
		require.Equal(t, http.StatusCreated, status, "south's second (the sentinel is its first): %s", body)
	})

	t.Run("The owner revokes its lease, and no copy goes with it.", func(t *testing.T) {
		status, body := do(t, west, http.MethodDelete, s.url+"/v1/leases/"+mine.LeaseID, nil, nil)
		require.Equal(t, http.StatusNoContent, status, string(body))
		_, err := secrets.Secrets("forge-a").Get(ctx, "tokenbroker-lease-"+mine.LeaseID, metav1.GetOptions{})
		require.True(t, apierrors.IsNotFound(err), "revoked: %v", err)
		for _, ns := range []string{"forge-b", "forge-c"} {
			_, err := secrets.Secrets(ns).Get(ctx, "tokenbroker-lease-"+mine.LeaseID, metav1.GetOptions{})
			require.NoError(t, err, "the copy in %s is not the broker's to delete", ns)
		}
		status, _ = do(t, west, http.MethodGet, s.url+"/v1/leases/"+mine.LeaseID, nil, nil)
		require.Equal(t, http.StatusNotFound, status, "a copy is not found in the lease's place")
	})
}

// brokerUser is the user name of the broker's ServiceAccount in
// deploy/base, which deploy/components/lease-admission-policy spells out.
const brokerUser = "system:serviceaccount:tokenbroker:tokenbroker"

// applyLeaseAdmissionPolicy creates the ValidatingAdmissionPolicy and its
// binding of deploy/components/lease-admission-policy, as shipped.
func applyLeaseAdmissionPolicy(t *testing.T, c *testcluster.Cluster) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "deploy", "components", "lease-admission-policy", "admission-policy.yaml"))
	require.NoError(t, err)
	docs := strings.Split(string(raw), "\n---\n")
	require.Len(t, docs, 2)
	var vap admissionv1.ValidatingAdmissionPolicy
	var binding admissionv1.ValidatingAdmissionPolicyBinding
	require.NoError(t, yaml.UnmarshalStrict([]byte(docs[0]), &vap))
	require.NoError(t, yaml.UnmarshalStrict([]byte(docs[1]), &binding))
	require.Equal(t, "ValidatingAdmissionPolicy", vap.Kind)
	require.Equal(t, "ValidatingAdmissionPolicyBinding", binding.Kind)
	ctx := context.Background()
	_, err = c.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, &vap, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, &binding, metav1.CreateOptions{})
	require.NoError(t, err)
}

// as returns a clientset impersonating user (the admin may impersonate).
func as(t *testing.T, c *testcluster.Cluster, user string, groups ...string) (*rest.Config, kubernetes.Interface) {
	t.Helper()
	cfg := rest.CopyConfig(c.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: append(groups, "system:authenticated")}
	cl, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	return cfg, cl
}

// TestTheLeaseAdmissionPolicyReservesLeaseSecretsForTheBroker applies the
// optional admission policy to a real API server: a tenant who may create
// Secrets is refused a lease Secret (by type or by label), keeps its other
// Secrets, and the broker, as its ServiceAccount, still issues and revokes
// leases through it.
func TestTheLeaseAdmissionPolicyReservesLeaseSecretsForTheBroker(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	for _, ns := range []string{"forge-a", "tenant"} {
		ensureNamespace(t, c, ns)
	}
	_, err := c.Client.CoreV1().ServiceAccounts("forge-a").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "runner"}}, metav1.CreateOptions{})
	require.NoError(t, err)
	// The tenant may create and update Secrets in its namespace (the
	// attacker of docs/security.md); the broker's ServiceAccount gets
	// cluster-admin here: its RBAC is not what is under test.
	_, err = c.Client.RbacV1().Roles("tenant").Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "secrets"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "create", "update", "patch", "delete"}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.RbacV1().RoleBindings("tenant").Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "tenant-secrets"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "secrets"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: "alice"}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	ensureNamespace(t, c, "tokenbroker")
	_, err = c.Client.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "tokenbroker-test-admin"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: "cluster-admin"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: "tokenbroker", Name: "tokenbroker"}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	applyLeaseAdmissionPolicy(t, c)
	_, alice := as(t, c, "alice")
	soon := time.Now().Add(time.Hour)
	westID := identity(t, "west")

	// The API server applies a new policy within a moment: wait for the
	// first refusal (deleting what got through before it did).
	byType := forgedLease("tenant", "bytype000000000000000000aa", "west", westID, "tokenbroker.io/lease", soon)
	require.Eventually(t, func() bool {
		_, err := alice.CoreV1().Secrets("tenant").Create(ctx, byType, metav1.CreateOptions{})
		if err == nil {
			_ = c.Client.CoreV1().Secrets("tenant").Delete(ctx, byType.Name, metav1.DeleteOptions{})
		}
		return err != nil && strings.Contains(err.Error(), "tokenbroker-reserves-lease-secrets")
	}, 30*time.Second, 100*time.Millisecond, "the admission policy never refused a forged lease Secret")

	t.Run("A tenant's Secret of the lease type is refused.", func(t *testing.T) {
		_, err := alice.CoreV1().Secrets("tenant").Create(ctx, byType, metav1.CreateOptions{})
		require.Error(t, err)
		require.Contains(t, err.Error(), "only tokenbroker's ServiceAccount may create or change Secrets of type tokenbroker.io/lease")
	})

	t.Run("A tenant's Secret of another type with the lease labels is refused.", func(t *testing.T) {
		for _, kind := range []string{objects.LeaseKind, objects.PoolKind} {
			s := forgedLease("tenant", "bylabel00000000000000000aa", "west", westID, corev1.SecretTypeOpaque, soon)
			s.Labels[objects.LabelKind] = kind
			_, err := alice.CoreV1().Secrets("tenant").Create(ctx, s, metav1.CreateOptions{})
			require.Error(t, err, kind)
			require.Contains(t, err.Error(), "only tokenbroker's ServiceAccount may label a Secret tokenbroker.io/kind=lease")
		}
	})

	t.Run("A tenant may not relabel its Secret into a lease.", func(t *testing.T) {
		s, err := alice.CoreV1().Secrets("tenant").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "plain"}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{})
		require.NoError(t, err, "a tenant's ordinary Secret is its own business")
		s.Labels = map[string]string{objects.LabelKind: objects.LeaseKind}
		_, err = alice.CoreV1().Secrets("tenant").Update(ctx, s, metav1.UpdateOptions{})
		require.Error(t, err)
		require.Contains(t, err.Error(), "only tokenbroker's ServiceAccount may label a Secret tokenbroker.io/kind=lease")
	})

	t.Run("A tenant may not strip the grant, the revoke-on-unmatch mark or the peer label from the broker's lease.", func(t *testing.T) {
		// Revocation on unmatch trusts these: a lease without them is
		// skipped when its namespace leaves its selector grant.
		_, brokerClient := as(t, c, brokerUser, "system:serviceaccounts", "system:serviceaccounts:tokenbroker")
		l := forgedLease("tenant", "bybroker00000000000000000aa", "west", westID, objects.SecretTypeLease, soon)
		l.Annotations[objects.AnnotationGrant] = "oil"
		l.Annotations[objects.AnnotationRevokeOnUnmatch] = "0s"
		_, err := brokerClient.CoreV1().Secrets("tenant").Create(ctx, l, metav1.CreateOptions{})
		require.NoError(t, err, "the broker's ServiceAccount writes its lease")
		for _, patch := range []string{
			`{"metadata":{"annotations":{"tokenbroker.io/grant":null}}}`,
			`{"metadata":{"annotations":{"tokenbroker.io/revoke-on-unmatch":null}}}`,
			`{"metadata":{"labels":{"` + objects.LabelPeer + `":null}}}`,
			`{"metadata":{"labels":{"` + objects.LabelKind + `":"stripped"}}}`,
		} {
			_, err := alice.CoreV1().Secrets("tenant").Patch(ctx, l.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
			require.Error(t, err, patch)
			require.Contains(t, err.Error(), "only tokenbroker's ServiceAccount may create or change Secrets of type tokenbroker.io/lease", patch)
		}
		got, err := alice.CoreV1().Secrets("tenant").Get(ctx, l.Name, metav1.GetOptions{})
		require.NoError(t, err)
		delete(got.Annotations, objects.AnnotationGrant)
		_, err = alice.CoreV1().Secrets("tenant").Update(ctx, got, metav1.UpdateOptions{})
		require.Error(t, err, "an update is refused as a patch is")
		got, err = c.Client.CoreV1().Secrets("tenant").Get(ctx, l.Name, metav1.GetOptions{})
		require.NoError(t, err)
		require.Equal(t, "oil", got.Annotations[objects.AnnotationGrant])
		require.Equal(t, "0s", got.Annotations[objects.AnnotationRevokeOnUnmatch])
		require.Equal(t, "west", got.Labels[objects.LabelPeer])
		require.NoError(t, alice.CoreV1().Secrets("tenant").Delete(ctx, l.Name, metav1.DeleteOptions{}), "deleting stays the tenant's right")
	})

	t.Run("A lease being deleted may lose its finalizers, as the garbage collector's orphan and foreground deletions need.", func(t *testing.T) {
		// Refusing that update would keep the lease, and the token bound
		// to it, Terminating for good.
		_, brokerClient := as(t, c, brokerUser, "system:serviceaccounts", "system:serviceaccounts:tokenbroker")
		l := forgedLease("tenant", "byfinal000000000000000000aa", "west", westID, objects.SecretTypeLease, soon)
		l.Finalizers = []string{"orphan"}
		_, err := brokerClient.CoreV1().Secrets("tenant").Create(ctx, l, metav1.CreateOptions{})
		require.NoError(t, err)
		require.NoError(t, alice.CoreV1().Secrets("tenant").Delete(ctx, l.Name, metav1.DeleteOptions{}))
		got, err := c.Client.CoreV1().Secrets("tenant").Get(ctx, l.Name, metav1.GetOptions{})
		require.NoError(t, err)
		require.NotNil(t, got.DeletionTimestamp, "held by its finalizer")
		got.Finalizers = nil
		_, err = c.Client.CoreV1().Secrets("tenant").Update(ctx, got, metav1.UpdateOptions{})
		require.NoError(t, err, "someone other than the broker removes the finalizer")
		require.Eventually(t, func() bool {
			_, err := c.Client.CoreV1().Secrets("tenant").Get(ctx, l.Name, metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		}, 10*time.Second, 50*time.Millisecond, "the lease is gone")
	})

	t.Run("The broker, as its ServiceAccount, still issues and revokes leases.", func(t *testing.T) {
		kube, _ := as(t, c, brokerUser, "system:serviceaccounts", "system:serviceaccounts:tokenbroker")
		s := startStack(t, c, `peers:
  - name: west
    identity: spiffe://it.tokenbroker.test/cluster/west
    grants:
      - {namespaces: [forge-a], serviceAccounts: [runner]}
`, withKube(kube))
		west := s.client(t, "west")
		var resp apiv1.KubeconfigResponse
		status, body := do(t, west, http.MethodPost, s.url+"/v1/kubeconfigs", apiv1.KubeconfigRequest{Namespace: "forge-a", ServiceAccount: "runner"}, &resp)
		require.Equal(t, http.StatusCreated, status, string(body))
		lease, err := c.Client.CoreV1().Secrets("forge-a").Get(ctx, "tokenbroker-lease-"+resp.LeaseID, metav1.GetOptions{})
		require.NoError(t, err)
		require.Equal(t, objects.SecretTypeLease, lease.Type)
		status, body = do(t, west, http.MethodDelete, s.url+"/v1/leases/"+resp.LeaseID, nil, nil)
		require.Equal(t, http.StatusNoContent, status, string(body))
	})
}
