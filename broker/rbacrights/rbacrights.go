// Package rbacrights reads, from a cluster's RBAC objects, the rules that
// apply to one subject, per scope: the Roles and ClusterRoles that
// ClusterRoleBindings (every namespace) and the RoleBindings of each
// namespace (that namespace only) bind to it. It only reads.
package rbacrights

import (
	"context"
	"fmt"
	"slices"
	"strings"

	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	rbacv1client "k8s.io/client-go/kubernetes/typed/rbac/v1"
)

// Subject is who the rules are for, as the API server authenticates it:
// its user name (system:serviceaccount:<namespace>:<name> for a
// ServiceAccount) and its groups whose bindings count.
type Subject struct {
	Username string
	Groups   []string
}

// ServiceAccountGroups are the groups of a ServiceAccount whose bindings
// count: system:serviceaccounts and system:serviceaccounts:<namespace>.
// system:authenticated is left out on purpose: what every authenticated
// user may do (discovery, self reviews) is the cluster's baseline, not the
// grant's.
func ServiceAccountGroups(namespace string) []string {
	return []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace}
}

// Grant is the rules bound to a subject in one scope: Namespace "" for
// those of ClusterRoleBindings, which apply in every namespace and to
// cluster-scoped resources; else those of the RoleBindings of Namespace,
// which apply there only.
type Grant struct {
	Namespace string
	Rules     []rbacv1.PolicyRule
	// From names the bindings ("namespace/name" for a RoleBinding).
	From []string
}

// Resolver reads RBAC objects through c: every ClusterRoleBinding and
// every RoleBinding (of all namespaces, a page at a time) once, each role
// once.
type Resolver struct {
	c      rbacv1client.RbacV1Interface
	crbs   []rbacv1.ClusterRoleBinding
	rbs    []rbacv1.RoleBinding
	listed bool
	roles  map[string]*rbacv1.Role
	cRoles map[string]*rbacv1.ClusterRole
}

// NewResolver returns a Resolver reading through c.
func NewResolver(c rbacv1client.RbacV1Interface) *Resolver {
	return &Resolver{c: c, roles: map[string]*rbacv1.Role{}, cRoles: map[string]*rbacv1.ClusterRole{}}
}

// listPage is the page size of the binding lists.
const listPage = 500

func (r *Resolver) list(ctx context.Context) error {
	if r.listed {
		return nil
	}
	opts := metav1.ListOptions{Limit: listPage}
	for {
		list, err := r.c.ClusterRoleBindings().List(ctx, opts)
		if err != nil {
			return fmt.Errorf("list ClusterRoleBindings: %w", err)
		}
		r.crbs = append(r.crbs, list.Items...)
		if list.Continue == "" {
			break
		}
		opts.Continue = list.Continue
	}
	// Every namespace's RoleBindings: a subject may be bound, and have
	// rights it never used, in any namespace, not only its lease's.
	opts = metav1.ListOptions{Limit: listPage}
	for {
		list, err := r.c.RoleBindings(metav1.NamespaceAll).List(ctx, opts)
		if err != nil {
			return fmt.Errorf("list RoleBindings in every namespace: %w", err)
		}
		r.rbs = append(r.rbs, list.Items...)
		if list.Continue == "" {
			break
		}
		opts.Continue = list.Continue
	}
	r.listed = true
	return nil
}

// Grants returns the rules bound to s: one Grant of the
// ClusterRoleBindings (Namespace "") if any binds s, and one per namespace
// whose RoleBindings bind s, sorted by namespace. A binding whose role is
// missing binds nothing.
func (r *Resolver) Grants(ctx context.Context, s Subject) ([]Grant, error) {
	if err := r.list(ctx); err != nil {
		return nil, err
	}
	byNS := map[string]*Grant{}
	add := func(ns, name string, rules []rbacv1.PolicyRule) {
		g := byNS[ns]
		if g == nil {
			g = &Grant{Namespace: ns}
			byNS[ns] = g
		}
		g.Rules = append(g.Rules, rules...)
		g.From = append(g.From, name)
	}
	for _, b := range r.crbs {
		if !binds(b.Subjects, s, "") {
			continue
		}
		got, err := r.roleRules(ctx, "", b.RoleRef)
		if err != nil {
			return nil, err
		}
		if got != nil {
			add("", b.Name, got)
		}
	}
	for _, b := range r.rbs {
		if !binds(b.Subjects, s, b.Namespace) {
			continue
		}
		got, err := r.roleRules(ctx, b.Namespace, b.RoleRef)
		if err != nil {
			return nil, err
		}
		if got != nil {
			add(b.Namespace, b.Namespace+"/"+b.Name, got)
		}
	}
	out := make([]Grant, 0, len(byNS))
	for _, g := range byNS {
		out = append(out, *g)
	}
	slices.SortFunc(out, func(a, b Grant) int { return strings.Compare(a.Namespace, b.Namespace) })
	return out, nil
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

// binds reports whether subjects name s, as the RBAC authorizer's
// appliesToUser (k8s.io/kubernetes pkg/registry/rbac/validation) matches
// them for a binding in namespace ("" for a ClusterRoleBinding): a User by
// its name (so a User named system:serviceaccount:<ns>:<name> is that
// ServiceAccount), a Group by one of s's groups, a ServiceAccount by the
// user name it authenticates as, its namespace defaulting to the
// binding's (none for a ClusterRoleBinding: then it binds nobody).
func binds(subjects []rbacv1.Subject, s Subject, namespace string) bool {
	for _, sub := range subjects {
		switch sub.Kind {
		case rbacv1.UserKind:
			if s.Username != "" && sub.Name == s.Username {
				return true
			}
		case rbacv1.GroupKind:
			if slices.Contains(s.Groups, sub.Name) {
				return true
			}
		case rbacv1.ServiceAccountKind:
			ns := namespace
			if sub.Namespace != "" {
				ns = sub.Namespace
			}
			if ns != "" && s.Username == "system:serviceaccount:"+ns+":"+sub.Name {
				return true
			}
		}
	}
	return false
}
