package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
	k8stesting "k8s.io/client-go/testing"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
)

var leasesNow = time.Date(2030, 5, 6, 12, 0, 0, 0, time.UTC)

// leaseSecret is a lease Secret as the broker makes it.
func leaseSecret(ns, id, peer, sa string, issuedAgo, expiresIn time.Duration) *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name: "tokenbroker-lease-" + id, Namespace: ns, UID: types.UID("uid-" + id),
			CreationTimestamp: metav1.NewTime(leasesNow.Add(-issuedAgo)),
			Labels: map[string]string{
				objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.LeaseKind,
				objects.LabelLeaseID: id, objects.LabelPeer: peer,
			},
			Annotations: map[string]string{
				objects.AnnotationExpiresAt: leasesNow.Add(expiresIn).Format(time.RFC3339),
				objects.AnnotationIdentity:  "spiffe://oc.example/cluster/" + peer,
				objects.AnnotationSA:        sa,
				objects.AnnotationCred:      "token",
			},
		},
		Type: objects.SecretTypeLease,
	}
}

// Lease ids have the broker's shape: 26 characters of a-z and 2-7.
const (
	idA = "aaaaaaaaaaaaaaaaaaaaaaaaaa"
	idB = "bbbbbbbbbbbbbbbbbbbbbbbbbb"
	idC = "cccccccccccccccccccccccccc"
	idD = "dddddddddddddddddddddddddd"
	idE = "eeeeeeeeeeeeeeeeeeeeeeeeee"
)

func leasesClientset() *fake.Clientset {
	noExpiry := leaseSecret("flux", idE, "west", "reconciler", 3*time.Hour, 0)
	delete(noExpiry.Annotations, objects.AnnotationExpiresAt)
	return fake.NewClientset(
		leaseSecret("argo", idB, "west", "admiralty-source", 12*time.Minute, 48*time.Minute),
		leaseSecret("argo", idA, "south", "admiralty-source", 2*time.Hour, -time.Minute),
		leaseSecret("argo", idC, "west", "runner", 5*time.Minute, 55*time.Minute),
		leaseSecret("argocd", idD, "north", "argocd-manager", 26*time.Hour, 22*time.Hour),
		noExpiry,
		// Not leases: a used join token record and someone else's Secret.
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "used", Namespace: "tokenbroker", Labels: map[string]string{
			objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.UsedJoinTokenKind}}},
		&corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "db", Namespace: "argo"}},
	)
}

func runLeasesFor(t *testing.T, cs *fake.Clientset, o leasesOptions) (stdout, stderr string, err error) {
	t.Helper()
	if o.Output == "" {
		o.Output = "table"
	}
	if err := o.validate(); err != nil {
		return "", "", err
	}
	var out, errOut bytes.Buffer
	err = runLeases(context.Background(), cs.CoreV1(), o, &out, &errOut, leasesNow)
	return out.String(), errOut.String(), err
}

func TestLeasesTableIsSortedWithRelativeTimes(t *testing.T) {
	t.Parallel()
	out, _, err := runLeasesFor(t, leasesClientset(), leasesOptions{})
	require.NoError(t, err)
	// Ages as kubectl shows them (minutes up to 3h).
	want := `NAMESPACE   SERVICEACCOUNT     PEER    IDENTITY                            LEASE                        ISSUED     EXPIRES
argo        admiralty-source   south   spiffe://oc.example/cluster/south   aaaaaaaaaaaaaaaaaaaaaaaaaa   120m ago   expired
argo        admiralty-source   west    spiffe://oc.example/cluster/west    bbbbbbbbbbbbbbbbbbbbbbbbbb   12m ago    in 48m
argo        runner             west    spiffe://oc.example/cluster/west    cccccccccccccccccccccccccc   5m ago     in 55m
argocd      argocd-manager     north   spiffe://oc.example/cluster/north   dddddddddddddddddddddddddd   26h ago    in 22h
flux        reconciler         west    spiffe://oc.example/cluster/west    eeeeeeeeeeeeeeeeeeeeeeeeee   3h ago     <unknown>
`
	require.Equal(t, want, out)
}

func TestLeasesAnswersWhoHoldsACredentialForAServiceAccount(t *testing.T) {
	t.Parallel()
	cs := leasesClientset()
	for _, o := range []leasesOptions{
		{Namespace: "argo", ServiceAccount: "admiralty-source"},
		{ServiceAccount: "argo/admiralty-source"},
	} {
		out, _, err := runLeasesFor(t, cs, o)
		require.NoError(t, err)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		require.Len(t, lines, 3, out)
		require.Contains(t, lines[1], "south")
		require.Contains(t, lines[2], "west")
		require.Contains(t, lines[2], idB)
		require.Contains(t, lines[2], "12m ago")
	}

	out, _, err := runLeasesFor(t, cs, leasesOptions{Peer: "west", Output: "json"})
	require.NoError(t, err)
	var recs []lease.Record
	require.NoError(t, json.Unmarshal([]byte(out), &recs))
	require.Len(t, recs, 3)
	for _, r := range recs {
		require.Equal(t, "west", r.Peer)
	}
}

