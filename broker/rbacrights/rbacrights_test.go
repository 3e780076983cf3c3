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

func TestRulesAreThoseOfTheRolesBoundToTheSubject(t *testing.T) {
	t.Parallel()
	meta := func(ns, name string) metav1.ObjectMeta { return metav1.ObjectMeta{Namespace: ns, Name: name} }
	sa := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Namespace: "argo", Name: "runner"}
	c := fake.NewClientset(
		&rbacv1.Role{ObjectMeta: meta("argo", "cm-reader"), Rules: []rbacv1.PolicyRule{rule("list", "configmaps")}},
		&rbacv1.ClusterRole{ObjectMeta: meta("", "pod-reader"), Rules: []rbacv1.PolicyRule{rule("get", "pods")}},
		&rbacv1.ClusterRole{ObjectMeta: meta("", "everyone"), Rules: []rbacv1.PolicyRule{rule("get", "nodes")}},
		&rbacv1.RoleBinding{ObjectMeta: meta("argo", "runner-cm"), Subjects: []rbacv1.Subject{sa}, RoleRef: rbacv1.RoleRef{Kind: "Role", Name: "cm-reader"}},
		&rbacv1.RoleBinding{ObjectMeta: meta("argo", "runner-pods"), Subjects: []rbacv1.Subject{{Kind: rbacv1.GroupKind, Name: "system:serviceaccounts:argo"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "pod-reader"}},
		&rbacv1.RoleBinding{ObjectMeta: meta("argo", "missing-role"), Subjects: []rbacv1.Subject{sa}, RoleRef: rbacv1.RoleRef{Kind: "Role", Name: "gone"}},
		&rbacv1.RoleBinding{ObjectMeta: meta("argo", "another-sa"), Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: "argo", Name: "other"}}, RoleRef: rbacv1.RoleRef{Kind: "Role", Name: "cm-reader"}},
		&rbacv1.RoleBinding{ObjectMeta: meta("other", "same-name-elsewhere"), Subjects: []rbacv1.Subject{sa}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "pod-reader"}},
		&rbacv1.ClusterRoleBinding{ObjectMeta: meta("", "authenticated"), Subjects: []rbacv1.Subject{{Kind: rbacv1.GroupKind, Name: "system:authenticated"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "everyone"}},
		&rbacv1.ClusterRoleBinding{ObjectMeta: meta("", "cert-user"), Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, Name: "tokenbroker:west:abc"}}, RoleRef: rbacv1.RoleRef{Kind: "ClusterRole", Name: "everyone"}},
	)
	r := rbacrights.NewResolver(c.RbacV1())
	rules, from, err := r.Rules(context.Background(), rbacrights.Subject{ServiceAccount: true, Namespace: "argo", Name: "runner", Groups: rbacrights.ServiceAccountGroups("argo")}, "argo")
	require.NoError(t, err)
	require.Equal(t, []string{"argo/runner-cm", "argo/runner-pods"}, from, "bindings of another subject, another namespace, system:authenticated or a missing role bind nothing")
	require.Equal(t, []rbacv1.PolicyRule{rule("list", "configmaps"), rule("get", "pods")}, rules)

	rules, from, err = r.Rules(context.Background(), rbacrights.Subject{Name: "tokenbroker:west:abc"}, "argo")
	require.NoError(t, err)
	require.Equal(t, []string{"cert-user"}, from)
	require.Equal(t, []rbacv1.PolicyRule{rule("get", "nodes")}, rules)
}
