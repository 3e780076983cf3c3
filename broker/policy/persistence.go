package policy

import (
	"context"
	"fmt"
	"slices"
	"strings"

	authzv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	authzv1client "k8s.io/client-go/kubernetes/typed/authorization/v1"
	rbacv1client "k8s.io/client-go/kubernetes/typed/rbac/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// A lease ends the credential it was issued with, and nothing else. A
// holder whose RBAC lets it make a credential of its own in the target
// cluster (a ServiceAccount token Secret, a TokenRequest, a RoleBinding for
// another identity, a pod or a workload running as some ServiceAccount, an
// impersonation, a role escalation) can make one during the lease that
// lives on after the lease is revoked. CheckPersistence finds the grants
// whose holders can, by asking the target API server, so that "tokenbroker
// config validate --kubeconfig" can warn of them (docs/security.md).

// Persistence is one ability that lets a credential's holder make another
// credential that outlives the lease.
type Persistence struct {
	Verb, Group, Resource, Subresource string
	// ClusterScoped abilities are reviewed without a namespace.
	ClusterScoped bool
}

// String is the ability as kubectl auth can-i writes it: "create secrets",
// "create serviceaccounts/token", "bind clusterroles.rbac.authorization.k8s.io".
func (p Persistence) String() string {
	r := p.Resource
	if p.Group != "" {
		r += "." + p.Group
	}
	if p.Subresource != "" {
		r = p.Resource + "/" + p.Subresource
	}
	return p.Verb + " " + r
}

// PersistenceAbilities are the abilities CheckPersistence looks for.
var PersistenceAbilities = slices.Concat([]Persistence{
	// A Secret of type kubernetes.io/service-account-token gets a token
	// that never expires, from the token controller; reading one that
	// exists already (a legacy token Secret) gives the same.
	{Verb: "create", Resource: "secrets"},
	{Verb: "get", Resource: "secrets"},
	{Verb: "list", Resource: "secrets"},
	// A TokenRequest of its own, bound to nothing the broker controls.
	{Verb: "create", Resource: "serviceaccounts", Subresource: "token"},
	// A binding for an identity the holder controls.
	{Verb: "create", Group: "rbac.authorization.k8s.io", Resource: "rolebindings"},
	{Verb: "create", Group: "rbac.authorization.k8s.io", Resource: "clusterrolebindings", ClusterScoped: true},
	// A client certificate of its own: a CertificateSigningRequest, and
	// approving it for a signer the cluster signs for.
	{Verb: "create", Group: "certificates.k8s.io", Resource: "certificatesigningrequests", ClusterScoped: true},
	{Verb: "approve", Group: "certificates.k8s.io", Resource: "signers", ClusterScoped: true},
},
	// Pods and the workloads that make them run as a ServiceAccount of the
	// namespace, with its token, for as long as they run; changing an
	// existing pod's image or a workload's pod template (update or patch)
	// does the same, and so do exec into a running pod (create, or get for
	// a WebSocket exec) and an ephemeral container added to one.
	makeOrChange("", "pods"),
	[]Persistence{
		{Verb: "create", Resource: "pods", Subresource: "exec"},
		{Verb: "get", Resource: "pods", Subresource: "exec"},
		{Verb: "update", Resource: "pods", Subresource: "ephemeralcontainers"},
		{Verb: "patch", Resource: "pods", Subresource: "ephemeralcontainers"},
	},
	makeOrChange("", "replicationcontrollers"),
	makeOrChange("apps", "deployments"),
	makeOrChange("apps", "replicasets"),
	makeOrChange("apps", "daemonsets"),
	makeOrChange("apps", "statefulsets"),
	makeOrChange("batch", "jobs"),
	makeOrChange("batch", "cronjobs"),
	[]Persistence{
		// Granting what one does not have, and acting as someone else.
		{Verb: "escalate", Group: "rbac.authorization.k8s.io", Resource: "roles"},
		{Verb: "bind", Group: "rbac.authorization.k8s.io", Resource: "roles"},
		{Verb: "escalate", Group: "rbac.authorization.k8s.io", Resource: "clusterroles", ClusterScoped: true},
		{Verb: "bind", Group: "rbac.authorization.k8s.io", Resource: "clusterroles", ClusterScoped: true},
		{Verb: "impersonate", Resource: "users", ClusterScoped: true},
		{Verb: "impersonate", Resource: "groups", ClusterScoped: true},
		{Verb: "impersonate", Resource: "serviceaccounts"},
	},
)

// makeOrChange are the abilities to make a namespaced object of a
// resource that runs pods, or to change one's pods: create, update and
// patch.
func makeOrChange(group, resource string) []Persistence {
	return []Persistence{
		{Verb: "create", Group: group, Resource: resource},
		{Verb: "update", Group: group, Resource: resource},
		{Verb: "patch", Group: group, Resource: resource},
	}
}

// aggregatedRoleNames are the default ClusterRoles that aggregate others:
// they grow whenever a ClusterRole with their aggregate-to label is added
// (by any operator or CRD's chart), so what a grant gives grows with them.
var aggregatedRoleNames = []string{"admin", "edit", "view"}

// PersistenceClients are what CheckPersistence reads: SubjectAccessReviews
// for a token grant's ServiceAccount, and RBAC objects for a
// clientCertificate grant's role and for aggregated roles.
type PersistenceClients struct {
	Reviews authzv1client.SubjectAccessReviewInterface
	RBAC    RBACReader
}

// RBACReader reads RBAC objects.
type RBACReader interface {
	rbacv1client.RolesGetter
	rbacv1client.ClusterRolesGetter
	rbacv1client.RoleBindingsGetter
	rbacv1client.ClusterRoleBindingsGetter
}

// CheckPersistence warns of each grant of p whose holder could make a
// credential that outlives its lease, as the target API server decides
// now: for a token grant, a SubjectAccessReview of each ServiceAccount in
// each namespace the grant lists; for a clientCertificate grant, the
// rules of its Role (in each namespace) or ClusterRole. A grant bound to
// an aggregated ClusterRole (admin, edit, view, or any with an
// aggregationRule) is named as growing. Namespaces a selector matches are
// not known here and are noted as not checked. Warnings are per grant,
// with the grant's field path. An error is a failure to ask (the API
// server unreachable, or the caller not allowed to create
// SubjectAccessReviews or read RBAC), wrapped.
func CheckPersistence(ctx context.Context, p *Policy, c PersistenceClients) ([]apiv1.FieldError, error) {
	var warnings []apiv1.FieldError
	for i := range p.Peers {
		peer := &p.Peers[i]
		for j := range peer.Grants {
			g := &peer.Grants[j]
			path := fmt.Sprintf("peers[%d].grants[%d]", i, j)
			ws, err := checkGrantPersistence(ctx, c, g)
			if err != nil {
				return warnings, fmt.Errorf("%s: %w", path, err)
			}
			for _, w := range ws {
				warnings = append(warnings, apiv1.FieldError{Field: path, Detail: w})
			}
			if g.NamespaceSelector != nil {
				warnings = append(warnings, apiv1.FieldError{Field: path + ".namespaceSelector",
					Detail: "not checked: the namespaces it matches change; check each with kubectl auth can-i --list --as system:serviceaccount:<namespace>:<name>"})
			}
		}
	}
	return warnings, nil
}

func checkGrantPersistence(ctx context.Context, c PersistenceClients, g *GrantSpec) ([]string, error) {
	var out []string
	if g.Credential == apiv1.CredentialClientCertificate {
		for _, ns := range g.Namespaces {
			rules, aggregated, err := grantRules(ctx, c.RBAC, g, ns)
			if err != nil {
				return nil, err
			}
			if can := rulesAllow(rules); len(can) > 0 {
				out = append(out, fmt.Sprintf("in %s the certificate's user can %s: %s", ns, strings.Join(can, ", "), outlives))
			}
			if aggregated != "" {
				out = append(out, growing(aggregated))
			}
			if g.ClusterRole != "" {
				break // the same rules in every namespace
			}
		}
		return out, nil
	}
	for _, ns := range g.Namespaces {
		for _, sa := range g.ServiceAccounts {
			can, err := reviewServiceAccount(ctx, c.Reviews, ns, sa)
			if err != nil {
				return nil, err
			}
			if len(can) > 0 {
				out = append(out, fmt.Sprintf("%s/%s can %s: %s", ns, sa, strings.Join(can, ", "), outlives))
			}
			roles, err := aggregatedRolesOf(ctx, c.RBAC, ns, sa)
			if err != nil {
				return nil, err
			}
			for _, r := range roles {
				out = append(out, fmt.Sprintf("%s/%s: %s", ns, sa, growing(r)))
			}
		}
	}
	return out, nil
}

const outlives = "a credential made with it outlives the lease, and revoking the lease does not end it (docs/security.md, Persistence)"

func growing(role string) string {
	return fmt.Sprintf("bound to the aggregated ClusterRole %s, which grows whenever a ClusterRole labelled to aggregate into it is added", role)
}

// serviceAccountUser is the user and groups the API server authenticates
// a token of namespace/name as; a SubjectAccessReview adds no groups itself.
func serviceAccountUser(ns, name string) (string, []string) {
	return "system:serviceaccount:" + ns + ":" + name,
		[]string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}
}