func TestLeasesWideAndJSONCarryAbsoluteTimesAndTheCredential(t *testing.T) {
	t.Parallel()
	cs := leasesClientset()
	out, _, err := runLeasesFor(t, cs, leasesOptions{Namespace: "argocd", Output: "wide"})
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 2)
	require.Equal(t, []string{"NAMESPACE", "SERVICEACCOUNT", "PEER", "IDENTITY", "LEASE", "ISSUED", "EXPIRES", "CREDENTIAL", "GRANT", "ISSUED-AT", "EXPIRES-AT", "WORKLOAD"}, strings.Fields(lines[0]))
	require.Equal(t, []string{"argocd", "argocd-manager", "north", "spiffe://oc.example/cluster/north", idD, "26h", "ago", "in", "22h", "token", "<none>",
		"2030-05-05T10:00:00Z", "2030-05-07T10:00:00Z", "<none>"}, strings.Fields(lines[1]))

	out, _, err = runLeasesFor(t, cs, leasesOptions{Output: "json"})
	require.NoError(t, err)
	var raw []map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &raw))
	require.Len(t, raw, 5)
	require.Equal(t, map[string]any{
		"id": idA, "peer": "south", "identity": "spiffe://oc.example/cluster/south", "namespace": "argo",
		"serviceAccount": "admiralty-source", "credential": "token",
		"createdAt": "2030-05-06T10:00:00Z", "expiresAt": "2030-05-06T11:59:00Z", "expired": true,
		"secret": "tokenbroker-lease-" + idA,
	}, raw[0])
	require.NotContains(t, raw[4], "expiresAt", "an unreadable expiry is left out")
}

func TestNoLeasesIsSaidOnStderrAndAnEmptyJSONArrayOnStdout(t *testing.T) {
	t.Parallel()
	cs := leasesClientset()
	out, errOut, err := runLeasesFor(t, cs, leasesOptions{Namespace: "kube-system"})
	require.NoError(t, err)
	require.Empty(t, out)
	require.Equal(t, "No leases.\n", errOut)

	out, _, err = runLeasesFor(t, cs, leasesOptions{Peer: "nobody", Output: "json"})
	require.NoError(t, err)
	require.Equal(t, "[]\n", out)
}

func TestLeasesSaysWhichPermissionIsMissing(t *testing.T) {
	t.Parallel()
	cs := leasesClientset()
	cs.PrependReactor("list", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "secrets"}, "",
			errFromString(`User "jane" cannot list resource "secrets" in API group "" at the cluster scope`))
	})
	_, _, err := runLeasesFor(t, cs, leasesOptions{})
	require.ErrorContains(t, err, "permission missing: list secrets in every namespace (check with: kubectl auth can-i list secrets --all-namespaces)")
	require.ErrorContains(t, err, `User "jane" cannot list`)

	_, _, err = runLeasesFor(t, cs, leasesOptions{Namespace: "argo"})
	require.ErrorContains(t, err, "permission missing: list secrets in namespace argo (check with: kubectl auth can-i list secrets -n argo)")
}

type errFromString string

func (e errFromString) Error() string { return string(e) }

func TestLeasesOptionsAreChecked(t *testing.T) {
	t.Parallel()
	for _, o := range []leasesOptions{
		{Namespace: "argo", AllNamespaces: true, Output: "table"},
		{Namespace: "argo", ServiceAccount: "flux/reconciler", Output: "table"},
		{AllNamespaces: true, ServiceAccount: "flux/reconciler", Output: "table"},
		{Output: "yaml"},
	} {
		require.Error(t, o.validate(), "%+v", o)
	}
}

