// Package rbacrights reads, from a cluster's RBAC objects, the rules that
// apply to one subject in one namespace: the Roles and ClusterRoles that
// RoleBindings in the namespace and ClusterRoleBindings bind to it. It
// only reads.
package rbacrights

import (
	"context"
	"fmt"
	"slices"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	rbacv1client "k8s.io/client-go/kubernetes/typed/rbac/v1"
)

// Subject is who the rules are for: a ServiceAccount (Namespace/Name) or
// a user (Name); Groups are its groups whose bindings count too.
type Subject struct {
	ServiceAccount bool
	Namespace      string
	Name           string
	Groups         []string
}

// ServiceAccountGroups are the groups of a ServiceAccount whose bindings
// count: system:serviceaccounts and system:serviceaccounts:<namespace>.
// system:authenticated is left out on purpose: what every authenticated
// user may do (discovery, self reviews) is the cluster's baseline, not the
// grant's.
func ServiceAccountGroups(namespace string) []string {
	return []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace}
}

// Resolver reads RBAC objects through c, each binding list and role once.
type Resolver struct {
	c        rbacv1client.RbacV1Interface
	crbs     []rbacv1.ClusterRoleBinding
	crbsRead bool
	rbs      map[string][]rbacv1.RoleBinding
	roles    map[string]*rbacv1.Role
	cRoles   map[string]*rbacv1.ClusterRole
}

// NewResolver returns a Resolver reading through c.
func NewResolver(c rbacv1client.RbacV1Interface) *Resolver {
	return &Resolver{c: c, rbs: map[string][]rbacv1.RoleBinding{}, roles: map[string]*rbacv1.Role{}, cRoles: map[string]*rbacv1.ClusterRole{}}
}

// Rules returns the rules bound to s by RoleBindings in namespace and by
// ClusterRoleBindings, with the names of the bindings that bound them
// ("namespace/name" for a RoleBinding). A binding whose role is missing
// binds nothing.
func (r *Resolver) Rules(ctx context.Context, s Subject, namespace string) ([]rbacv1.PolicyRule, []string, error) {
	if !r.crbsRead {
		list, err := r.c.ClusterRoleBindings().List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, nil, fmt.Errorf("list ClusterRoleBindings: %w", err)
		}
		r.crbs, r.crbsRead = list.Items, true
	}
	rbs, ok := r.rbs[namespace]
	if !ok {
		list, err := r.c.RoleBindings(namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, nil, fmt.Errorf("list RoleBindings in namespace %s: %w", namespace, err)
		}
		rbs = list.Items
		r.rbs[namespace] = rbs
	}
	var rules []rbacv1.PolicyRule
	var from []string
	for _, b := range r.crbs {
		if !binds(b.Subjects, s) {
			continue
		}
		got, err := r.roleRules(ctx, "", b.RoleRef)
		if err != nil {
			return nil, nil, err
		}
		if got != nil {
			rules = append(rules, got...)
			from = append(from, b.Name)
		}
	}
	for _, b := range rbs {
		if !binds(b.Subjects, s) {
			continue
		}
		got, err := r.roleRules(ctx, namespace, b.RoleRef)
		if err != nil {
			return nil, nil, err
		}
		if got != nil {
			rules = append(rules, got...)
			from = append(from, namespace+"/"+b.Name)
		}
	}
	return rules, from, nil
}

// roleRules returns the rules of the role ref names (a Role in namespace,
// or a ClusterRole), nil if it does not exist.
func (r *Resolver) roleRules(ctx context.Context, namespace string, ref rbacv1.RoleRef) ([]rbacv1.PolicyRule, error) {
	switch ref.Kind {
	case "ClusterRole":
		cr, ok := r.cRoles[ref.Name]
		if !ok {
			got, err := r.c.ClusterRoles().Get(ctx, ref.Name, metav1.GetOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				return nil, fmt.Errorf("get ClusterRole %s: %w", ref.Name, err)
			}
			if err == nil {
				cr = got
			}
			r.cRoles[ref.Name] = cr
		}
		if cr == nil {
			return nil, nil
		}
		return cr.Rules, nil
	case "Role":
		if namespace == "" {
			return nil, nil
		}
		key := namespace + "/" + ref.Name
		role, ok := r.roles[key]
		if !ok {
			got, err := r.c.Roles(namespace).Get(ctx, ref.Name, metav1.GetOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				return nil, fmt.Errorf("get Role %s: %w", key, err)
			}
			if err == nil {
				role = got
			}
			r.roles[key] = role
		}
		if role == nil {
			return nil, nil
		}
		return role.Rules, nil
	}
	return nil, nil
}

// binds reports whether subjects name s, as the RBAC authorizer matches
// them.
func binds(subjects []rbacv1.Subject, s Subject) bool {
	for _, sub := range subjects {
		switch sub.Kind {
		case rbacv1.ServiceAccountKind:
			if s.ServiceAccount && sub.Name == s.Name && sub.Namespace == s.Namespace {
				return true
			}
		case rbacv1.UserKind:
			if !s.ServiceAccount && sub.Name == s.Name {
				return true
			}
		case rbacv1.GroupKind:
			if slices.Contains(s.Groups, sub.Name) {
				return true
			}
		}
	}
	return false
}