// reviewServiceAccount asks the API server which PersistenceAbilities the
// ServiceAccount has in ns.
func reviewServiceAccount(ctx context.Context, reviews authzv1client.SubjectAccessReviewInterface, ns, sa string) ([]string, error) {
	user, groups := serviceAccountUser(ns, sa)
	var can []string
	for _, a := range PersistenceAbilities {
		attrs := &authzv1.ResourceAttributes{Verb: a.Verb, Group: a.Group, Resource: a.Resource, Subresource: a.Subresource}
		if !a.ClusterScoped {
			attrs.Namespace = ns
		}
		r, err := reviews.Create(ctx, &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
			User: user, Groups: groups, ResourceAttributes: attrs,
		}}, metav1.CreateOptions{})
		if err != nil {
			return nil, fmt.Errorf("SubjectAccessReview for %s, %s: %w", user, a, err)
		}
		if r.Status.Allowed {
			can = append(can, a.String())
		}
	}
	return can, nil
}

// aggregatedRolesOf lists the aggregated ClusterRoles bound to the
// ServiceAccount (or one of its groups) in ns or cluster-wide, sorted.
func aggregatedRolesOf(ctx context.Context, r RBACReader, ns, sa string) ([]string, error) {
	user, groups := serviceAccountUser(ns, sa)
	names := map[string]bool{}
	matches := func(subjects []rbacv1.Subject) bool {
		for _, s := range subjects {
			switch s.Kind {
			case rbacv1.ServiceAccountKind:
				if s.Name == sa && (s.Namespace == ns || s.Namespace == "") {
					return true
				}
			case rbacv1.UserKind:
				if s.Name == user {
					return true
				}
			case rbacv1.GroupKind:
				if slices.Contains(groups, s.Name) {
					return true
				}
			}
		}
		return false
	}
	rbs, err := r.RoleBindings(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list RoleBindings in %s: %w", ns, err)
	}
	for _, b := range rbs.Items {
		if b.RoleRef.Kind == "ClusterRole" && matches(b.Subjects) {
			names[b.RoleRef.Name] = true
		}
	}
	crbs, err := r.ClusterRoleBindings().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list ClusterRoleBindings: %w", err)
	}
	for _, b := range crbs.Items {
		if b.RoleRef.Kind == "ClusterRole" && matches(b.Subjects) {
			names[b.RoleRef.Name] = true
		}
	}
	var out []string
	for name := range names {
		agg, err := isAggregated(ctx, r, name)
		if err != nil {
			return nil, err
		}
		if agg {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out, nil
}

// isAggregated reports whether the ClusterRole aggregates others: it has
// an aggregationRule, or is one of the defaults that do. A ClusterRole
// that does not exist is not.
func isAggregated(ctx context.Context, r RBACReader, name string) (bool, error) {
	cr, err := r.ClusterRoles().Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("get ClusterRole %s: %w", name, err)
	}
	return cr.AggregationRule != nil || slices.Contains(aggregatedRoleNames, name), nil
}