func TestLeasesRevokeDeletesTheLeaseSecretsAndSaysWhat(t *testing.T) {
	t.Parallel()
	cs := leasesClientset()
	ctx := context.Background()
	var out bytes.Buffer
	err := runLeasesRevoke(ctx, &lease.Deleter{Secrets: cs.CoreV1(), RoleBindings: cs.RbacV1()}, "argo", []string{idB, idD, "not-an-id"}, &out, leasesNow)
	require.ErrorContains(t, err, "lease "+idD+" not found in namespace argo")
	require.ErrorContains(t, err, `"not-an-id" is not a lease id`)
	require.Equal(t, "revoked lease "+idB+": argo/admiralty-source held by peer west (spiffe://oc.example/cluster/west), issued 12m ago; Secret tokenbroker-lease-"+idB+" deleted, the API server rejects its token within about 10s\n", out.String())
	_, err = cs.CoreV1().Secrets("argo").Get(ctx, "tokenbroker-lease-"+idB, metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "%v", err)

	// Without -n, every namespace is searched.
	out.Reset()
	require.NoError(t, runLeasesRevoke(ctx, &lease.Deleter{Secrets: cs.CoreV1(), RoleBindings: cs.RbacV1()}, "", []string{idD}, &out, leasesNow))
	require.Contains(t, out.String(), "revoked lease "+idD+": argocd/argocd-manager")

	// The other leases are untouched.
	list, err := cs.CoreV1().Secrets("").List(ctx, metav1.ListOptions{LabelSelector: objects.LabelKind + "=" + objects.LeaseKind})
	require.NoError(t, err)
	require.Len(t, list.Items, 3)
}

// A lease is found by its name, which holds its id: one whose labels a
// tenant stripped (the lease-id label, or all of them) is still revoked.
func TestLeasesRevokeFindsALeaseStrippedOfItsLabels(t *testing.T) {
	t.Parallel()
	stripped := leaseSecret("argo", idB, "west", "admiralty-source", 12*time.Minute, 48*time.Minute)
	stripped.Labels = nil
	cs := fake.NewClientset(stripped)
	var out bytes.Buffer
	require.NoError(t, runLeasesRevoke(context.Background(), &lease.Deleter{Secrets: cs.CoreV1(), RoleBindings: cs.RbacV1()}, "", []string{idB}, &out, leasesNow))
	require.Contains(t, out.String(), "revoked lease "+idB+": argo/admiralty-source")
	_, err := cs.CoreV1().Secrets("argo").Get(context.Background(), stripped.Name, metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "%v", err)
}

// A client certificate's lease is revoked as the broker revokes it: its
// RoleBinding, the certificate's only permission, first, and only one the
// lease owns.
func TestLeasesRevokeDeletesACertificatesRoleBindingFirst(t *testing.T) {
	t.Parallel()
	s := leaseSecret("argo", idB, "west", "admiralty-source", 12*time.Minute, 48*time.Minute)
	s.UID = "uid-b"
	s.Annotations[objects.AnnotationCred] = apiv1.CredentialClientCertificate
	owned := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: s.Name, UID: "rb",
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Secret", Name: s.Name, UID: s.UID}}}}
	cs := fake.NewClientset(s, owned)
	var out bytes.Buffer
	require.NoError(t, runLeasesRevoke(context.Background(), &lease.Deleter{Secrets: cs.CoreV1(), RoleBindings: cs.RbacV1()}, "argo", []string{idB}, &out, leasesNow))
	_, err := cs.RbacV1().RoleBindings("argo").Get(context.Background(), s.Name, metav1.GetOptions{})
	require.True(t, apierrors.IsNotFound(err), "the RoleBinding is deleted: %v", err)
	var order []string
	for _, a := range cs.Actions() {
		if a.GetVerb() == "delete" {
			order = append(order, a.GetResource().Resource)
		}
	}
	require.Equal(t, []string{"rolebindings", "secrets"}, order, "the binding first")

	// A binding of the lease's name that the lease does not own stays.
	s2 := leaseSecret("argo", idC, "west", "runner", 5*time.Minute, 55*time.Minute)
	s2.UID = "uid-c"
	s2.Annotations[objects.AnnotationCred] = apiv1.CredentialClientCertificate
	cs = fake.NewClientset(s2, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: s2.Name}})
	require.NoError(t, runLeasesRevoke(context.Background(), &lease.Deleter{Secrets: cs.CoreV1(), RoleBindings: cs.RbacV1()}, "argo", []string{idC}, new(bytes.Buffer), leasesNow))
	_, err = cs.RbacV1().RoleBindings("argo").Get(context.Background(), s2.Name, metav1.GetOptions{})
	require.NoError(t, err, "not the lease's to delete")
}

