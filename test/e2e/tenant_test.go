package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

const tenantLabel = "capsule.clastix.io/tenant"

// tenantPolicy grants west the ServiceAccount runner in every namespace of
// tenant oil, and one ServiceAccount per selector operator.
const tenantGrants = `
      - name: oil
        namespaceSelector:
          matchLabels: {capsule.clastix.io/tenant: oil}
        serviceAccounts: [runner]
        maxTTL: 4h
      - name: in
        namespaceSelector:
          matchExpressions: [{key: tier, operator: In, values: [gold, silver]}]
        serviceAccounts: [sa-in]
      - name: notin
        namespaceSelector:
          matchExpressions: [{key: tier, operator: NotIn, values: [gold]}]
        serviceAccounts: [sa-notin]
      - name: exists
        namespaceSelector:
          matchExpressions: [{key: tier, operator: Exists}]
        serviceAccounts: [sa-exists]
      - name: absent
        namespaceSelector:
          matchExpressions: [{key: tier, operator: DoesNotExist}]
        serviceAccounts: [sa-absent]
`

// tenantNamespace creates a namespace with labels, the ServiceAccounts the
// grants name, and lets runner read ConfigMaps there.
func tenantNamespace(t *testing.T, c *testcluster.Cluster, name string, labels map[string]string) {
	t.Helper()
	ctx := context.Background()
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{})
	require.NoError(t, err)
	for _, sa := range []string{"runner", "sa-in", "sa-notin", "sa-exists", "sa-absent"} {
		_, err := c.Client.CoreV1().ServiceAccounts(name).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	_, err = c.Client.RbacV1().Roles(name).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "configmap-reader"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: []string{"get", "list"}}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = c.Client.RbacV1().RoleBindings(name).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "runner-view"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "configmap-reader"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "runner", Namespace: name}},
	}, metav1.CreateOptions{})
	require.NoError(t, err)
}

func setLabels(t *testing.T, c *testcluster.Cluster, ns string, labels map[string]any) {
	t.Helper()
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": labels}})
	require.NoError(t, err)
	_, err = c.Client.CoreV1().Namespaces().Patch(context.Background(), ns, "application/merge-patch+json", patch, metav1.PatchOptions{})
	require.NoError(t, err)
}

func leaseGone(t *testing.T, c *testcluster.Cluster, ns, id string) bool {
	_, err := c.Client.CoreV1().Secrets(ns).Get(context.Background(), "tokenbroker-lease-"+id, metav1.GetOptions{})
	return apierrors.IsNotFound(err)
}

