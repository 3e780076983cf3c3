package e2e

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestLeasesCommandShowsWhoHoldsACredentialAndRevokesIt runs the admin
// commands of docs/operations.md ("Who holds a credential") against a real
// API server and a broker: "tokenbroker leases", the kubectl equivalent and
// the audit query as the document prints them, and "tokenbroker leases
// revoke", after which the token stops working.
func TestLeasesCommandShowsWhoHoldsACredentialAndRevokesIt(t *testing.T) {
	c := testcluster.Start(t)
	setUpTarget(t, c)
	e := startBroker(t, c)
	bin := e.bin
	kubectl := kubectlBinary(t)
	admin := c.KubeconfigPath
	west := filepath.Join(e.dir, "west")

	issue := func(t *testing.T) apiv1.KubeconfigResponse {
		t.Helper()
		status, body := e.postKubeconfig(t, west, `{"namespace":"argo","serviceAccount":"runner","ttl":"2h"}`)
		require.Equal(t, 201, status, body)
		var resp apiv1.KubeconfigResponse
		require.NoError(t, json.Unmarshal([]byte(body), &resp))
		return resp
	}
	first, second := issue(t), issue(t)
	issuedAt := func(t *testing.T, id string) string {
		t.Helper()
		list, err := c.Client.CoreV1().Secrets("argo").List(context.Background(), metav1.ListOptions{LabelSelector: "tokenbroker.io/lease-id=" + id})
		require.NoError(t, err)
		require.Len(t, list.Items, 1)
		return list.Items[0].CreationTimestamp.UTC().Format(time.RFC3339)
	}

	t.Run("the table names the peer, the lease and since when, for one ServiceAccount", func(t *testing.T) {
		out := run(t, bin, "leases", "-n", "argo", "--service-account", "runner", "--kubeconfig", admin)
		t.Logf("tokenbroker leases -n argo --service-account runner:\n%s", out)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		require.Len(t, lines, 3, out)
		require.Equal(t, []string{"NAMESPACE", "SERVICEACCOUNT", "PEER", "IDENTITY", "LEASE", "ISSUED", "EXPIRES"}, strings.Fields(lines[0]))
		// Sorted by issue time (whole seconds: the two may straddle one),
		// then by id.
		ids := []string{first.LeaseID, second.LeaseID}
		slices.SortFunc(ids, func(a, b string) int {
			return cmp.Or(strings.Compare(issuedAt(t, a), issuedAt(t, b)), strings.Compare(a, b))
		})
		for i, id := range ids {
			f := strings.Fields(lines[i+1])
			require.Equal(t, []string{"argo", "runner", "west", "spiffe://e2e.example/cluster/west", id}, f[:5])
			require.Equal(t, "ago", f[6])
			require.Equal(t, "in", f[7])
			require.Contains(t, []string{"119m", "120m"}, f[8], "a 2h lease")
		}

		out = run(t, bin, "leases", "-n", "argo", "-o", "wide", "--kubeconfig", admin)
		require.Contains(t, out, issuedAt(t, first.LeaseID), "the absolute issue time")
		require.Contains(t, out, first.ExpiresAt.UTC().Format(time.RFC3339))
		require.Contains(t, out, "token")
	})

	t.Run("-o json parses and matches the lease Secrets and the broker's answers", func(t *testing.T) {
		out := run(t, bin, "leases", "--service-account", "argo/runner", "-o", "json", "--kubeconfig", admin)
		var recs []leaseJSON
		require.NoError(t, json.Unmarshal([]byte(out), &recs), out)
		require.Len(t, recs, 2)
		i := slices.IndexFunc(recs, func(r leaseJSON) bool { return r.ID == first.LeaseID })
		require.GreaterOrEqual(t, i, 0, out)
		r := recs[i]
		require.Equal(t, "west", r.Peer)
		require.Equal(t, "spiffe://e2e.example/cluster/west", r.Identity)
		require.Equal(t, "argo", r.Namespace)
		require.Equal(t, "runner", r.ServiceAccount)
		require.Equal(t, "token", r.Credential)
		require.Equal(t, "tokenbroker-lease-"+first.LeaseID, r.Secret)
		require.Equal(t, issuedAt(t, first.LeaseID), r.CreatedAt.Format(time.RFC3339))
		require.True(t, first.ExpiresAt.Equal(r.ExpiresAt), "%s vs %s", first.ExpiresAt, r.ExpiresAt)
		require.False(t, r.Expired)
	})

	t.Run("every namespace is the default, and $KUBECONFIG is read like kubectl reads it", func(t *testing.T) {
		out, errOut, err := runWithEnv([]string{"KUBECONFIG=" + admin}, bin, "leases")
		require.NoError(t, err, errOut)
		require.Contains(t, out, first.LeaseID)
		_, errOut, err = runWithEnv([]string{"KUBECONFIG=" + admin}, bin, "leases", "-n", "kube-system")
		require.NoError(t, err, errOut)
		require.Equal(t, "No leases.\n", errOut)
	})

	t.Run("the shell completes the lease ids of leases revoke", func(t *testing.T) {
		out := run(t, bin, "__complete", "leases", "revoke", "-n", "argo", "--kubeconfig", admin, "")
		require.Contains(t, out, first.LeaseID+"\targo/runner, peer west")
		require.Contains(t, out, second.LeaseID)
	})

	t.Run("the kubectl command of docs/operations.md shows the same", func(t *testing.T) {
		line := docLine(t, "docs/operations.md", "kubectl get secrets -n argo -l tokenbroker.io/kind=lease")
		out := runDocLine(t, kubectl, admin, strings.ReplaceAll(line, "admiralty-source", "runner"), "")
		t.Logf("%s\n%s", line, out)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		require.Len(t, lines, 3, out)
		require.Equal(t, []string{"SERVICEACCOUNT", "PEER", "IDENTITY", "LEASE", "ISSUED", "EXPIRES"}, strings.Fields(lines[0]))
		var row []string
		for _, l := range lines[1:] {
			if strings.Contains(l, first.LeaseID) {
				row = strings.Fields(l)
			}
		}
		require.Equal(t, []string{"runner", "west", "spiffe://e2e.example/cluster/west", first.LeaseID,
			issuedAt(t, first.LeaseID), first.ExpiresAt.UTC().Format(time.RFC3339)}, row)
	})

	t.Run("the audit query of docs/operations.md finds the issuance of the lease", func(t *testing.T) {
		line := docLine(t, "docs/operations.md", "kubectl logs -n tokenbroker -l app.kubernetes.io/name=tokenbroker")
		_, query, ok := strings.Cut(line, " | ")
		require.True(t, ok, line)
		query = strings.ReplaceAll(query, "admiralty-source", "runner")
		var out string
		require.Eventually(t, func() bool {
			out = runDocLine(t, kubectl, admin, query, e.proc.logs.String())
			return strings.Contains(out, second.LeaseID)
		}, 5*time.Second, 50*time.Millisecond, "%s found nothing", query)
		var events []map[string]any
		for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
			var ev map[string]any
			require.NoError(t, json.Unmarshal([]byte(l), &ev), l)
			events = append(events, ev)
		}
		require.Len(t, events, 2, out)
		for i, resp := range []apiv1.KubeconfigResponse{first, second} {
			require.Equal(t, resp.LeaseID, events[i]["lease_id"])
			require.Equal(t, "west", events[i]["peer"])
			require.Equal(t, "spiffe://e2e.example/cluster/west", events[i]["identity"])
			require.NotEmpty(t, events[i]["token_jti"])
		}
	})

	t.Run("leases revoke deletes the lease and the token stops working", func(t *testing.T) {
		kc := filepath.Join(t.TempDir(), "kubeconfig")
		require.NoError(t, os.WriteFile(kc, []byte(first.Kubeconfig), 0o600))
		run(t, kubectl, "--kubeconfig", kc, "auth", "whoami")

		out := run(t, bin, "leases", "revoke", "-n", "argo", first.LeaseID, "--kubeconfig", admin)
		t.Logf("tokenbroker leases revoke:\n%s", out)
		require.Contains(t, out, "revoked lease "+first.LeaseID+": argo/runner held by peer west (spiffe://e2e.example/cluster/west)")
		start := time.Now()
		require.Eventually(t, func() bool { return !tokenValid(t, c, first.Token) }, 20*time.Second, 100*time.Millisecond,
			"the token of a revoked lease still authenticates")
		t.Logf("token rejected %s after the revocation", time.Since(start).Round(time.Millisecond))
		_, stderr, err := runErr(kubectl, "--kubeconfig", kc, "auth", "whoami")
		require.Error(t, err)
		require.Contains(t, stderr, "Unauthorized")

		out = run(t, bin, "leases", "-n", "argo", "--kubeconfig", admin)
		require.NotContains(t, out, first.LeaseID)
		require.Contains(t, out, second.LeaseID, "the other lease is untouched")
		require.True(t, tokenValid(t, c, second.Token))

		_, stderr, err = runErr(bin, "leases", "revoke", "-n", "argo", first.LeaseID, "--kubeconfig", admin)
		require.Error(t, err, "a lease that is gone")
		require.Contains(t, stderr, "lease "+first.LeaseID+" not found in namespace argo")
	})

	t.Run("the kubectl revocation of docs/operations.md works too", func(t *testing.T) {
		line := docLine(t, "docs/operations.md", "kubectl delete secret -n argo tokenbroker-lease-")
		runDocLine(t, kubectl, admin, strings.ReplaceAll(line, "q3fcxb7kumyz4pa2m6dxx5jnle", second.LeaseID), "")
		require.Eventually(t, func() bool { return !tokenValid(t, c, second.Token) }, 20*time.Second, 100*time.Millisecond)
		_, errOut, err := runErr(bin, "leases", "--kubeconfig", admin)
		require.NoError(t, err)
		require.Equal(t, "No leases.\n", errOut)
	})

	t.Run("a kubeconfig that may not list Secrets gets an error that names the permission", func(t *testing.T) {
		ctx := context.Background()
		_, err := c.Client.CoreV1().ServiceAccounts("default").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "auditor"}}, metav1.CreateOptions{})
		require.NoError(t, err)
		kc := serviceAccountKubeconfig(t, c, "default", "auditor")

		_, stderr, err := runErr(bin, "leases", "--kubeconfig", kc)
		require.Error(t, err)
		t.Logf("tokenbroker leases without the permission: %s", stderr)
		require.Contains(t, stderr, "permission missing: list secrets in every namespace (check with: kubectl auth can-i list secrets --all-namespaces)")
		require.Contains(t, stderr, `cannot list resource "secrets"`)

		// Allowed in argo only: -n argo works, every namespace still does not.
		_, err = c.Client.RbacV1().Roles("argo").Create(ctx, &rbacv1.Role{
			ObjectMeta: metav1.ObjectMeta{Name: "lease-reader"},
			Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"list"}}},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		_, err = c.Client.RbacV1().RoleBindings("argo").Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Name: "auditor-lease-reader"},
			RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "lease-reader"},
			Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "auditor", Namespace: "default"}},
		}, metav1.CreateOptions{})
		require.NoError(t, err)
		third := issue(t)
		require.Eventually(t, func() bool {
			out, _, err := runErr(bin, "leases", "-n", "argo", "--kubeconfig", kc)
			return err == nil && strings.Contains(out, third.LeaseID)
		}, 10*time.Second, 100*time.Millisecond, "RBAC in argo lets it list the leases there")

		_, stderr, err = runErr(bin, "leases", "revoke", "-n", "argo", third.LeaseID, "--kubeconfig", kc)
		require.Error(t, err)
		require.Contains(t, stderr, "permission missing: delete secrets in namespace argo")
		require.True(t, tokenValid(t, c, third.Token), "nothing was revoked")
	})
}

