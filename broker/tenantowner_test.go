package broker

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/broker/tenants"
)

// Grants whose namespaces must also be owned by a named object
// (namespaceOwner); test/integration/tenants_test.go relabels a namespace
// as a user who does not own it against a real kube-apiserver.

func tenantRef(apiVersion, uid string) metav1.OwnerReference {
	return metav1.OwnerReference{APIVersion: apiVersion, Kind: "Tenant", Name: "oil", UID: types.UID(uid)}
}

// setOwned is fakeNamespaces.set with owner references.
func (f *fakeNamespaces) setOwned(name string, lbls map[string]string, owners ...metav1.OwnerReference) {
	f.mu.Lock()
	defer f.mu.Unlock()
	obj := nsMeta(name, lbls)
	obj.OwnerReferences = owners
	old, exists, _ := f.store.GetByKey(name)
	_ = f.store.Update(obj)
	for _, h := range f.handlers {
		if exists {
			h.OnUpdate(old, obj)
		} else {
			h.OnAdd(obj, false)
		}
	}
}

func TestNamespaceOwnerIsValidatedWithFieldPaths(t *testing.T) {
	t.Parallel()
	const head = "cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n"
	const sel = "name: t, namespaceSelector: {matchLabels: {tenant: oil}}, serviceAccounts: [sa]"
	tests := []struct{ name, owner, want string }{
		{"a Capsule Tenant by group/version, kind, name and UID is valid", "{apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: oil, uid: " + tenantUID + "}", ""},
		{"an owner of the core group is valid", "{apiVersion: v1, kind: Namespace, name: parent, uid: " + strings.ToUpper(tenantUID) + "}", ""},
		{"the UID is required: a name alone is claimed by whoever recreates it", "{apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: oil}",
			"peers[0].grants[0].namespaceOwner.uid: is required"},
		{"a UID that is no UUID is refused", "{apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: oil, uid: 'oil'}",
			"peers[0].grants[0].namespaceOwner.uid: must be a UID as Kubernetes writes it"},
		{"the kind is required", "{apiVersion: capsule.clastix.io/v1beta2, name: oil, uid: " + tenantUID + "}",
			"peers[0].grants[0].namespaceOwner.kind: is required"},
		{"a kind with a slash is refused", "{apiVersion: capsule.clastix.io/v1beta2, kind: 'Ten/ant', name: oil, uid: " + tenantUID + "}",
			"peers[0].grants[0].namespaceOwner.kind: must be a Kubernetes kind"},
		{"the apiVersion is required", "{kind: Tenant, name: oil, uid: " + tenantUID + "}",
			"peers[0].grants[0].namespaceOwner.apiVersion: is required"},
		{"an apiVersion with two slashes is refused", "{apiVersion: a/b/c, kind: Tenant, name: oil, uid: " + tenantUID + "}",
			"peers[0].grants[0].namespaceOwner.apiVersion: must be group/version"},
		{"a group that is no DNS subdomain is refused", "{apiVersion: 'Capsule_IO/v1', kind: Tenant, name: oil, uid: " + tenantUID + "}",
			"peers[0].grants[0].namespaceOwner.apiVersion: the group must be a DNS subdomain"},
		{"the name is required", "{apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, uid: " + tenantUID + "}",
			"peers[0].grants[0].namespaceOwner.name: is required"},
		{"a name that no object can have is refused", "{apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: 'Oil Co', uid: " + tenantUID + "}",
			"peers[0].grants[0].namespaceOwner.name: a lowercase RFC 1123 subdomain"},
		{"an unknown key is refused, so a typo never drops the owner", "{apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: oil, uuid: " + tenantUID + "}",
			`unknown field "uuid"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := policy.Parse([]byte(head + "  - {" + sel + ", namespaceOwner: " + tt.owner + "}\n"))
			if tt.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tt.want)
		})
	}
	t.Run("a grant by name only has no owner: its namespaces are granted by name", func(t *testing.T) {
		t.Parallel()
		_, err := policy.Parse([]byte(head + "  - {namespaces: [a], serviceAccounts: [sa], namespaceOwner: {apiVersion: v1, kind: Namespace, name: p, uid: " + tenantUID + "}}\n"))
		require.ErrorContains(t, err, "peers[0].grants[0].namespaceOwner: only a grant with namespaceSelector has one")
	})
}

func TestAGrantWithANamespaceOwnerTakesOnlyTheNamespacesItOwns(t *testing.T) {
	t.Parallel()
	e := newTenantEnv(t, ownedPolicy, nil)
	e.nss.setOwned("oil-dev", oil, tenantRef("capsule.clastix.io/v1beta2", tenantUID))
	e.nss.setOwned("oil-old", oil, tenantRef("capsule.clastix.io/v1beta1", tenantUID))
	e.nss.setOwned("kube-system", oil) // labelled by someone who may patch namespaces
	e.nss.setOwned("imposter", oil, tenantRef("capsule.clastix.io/v1beta2", "00000000-0000-0000-0000-000000000000"))
	e.nss.setOwned("other-group", oil, tenantRef("evil.example.com/v1beta2", tenantUID))
	e.nss.setOwned("unlabelled", nil, tenantRef("capsule.clastix.io/v1beta2", tenantUID))

	tests := []struct {
		name, ns string
		granted  bool
	}{
		{"a namespace with the label and the Tenant's owner reference is granted", "oil-dev", true},
		{"the owner reference's version does not matter, its group does", "oil-old", true},
		{"a namespace labelled into the tenant without the owner reference is refused", "kube-system", false},
		{"an owner reference of the same name with another UID is refused", "imposter", false},
		{"an owner reference with the UID in another group is refused", "other-group", false},
		{"the owner without the label is refused: both are needed", "unlabelled", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := e.b.IssueKubeconfig(context.Background(), west, apiv1.KubeconfigRequest{Namespace: tt.ns, ServiceAccount: "gitops-reconciler"})
			if tt.granted {
				require.NoError(t, err)
				return
			}
			require.Equal(t, problem.KindForbidden, problem.KindOf(err))
		})
	}
	t.Run("whoami lists the owned namespaces only, and the owner", func(t *testing.T) {
		t.Parallel()
		_, grants := e.b.WhoAmI(west)
		require.Equal(t, []string{"oil-dev", "oil-old"}, grants[0].MatchingNamespaces)
		require.Equal(t, &apiv1.NamespaceOwner{APIVersion: "capsule.clastix.io/v1beta2", Kind: "Tenant", Name: "oil", UID: tenantUID}, grants[0].NamespaceOwner)
		require.Nil(t, grants[1].NamespaceOwner)
	})
}

func TestANamespaceThatLosesItsOwnerLosesItsLeases(t *testing.T) {
	t.Parallel()
	e := newTenantEnv(t, ownedPolicy, nil)
	e.nss.setOwned("oil-dev", oil, tenantRef("capsule.clastix.io/v1beta2", tenantUID))
	id := e.issue(t, west, "oil-dev")
	e.nss.setOwned("oil-dev", oil) // the label stays, the owner reference goes
	e.requireRevoked(t, "oil-dev", id)
}

func TestTrimNamespaceKeepsTheOwnerReferences(t *testing.T) {
	t.Parallel()
	ref := tenantRef("capsule.clastix.io/v1beta2", tenantUID)
	got, err := tenants.TrimNamespace(&metav1.PartialObjectMetadata{ObjectMeta: metav1.ObjectMeta{
		Name: "oil-dev", Labels: oil, OwnerReferences: []metav1.OwnerReference{ref},
		Annotations: map[string]string{"kubectl.kubernetes.io/last-applied-configuration": strings.Repeat("x", 1000)},
	}})
	require.NoError(t, err)
	m := got.(*metav1.PartialObjectMetadata)
	require.Equal(t, []metav1.OwnerReference{ref}, m.OwnerReferences)
	require.Empty(t, m.Annotations)
}