// A tenant's Secret that carries a lease's labels but is not of the lease
// type is not the broker's: revoking that id leaves it, and its
// RoleBinding, alone, and says so.
func TestLeasesRevokeLeavesAForgedLeaseAlone(t *testing.T) {
	t.Parallel()
	forged := leaseSecret("argo", idB, "west", "admiralty-source", 12*time.Minute, 48*time.Minute)
	forged.Type = corev1.SecretTypeOpaque
	forged.Annotations[objects.AnnotationCred] = apiv1.CredentialClientCertificate
	rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: "argo", Name: forged.Name,
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Secret", Name: forged.Name, UID: forged.UID}}}}
	cs := fake.NewClientset(forged, rb)
	var out bytes.Buffer
	err := runLeasesRevoke(context.Background(), &lease.Deleter{Secrets: cs.CoreV1(), RoleBindings: cs.RbacV1()}, "argo", []string{idB}, &out, leasesNow)
	require.ErrorContains(t, err, "is not a lease Secret (type Opaque); left alone")
	require.Empty(t, out.String())
	_, err = cs.CoreV1().Secrets("argo").Get(context.Background(), forged.Name, metav1.GetOptions{})
	require.NoError(t, err)
	_, err = cs.RbacV1().RoleBindings("argo").Get(context.Background(), forged.Name, metav1.GetOptions{})
	require.NoError(t, err)
}

func TestLeasesRevokeSaysWhichPermissionIsMissing(t *testing.T) {
	t.Parallel()
	cs := leasesClientset()
	cs.PrependReactor("delete", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "secrets"}, "x", errFromString("no"))
	})
	err := runLeasesRevoke(context.Background(), &lease.Deleter{Secrets: cs.CoreV1(), RoleBindings: cs.RbacV1()}, "argo", []string{idB}, new(bytes.Buffer), leasesNow)
	require.ErrorContains(t, err, "permission missing: delete secrets in namespace argo")
}

// pagedClientset is a clientset whose Secret lists come in pages of one, as
// the API server pages them with a Limit, so that each page is printed on
// its own. It records the requests' limits.
func pagedClientset(secrets ...*corev1.Secret) (*fake.Clientset, *[]int64) {
	cs := fake.NewClientset()
	var limits []int64
	cs.PrependReactor("list", "secrets", func(a k8stesting.Action) (bool, runtime.Object, error) {
		opts := a.(k8stesting.ListActionImpl).ListOptions
		limits = append(limits, opts.Limit)
		i := 0
		if opts.Continue != "" {
			i = int(opts.Continue[0] - '0')
		}
		list := &corev1.SecretList{Items: []corev1.Secret{*secrets[i]}}
		if i+1 < len(secrets) {
			list.Continue = string(rune('0' + i + 1))
		}
		return true, list, nil
	})
	return cs, &limits
}

func TestLeasesAreReadAndPrintedPageByPage(t *testing.T) {
	t.Parallel()
	pages := []*corev1.Secret{
		leaseSecret("argo", idB, "west", "admiralty-source", 12*time.Minute, 48*time.Minute),
		leaseSecret("flux", idE, "west", "reconciler", 3*time.Hour, time.Hour),
		leaseSecret("kargo", idC, "west", "promoter", time.Minute, time.Hour),
	}

	t.Run("A table has one header and every page's leases, in the API server's order.", func(t *testing.T) {
		t.Parallel()
		cs, limits := pagedClientset(pages...)
		out, _, err := runLeasesFor(t, cs, leasesOptions{})
		require.NoError(t, err)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		require.Len(t, lines, 4, out)
		require.True(t, strings.HasPrefix(lines[0], "NAMESPACE"))
		for i, ns := range []string{"argo", "flux", "kargo"} {
			require.True(t, strings.HasPrefix(lines[i+1], ns+" "), lines[i+1])
		}
		require.Equal(t, []int64{lease.SecretPageSize, lease.SecretPageSize, lease.SecretPageSize}, *limits)
	})

	t.Run("JSON is one array of every page's leases.", func(t *testing.T) {
		t.Parallel()
		cs, _ := pagedClientset(pages...)
		out, _, err := runLeasesFor(t, cs, leasesOptions{Output: "json"})
		require.NoError(t, err)
		var records []lease.Record
		require.NoError(t, json.Unmarshal([]byte(out), &records))
		require.Len(t, records, 3)
		require.Equal(t, []string{idB, idE, idC}, []string{records[0].ID, records[1].ID, records[2].ID})
		all, err := json.MarshalIndent(records, "", "  ")
		require.NoError(t, err)
		require.Equal(t, string(all)+"\n", out, "indented as one encoded slice")
	})
}

func TestLeasesCommandsAreNotHeldBackByClientGosDefaultLimit(t *testing.T) {
	t.Parallel()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443"}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600))
	secrets, err := adminSecrets(kubeconfig, "")
	require.NoError(t, err)
	limiter := secrets.(interface{ RESTClient() rest.Interface }).RESTClient().GetRateLimiter()
	require.Equal(t, float32(leasesKubeQPS), limiter.QPS(), "a walk of 100 pages is not stretched to 18 s")
}