// leaseJSON is one lease of "tokenbroker leases -o json".
type leaseJSON struct {
	ID, Peer, Identity, Namespace, ServiceAccount, Credential, Secret string
	CreatedAt, ExpiresAt                                              time.Time
	Expired                                                           bool
}

// docLine returns the one line of a document that starts with prefix.
func docLine(t *testing.T, doc, prefix string) string {
	t.Helper()
	var found []string
	for _, l := range strings.Split(readDoc(t, doc), "\n") {
		if strings.HasPrefix(l, prefix) {
			found = append(found, l)
		}
	}
	require.Len(t, found, 1, "%s: lines starting with %q", doc, prefix)
	return found[0]
}

// runDocLine runs a documented shell command line with bash, with kubectl
// (the harness's) first on PATH and KUBECONFIG set to kubeconfig, and stdin
// as its input.
func runDocLine(t *testing.T, kubectl, kubeconfig, line, stdin string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-o", "pipefail", "-c", line)
	cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(kubectl)+string(os.PathListSeparator)+os.Getenv("PATH"), "KUBECONFIG="+kubeconfig)
	cmd.Stdin = strings.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "%s\nstdout: %s\nstderr: %s", line, stdout.String(), stderr.String())
	return stdout.String()
}

// runWithEnv is runErr with extra environment variables.
func runWithEnv(env []string, name string, args ...string) (string, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	return stdout.String(), stderr.String(), err
}
