package rbacrights_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/tokenbroker/tokenbroker/broker/rbacrights"
)

func rule(verb, res string) rbacv1.PolicyRule {
	return rbacv1.PolicyRule{Verbs: []string{verb}, APIGroups: []string{""}, Resources: []string{res}}
}

func TestGrantsAreThoseOfTheRolesBoundToTheSubjectPerNamespace(t *testing.T) {
	t.Parallel()
	meta := func(ns, name string) metav1.ObjectMeta { return metav1.ObjectMeta{Namespace: ns, Name: name} }
	sa := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Namespace: "argo", Name: "runner"}
	c := fake.NewClientset(
		&rbacv1.Role{ObjectMeta: meta("argo", "cm-reader"), Rules: []rbacv1.PolicyRule{rule("list", "configmaps")}},
		&rbacv1.Role{ObjectMeta: meta("argo", "secret-reader"), Rules: []rbacv1.PolicyRule{rule("get", "secrets")}},
		&rbacv1.ClusterRole{ObjectMeta: meta("", "pod-reader"), Rules: []rbacv1.PolicyRule{rule("get", "pods")}},
		&rbacv1.ClusterRole{ObjectMeta: meta("", "everyone"), Rules: []rbacv1.PolicyRule{rule("get", "nodes")}},
		&rbacv1.RoleBinding{ObjectMeta: meta("argo", "runner-cm"), Subjects: []rbacv1.Subject{sa}, RoleRef: rbacv1.RoleRef{Kind: "Role", Name: "cm-reader"}},
		// A ServiceAccount subject without a namespace is the binding's.
		&rbacv1.RoleBinding{ObjectMeta: meta("argo", "runner-secrets"), Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "runner"}}, RoleRef: rbacv1.RoleRef{Kind: "Role", Name: "secret-reader"}},
		&rbacv1.RoleBinding{ObjectMeta: meta("argo", "runner-pods"), Subjects: []rbacv1.Subject{{Kind: rbacv1.GroupKind, Name: "system:serviceaccounts:argo"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "pod-reader"}},
		&rbacv1.RoleBinding{ObjectMeta: meta("argo", "missing-role"), Subjects: []rbacv1.Subject{sa}, RoleRef: rbacv1.RoleRef{Kind: "Role", Name: "gone"}},
		&rbacv1.RoleBinding{ObjectMeta: meta("argo", "another-sa"), Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: "argo", Name: "other"}}, RoleRef: rbacv1.RoleRef{Kind: "Role", Name: "cm-reader"}},
		// Another namespace's binding of the same ServiceAccount counts,
		// there; a User named as the ServiceAccount binds it.
		&rbacv1.RoleBinding{ObjectMeta: meta("other", "runner-elsewhere"), Subjects: []rbacv1.Subject{sa}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "pod-reader"}},
		&rbacv1.RoleBinding{ObjectMeta: meta("third", "as-user"), Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, Name: "system:serviceaccount:argo:runner"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "pod-reader"}},
		// A ServiceAccount of the binding's own namespace, not argo's.
		&rbacv1.RoleBinding{ObjectMeta: meta("fourth", "local-runner"), Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "runner"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "pod-reader"}},
		&rbacv1.ClusterRoleBinding{ObjectMeta: meta("", "authenticated"), Subjects: []rbacv1.Subject{{Kind: rbacv1.GroupKind, Name: "system:authenticated"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "everyone"}},
		// A ClusterRoleBinding's ServiceAccount without a namespace binds nobody.
		&rbacv1.ClusterRoleBinding{ObjectMeta: meta("", "no-namespace"), Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "runner"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "everyone"}},
		&rbacv1.ClusterRoleBinding{ObjectMeta: meta("", "sa-as-user"), Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, Name: "system:serviceaccount:argo:runner"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "everyone"}},
		&rbacv1.ClusterRoleBinding{ObjectMeta: meta("", "cert-user"), Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, Name: "tokenbroker:west:abc"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "everyone"}},
	)
	r := rbacrights.NewResolver(c.RbacV1())
	grants, err := r.Grants(context.Background(), rbacrights.Subject{Username: "system:serviceaccount:argo:runner", Groups: rbacrights.ServiceAccountGroups("argo")})
	require.NoError(t, err)
	require.Equal(t, []rbacrights.Grant{
		{Namespace: "", Rules: []rbacv1.PolicyRule{rule("get", "nodes")}, From: []string{"sa-as-user"}},
		{Namespace: "argo", Rules: []rbacv1.PolicyRule{rule("list", "configmaps"), rule("get", "pods"), rule("get", "secrets")},
			From: []string{"argo/runner-cm", "argo/runner-pods", "argo/runner-secrets"}},
		{Namespace: "other", Rules: []rbacv1.PolicyRule{rule("get", "pods")}, From: []string{"other/runner-elsewhere"}},
		{Namespace: "third", Rules: []rbacv1.PolicyRule{rule("get", "pods")}, From: []string{"third/as-user"}},
	}, grants, "bindings of another subject, system:authenticated, a missing role or a ServiceAccount of another namespace bind nothing")

	grants, err = r.Grants(context.Background(), rbacrights.Subject{Username: "tokenbroker:west:abc"})
	require.NoError(t, err)
	require.Equal(t, []rbacrights.Grant{{Rules: []rbacv1.PolicyRule{rule("get", "nodes")}, From: []string{"cert-user"}}}, grants)
}