// grantRules are the rules a clientCertificate grant gives in ns, and the
// name of its ClusterRole if that is aggregated. A role that does not
// exist gives nothing (the broker's issuance then fails).
func grantRules(ctx context.Context, r RBACReader, g *GrantSpec, ns string) ([]rbacv1.PolicyRule, string, error) {
	if g.Role != "" {
		role, err := r.Roles(ns).Get(ctx, g.Role, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			return nil, "", nil
		case err != nil:
			return nil, "", fmt.Errorf("get Role %s/%s: %w", ns, g.Role, err)
		}
		return role.Rules, "", nil
	}
	cr, err := r.ClusterRoles().Get(ctx, g.ClusterRole, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, "", nil
	case err != nil:
		return nil, "", fmt.Errorf("get ClusterRole %s: %w", g.ClusterRole, err)
	}
	agg := ""
	if cr.AggregationRule != nil || slices.Contains(aggregatedRoleNames, cr.Name) {
		agg = cr.Name
	}
	return cr.Rules, agg, nil
}

// rulesAllow lists the namespaced PersistenceAbilities the rules give (a
// RoleBinding grants nothing cluster-scoped). A rule limited by
// resourceNames never allows create (a create has no name yet), but does
// allow the other verbs for those names, which is enough to warn.
func rulesAllow(rules []rbacv1.PolicyRule) []string {
	var can []string
	for _, a := range PersistenceAbilities {
		if a.ClusterScoped {
			continue
		}
		for _, r := range rules {
			if has(r.Verbs, a.Verb) && has(r.APIGroups, a.Group) && hasResource(r.Resources, a) &&
				(len(r.ResourceNames) == 0 || a.Verb != "create") {
				can = append(can, a.String())
				break
			}
		}
	}
	return can
}

func has(list []string, v string) bool {
	return slices.Contains(list, v) || slices.Contains(list, rbacv1.VerbAll)
}

// hasResource matches a's resource and subresource as RBAC does:
// "serviceaccounts/token", "serviceaccounts/*", "*/token" or "*".
func hasResource(list []string, a Persistence) bool {
	if a.Subresource == "" {
		return has(list, a.Resource)
	}
	return slices.Contains(list, rbacv1.ResourceAll) || slices.Contains(list, a.Resource+"/"+a.Subresource) ||
		slices.Contains(list, a.Resource+"/*") || slices.Contains(list, "*/"+a.Subresource)
}