func TestTenantGrants(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := newBrokerEnv(t, c)
	pol, err := os.ReadFile(e.policy)
	require.NoError(t, err)
	base := string(pol)
	writeFile(t, e.policy, base+strings.TrimPrefix(tenantGrants, "\n"))
	e.launch(t)
	kubectl := kubectlBinary(t)
	west := filepath.Join(e.dir, "west")
	issue := func(t *testing.T, ns, sa string) (int, apiv1.KubeconfigResponse) {
		t.Helper()
		status, body := e.postKubeconfig(t, west, fmt.Sprintf(`{"namespace":%q,"serviceAccount":%q}`, ns, sa))
		var resp apiv1.KubeconfigResponse
		if status == 201 {
			require.NoError(t, json.Unmarshal([]byte(body), &resp), body)
		}
		return status, resp
	}

	t.Run("a namespace created with the tenant label is grantable at once, without a restart", func(t *testing.T) {
		start := time.Now()
		tenantNamespace(t, c, "oil-a", map[string]string{tenantLabel: "oil"})
		var status int
		require.Eventually(t, func() bool { status, _ = issue(t, "oil-a", "runner"); return status == 201 },
			10*time.Second, 20*time.Millisecond, "last status %d", status)
		t.Logf("grantable %s after the namespace was created", time.Since(start).Round(time.Millisecond))
	})

	t.Run("whoami lists the namespaces a selector grant matches now", func(t *testing.T) {
		tenantNamespace(t, c, "oil-b", map[string]string{tenantLabel: "oil"})
		tenantNamespace(t, c, "gas-a", map[string]string{tenantLabel: "gas"})
		require.Eventually(t, func() bool {
			status, body, err := e.curl(t, west, "https://"+e.api+"/v1/whoami")
			require.NoError(t, err)
			require.Equal(t, 200, status, body)
			var who apiv1.WhoAmI
			require.NoError(t, json.Unmarshal([]byte(body), &who))
			g := who.Grants[1]
			require.Equal(t, "oil", g.Name)
			require.Equal(t, map[string]string{tenantLabel: "oil"}, g.NamespaceSelector.MatchLabels)
			return strings.Join(g.MatchingNamespaces, ",") == "oil-a,oil-b"
		}, 10*time.Second, 20*time.Millisecond)
	})

	t.Run("matchExpressions decide with In, NotIn, Exists and DoesNotExist", func(t *testing.T) {
		tenantNamespace(t, c, "tier-gold", map[string]string{"tier": "gold"})
		tenantNamespace(t, c, "tier-bronze", map[string]string{"tier": "bronze"})
		tenantNamespace(t, c, "tier-none", nil)
		for _, tc := range []struct {
			ns, sa string
			want   int
		}{
			{"tier-gold", "sa-in", 201}, {"tier-bronze", "sa-in", 403},
			{"tier-bronze", "sa-notin", 201}, {"tier-gold", "sa-notin", 403}, {"tier-none", "sa-notin", 201},
			{"tier-bronze", "sa-exists", 201}, {"tier-none", "sa-exists", 403},
			{"tier-none", "sa-absent", 201}, {"tier-gold", "sa-absent", 403},
		} {
			require.Eventually(t, func() bool { s, _ := issue(t, tc.ns, tc.sa); return s == tc.want },
				10*time.Second, 20*time.Millisecond, "%s/%s: want %d", tc.ns, tc.sa, tc.want)
		}
	})

	t.Run("removing the label refuses new requests and revokes the live lease; kubectl is refused after the token cache", func(t *testing.T) {
		status, resp := issue(t, "oil-a", "runner")
		require.Equal(t, 201, status)
		kc := writeFile(t, filepath.Join(t.TempDir(), "kubeconfig"), resp.Kubeconfig)
		run(t, kubectl, "--kubeconfig", kc, "get", "configmaps") // used now: in the API server's token cache

		removed := time.Now()
		setLabels(t, c, "oil-a", map[string]any{tenantLabel: nil})
		require.Eventually(t, func() bool { s, _ := issue(t, "oil-a", "runner"); return s == 403 }, 10*time.Second, 5*time.Millisecond)
		refused := time.Since(removed)
		require.Eventually(t, func() bool { return leaseGone(t, c, "oil-a", resp.LeaseID) }, 10*time.Second, 5*time.Millisecond)
		revoked := time.Since(removed)
		require.Eventually(t, func() bool {
			_, stderr, err := runErr(kubectl, "--kubeconfig", kc, "get", "configmaps")
			return err != nil && strings.Contains(stderr, "Unauthorized")
		}, 30*time.Second, 250*time.Millisecond, "the API server must refuse the token once its cache lets go")
		t.Logf("after the label was removed: new requests refused in %s, lease revoked in %s, kubectl refused in %s",
			refused.Round(time.Millisecond), revoked.Round(time.Millisecond), time.Since(removed).Round(time.Millisecond))

		var ev map[string]any
		for _, line := range strings.Split(e.proc.logs.String(), "\n") {
			if strings.Contains(line, `"audit"`) && strings.Contains(line, resp.LeaseID) && strings.Contains(line, `"action":"revoke"`) {
				require.NoError(t, json.Unmarshal([]byte(line), &ev))
			}
		}
		require.NotNil(t, ev, "the revocation is audited")
		require.Equal(t, "oil", ev["grant"])
		require.Contains(t, ev["reason"], "label_changed")
		require.NotContains(t, e.proc.logs.String(), resp.Token)
		metrics, _, err := runErr("curl", "-sS", "http://"+e.ops+"/metrics")
		require.NoError(t, err)
		// Two leases in oil-a: this one and the first subtest's.
		require.True(t, strings.Contains(metrics, `tokenbroker_unmatched_revocations_total{reason="label_changed"} 2`), "each revocation is counted")
	})

	t.Run("tokenbroker leases shows the grant a lease was issued under", func(t *testing.T) {
		status, resp := issue(t, "oil-b", "runner")
		require.Equal(t, 201, status)
		out := run(t, e.bin, "leases", "--kubeconfig", c.KubeconfigPath, "-n", "oil-b", "-o", "json")
		var recs []lease.Record
		require.NoError(t, json.Unmarshal([]byte(out), &recs), out)
		require.Len(t, recs, 1)
		require.Equal(t, resp.LeaseID, recs[0].ID)
		require.Equal(t, "oil", recs[0].Grant)
	})

	t.Run("a restarted API server (the informer lists again) revokes nothing, and later changes still count", func(t *testing.T) {
		status, resp := issue(t, "oil-b", "runner")
		require.Equal(t, 201, status)
		before := strings.Count(e.proc.logs.String(), "no longer covered by a grant")
		require.NoError(t, c.RestartAPIServer(context.Background()))
		require.Eventually(t, func() bool { s, _ := issue(t, "oil-b", "runner"); return s == 201 }, 60*time.Second, 100*time.Millisecond)
		require.Equal(t, before, strings.Count(e.proc.logs.String(), "no longer covered by a grant"), "no false revocation")
		require.False(t, leaseGone(t, c, "oil-b", resp.LeaseID))

		setLabels(t, c, "oil-b", map[string]any{tenantLabel: "gas"})
		require.Eventually(t, func() bool { return leaseGone(t, c, "oil-b", resp.LeaseID) }, 10*time.Second, 10*time.Millisecond)
	})

	t.Run("a policy reload that narrows the grant revokes the leases it no longer covers", func(t *testing.T) {
		tenantNamespace(t, c, "oil-dev", map[string]string{tenantLabel: "oil", "tier": "dev"})
		tenantNamespace(t, c, "oil-prod", map[string]string{tenantLabel: "oil", "tier": "prod"})
		var dev, prod apiv1.KubeconfigResponse
		var status int
		require.Eventually(t, func() bool { status, dev = issue(t, "oil-dev", "runner"); return status == 201 }, 10*time.Second, 20*time.Millisecond)
		status, prod = issue(t, "oil-prod", "runner")
		require.Equal(t, 201, status)

		narrowed := strings.Replace(tenantGrants, "matchLabels: {capsule.clastix.io/tenant: oil}", "matchLabels: {capsule.clastix.io/tenant: oil, tier: prod}", 1)
		writeFile(t, e.policy, base+strings.TrimPrefix(narrowed, "\n"))
		require.Eventually(t, func() bool { return leaseGone(t, c, "oil-dev", dev.LeaseID) }, 15*time.Second, 20*time.Millisecond)
		require.False(t, leaseGone(t, c, "oil-prod", prod.LeaseID), "a namespace the narrowed grant still covers keeps its lease")
		s, _ := issue(t, "oil-dev", "runner")
		require.Equal(t, 403, s)
		require.Contains(t, e.proc.logs.String(), "policy_narrowed")
	})
}

// TestTenantLabelAdmissionPolicy applies deploy/examples/tenant-label-admission-policy.yaml
// as it is and checks that only the tenant controller may set, change or
// remove the tenant label.
func TestTenantLabelAdmissionPolicy(t *testing.T) {
	c := testcluster.Start(t)
	kubectl := kubectlBinary(t)
	admin := []string{"--kubeconfig", c.KubeconfigPath}
	ctx := context.Background()
	run(t, kubectl, append(admin, "apply", "-f", filepath.Join(repoRoot(t), "deploy", "examples", "tenant-label-admission-policy.yaml"))...)

	// The tenant controller: Capsule's ServiceAccount, allowed by RBAC to
	// manage namespaces.
	run(t, kubectl, append(admin, "create", "namespace", "capsule-system")...)
	run(t, kubectl, append(admin, "-n", "capsule-system", "create", "serviceaccount", "capsule")...)
	run(t, kubectl, append(admin, "create", "clusterrole", "namespaces-admin", "--verb=get,list,create,update,patch", "--resource=namespaces")...)
	run(t, kubectl, append(admin, "create", "clusterrolebinding", "capsule-namespaces", "--clusterrole=namespaces-admin", "--serviceaccount=capsule-system:capsule")...)
	controller := []string{"--kubeconfig", serviceAccountKubeconfig(t, c, "capsule-system", "capsule")}
	// A user who may create namespaces (not the controller, no tenant
	// owner), and a tenant owner (in Capsule's user group), both by
	// impersonation.
	run(t, kubectl, append(admin, "create", "clusterrolebinding", "mallory-namespaces", "--clusterrole=namespaces-admin", "--user=mallory")...)
	run(t, kubectl, append(admin, "create", "clusterrolebinding", "tenant-owners-namespaces", "--clusterrole=namespaces-admin", "--group=projectcapsule.dev")...)
	mallory := append(append([]string{}, admin...), "--as=mallory")
	alice := append(append([]string{}, admin...), "--as=alice", "--as-group=projectcapsule.dev")

	// The policy takes effect asynchronously: wait until an admin is refused.
	var stderr string
	require.Eventually(t, func() bool {
		_, stderr, _ = runErr(kubectl, append(admin, "label", "namespace", "default", tenantLabel+"=oil", "--dry-run=server")...)
		return strings.Contains(stderr, "only the tenant controller may set")
	}, 30*time.Second, 200*time.Millisecond, "the admission policy never took effect: %s", stderr)

	const ownerPatch = `{"metadata":{"ownerReferences":[{"apiVersion":"capsule.clastix.io/v1beta2","kind":"Tenant","name":"oil","uid":"6f1f3c1e-2f0e-4a57-9d43-0c6b1f1d2a10"}]}}`
	for _, tc := range []struct {
		name    string
		as      []string
		args    []string
		allowed bool
	}{
		{"an administrator cannot make a Tenant the owner of a namespace", admin, []string{"patch", "namespace", "default", "--type=merge", "-p", ownerPatch}, false},
		{"the tenant controller can", controller, []string{"patch", "namespace", "default", "--type=merge", "-p", ownerPatch}, true},
		{"an administrator cannot take the Tenant's owner reference away", admin, []string{"patch", "namespace", "default", "--type=merge", "-p", `{"metadata":{"ownerReferences":null}}`}, false},
		{"the tenant controller can take it away", controller, []string{"patch", "namespace", "default", "--type=merge", "-p", `{"metadata":{"ownerReferences":null}}`}, true},
		{"a user who may create namespaces cannot create one owned by a Tenant", mallory, []string{"create-owned", "owned-by-mallory"}, false},
		{"nor can an administrator", admin, []string{"create-owned", "owned-by-admin"}, false},
		{"a tenant owner can: Capsule's webhook sets the owner reference in the owner's request", alice, []string{"create-owned", "owned-by-alice"}, true},
		{"the tenant controller can", controller, []string{"create-owned", "owned-by-controller"}, true},
		{"a user who may create namespaces still creates one owned by nothing", mallory, []string{"create-owned", "plain-by-mallory"}, true},
		{"an administrator cannot label a namespace into a tenant", admin, []string{"label", "namespace", "default", tenantLabel + "=oil"}, false},
		{"the tenant controller can", controller, []string{"label", "namespace", "default", tenantLabel + "=oil"}, true},
		{"an administrator cannot move it to another tenant", admin, []string{"label", "--overwrite", "namespace", "default", tenantLabel + "=gas"}, false},
		{"an administrator cannot take it out of its tenant", admin, []string{"label", "namespace", "default", tenantLabel + "-"}, false},
		{"other labels stay free for everyone", admin, []string{"label", "namespace", "default", "team=blue"}, true},
		{"an administrator cannot create a namespace in a tenant", admin, []string{"apply", "-f", "-"}, false},
		{"the tenant controller removes the label", controller, []string{"label", "namespace", "default", tenantLabel + "-"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append(append([]string{}, tc.as...), tc.args...)
			var err error
			var out, stderr string
			if tc.args[0] == "create-owned" {
				ns := "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: " + tc.args[1] + "\n"
				if !strings.HasPrefix(tc.args[1], "plain-") {
					ns += "  ownerReferences: [{apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: oil, uid: 6f1f3c1e-2f0e-4a57-9d43-0c6b1f1d2a10}]\n"
				}
				f := writeFile(t, filepath.Join(t.TempDir(), "owned.yaml"), ns)
				out, stderr, err = runErr(kubectl, append(append([]string{}, tc.as...), "create", "-f", f)...)
			} else if tc.args[0] == "apply" {
				f := writeFile(t, filepath.Join(t.TempDir(), "ns.yaml"), "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: sneaky\n  labels: {"+tenantLabel+": oil}\n")
				out, stderr, err = runErr(kubectl, append(append([]string{}, tc.as...), "apply", "-f", f)...)
			} else {
				out, stderr, err = runErr(kubectl, args...)
			}
			if tc.allowed {
				require.NoError(t, err, "%s%s", out, stderr)
				return
			}
			require.Error(t, err, out)
			if tc.args[0] == "patch" {
				require.Contains(t, stderr, "only the tenant controller may add, change or remove a namespace's owner reference to a Tenant")
				return
			}
			if tc.args[0] == "create-owned" {
				require.Contains(t, stderr, "only the tenant controller or a tenant owner may create a namespace owned by a Tenant")
				_, err := c.Client.CoreV1().Namespaces().Get(ctx, tc.args[1], metav1.GetOptions{})
				require.True(t, apierrors.IsNotFound(err), "refused, so not created")
				return
			}
			require.Contains(t, stderr, "only the tenant controller may set, change or remove the label")
		})
	}
	_, err := c.Client.CoreV1().Namespaces().Get(ctx, "sneaky", metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err))
}
