package auditjoin

import (
	"cmp"
	"slices"
	"strings"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
)

// Subject kinds: RBAC's own, as a RoleBinding's subjects name them.
const (
	SubjectServiceAccount = rbacv1.ServiceAccountKind
	SubjectUser           = rbacv1.UserKind
)

// Subject is an RBAC subject: a ServiceAccount (Namespace/Name) or a user.
type Subject struct {
	Kind      string `json:"kind"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name"`
}

// String is the subject's user name as the API server sees it.
func (s Subject) String() string {
	if s.Kind == SubjectServiceAccount {
		return "system:serviceaccount:" + s.Namespace + ":" + s.Name
	}
	return s.Name
}

// Permission is one RBAC rule entry: a verb on a resource of an API group
// (Resource is "resource" or "resource/subresource", Group "" for the core
// group), or on a non-resource URL path.
type Permission struct {
	Verb     string `json:"verb"`
	Group    string `json:"group,omitempty"`
	Resource string `json:"resource,omitempty"`
	Path     string `json:"path,omitempty"`
	// Namespace, in a permission of UnusedIn, is the namespace a
	// RoleBinding grants it in ("" for a ClusterRoleBinding's).
	Namespace string `json:"namespace,omitempty"`
}

// String is "verb resource", "verb group/resource" or "verb /path", with
// " in <namespace>" for a permission of one namespace.
func (p Permission) String() string {
	s := p.Verb + " " + p.Resource
	switch {
	case p.Path != "":
		s = p.Verb + " " + p.Path
	case p.Group != "":
		s = p.Verb + " " + p.Group + "/" + p.Resource
	}
	if p.Namespace != "" {
		s += " in " + p.Namespace
	}
	return s
}

// permissionOf is the permission a request asked for of the lease's
// subject. An impersonating request was authorized as the impersonated
// user: of the subject it used only the right to impersonate.
func permissionOf(r Row) Permission {
	if r.ImpersonatedUser != "" {
		if strings.HasPrefix(r.ImpersonatedUser, "system:serviceaccount:") {
			return Permission{Verb: "impersonate", Resource: "serviceaccounts"}
		}
		return Permission{Verb: "impersonate", Resource: "users"}
	}
	if r.Resource == "" {
		return Permission{Verb: r.Verb, Path: r.Path}
	}
	res := r.Resource
	if r.Subresource != "" {
		res += "/" + r.Subresource
	}
	return Permission{Verb: r.Verb, Group: r.Group, Resource: res}
}

// namespaceOf is the namespace where the request's permission was
// checked: the impersonated ServiceAccount's for an impersonation (users
// are cluster-wide), else the request's.
func namespaceOf(r Row) string {
	if r.ImpersonatedUser != "" {
		rest, ok := strings.CutPrefix(r.ImpersonatedUser, "system:serviceaccount:")
		if !ok {
			return ""
		}
		ns, _, _ := strings.Cut(rest, ":")
		return ns
	}
	return r.Namespace
}

// Use is how often a permission was asked for: Count requests, Denied of
// them refused by authorization (the event's authorization.k8s.io/decision
// "forbid"; without that annotation, a 403).
type Use struct {
	Permission
	Count  int `json:"count"`
	Denied int `json:"denied"`
	// AllowedIn are the namespaces where at least one of its requests was
	// allowed (at most maxUseNamespaces; past that, ManyNamespaces).
	AllowedIn      []string `json:"allowedIn,omitempty"`
	ManyNamespaces bool     `json:"manyNamespaces,omitempty"`
}

// maxUseNamespaces bounds Use.AllowedIn.
const maxUseNamespaces = 64

// LeaseUsage is what one lease's credential was used for.
type LeaseUsage struct {
	Lease   Lease     `json:"lease"`
	Subject Subject   `json:"subject"`
	First   time.Time `json:"first"`
	Last    time.Time `json:"last"`
	// AfterRevocation counts requests received once the lease was revoked.
	AfterRevocation int `json:"afterRevocation"`
	Tally
}

// MaxPermissions bounds the distinct permissions kept per lease and per
// subject: they are chosen by whoever holds the credential (any resource
// name the API server logs, any path). Requests past it are counted in
// OtherRequests.
const MaxPermissions = 4096

// SubjectUsage is what every lease of one grant for one RBAC subject was
// used for together: the unit of right-sizing, since RBAC grants the
// subject, not the lease.
type SubjectUsage struct {
	Grant   string  `json:"grant"`
	Subject Subject `json:"subject"`
	// Namespace is the leases' namespace, where RoleBindings count.
	Namespace string   `json:"namespace"`
	Leases    []string `json:"leases"`
	Tally
}

// Tally is what a lease's usage and a subject's usage both count: the
// requests, the permissions they asked for, and the requests past
// MaxPermissions distinct permissions.
type Tally struct {
	Requests int   `json:"requests"`
	Uses     []Use `json:"uses"`
	// OtherRequests are requests for permissions past the first
	// MaxPermissions distinct ones, counted but not told apart.
	OtherRequests int `json:"otherRequests,omitempty"`
}

type usage struct {
	lease    Lease
	requests int
	first    time.Time
	last     time.Time
	after    int
	uses     map[Permission]*Use
	other    int
}

type subjectKey struct {
	grant, namespace string
	subject          Subject
}

// Summary aggregates joined requests per lease and per grant and subject.
// Its memory grows with the number of leases and distinct permissions
// used, not with the number of requests.
type Summary struct {
	leases   map[string]*usage
	subjects map[subjectKey]*usage
	members  map[subjectKey]map[string]struct{}
	// overflow counts the requests that went to an OtherRequests count.
	overflow int
}

// Overflow is the number of requests counted in a lease's or subject's
// OtherRequests, past MaxPermissions distinct permissions.
func (s *Summary) Overflow() int { return s.overflow }

// Denied reports whether authorization refused the request: its
// authorization.k8s.io/decision annotation says so, or, without one, its
// code is 403.
func Denied(r Row) bool {
	if r.Decision != "" {
		return r.Decision == "forbid"
	}
	return r.Code == 403
}

// NewSummary returns an empty summary.
func NewSummary() *Summary {
	return &Summary{leases: map[string]*usage{}, subjects: map[subjectKey]*usage{}, members: map[subjectKey]map[string]struct{}{}}
}

// Add counts one joined request.
func (s *Summary) Add(r Row) {
	l := &r.Lease
	lu := s.leases[l.ID]
	if lu == nil {
		lu = &usage{lease: *l, uses: map[Permission]*Use{}}
		s.leases[l.ID] = lu
	}
	key := subjectKey{grant: l.Grant, namespace: l.Namespace, subject: l.Subject()}
	su := s.subjects[key]
	if su == nil {
		su = &usage{uses: map[Permission]*Use{}}
		s.subjects[key] = su
		s.members[key] = map[string]struct{}{}
	}
	s.members[key][l.ID] = struct{}{}
	p, ns := permissionOf(r), namespaceOf(r)
	overflowed := false
	for _, u := range []*usage{lu, su} {
		u.requests++
		if u.first.IsZero() || r.Time.Before(u.first) {
			u.first = r.Time
		}
		if r.Time.After(u.last) {
			u.last = r.Time
		}
		if r.LeaseState == "revoked" {
			u.after++
		}
		use := u.uses[p]
		if use == nil {
			if len(u.uses) >= MaxPermissions {
				u.other++
				overflowed = true
				continue
			}
			use = &Use{Permission: p}
			u.uses[p] = use
		}
		use.Count++
		switch {
		case Denied(r):
			use.Denied++
		case ns == "" || slices.Contains(use.AllowedIn, ns) || use.ManyNamespaces:
		case len(use.AllowedIn) == maxUseNamespaces:
			use.ManyNamespaces = true
		default:
			use.AllowedIn = append(use.AllowedIn, ns)
		}
	}
	if overflowed {
		s.overflow++
	}
}

// tally is u's counts, its uses sorted by permission.
func (u *usage) tally() Tally {
	uses := make([]Use, 0, len(u.uses))
	for _, use := range u.uses {
		uses = append(uses, *use)
	}
	slices.SortFunc(uses, func(a, b Use) int {
		return cmp.Or(cmp.Compare(a.Group, b.Group), cmp.Compare(a.Resource, b.Resource), cmp.Compare(a.Path, b.Path), cmp.Compare(a.Verb, b.Verb))
	})
	return Tally{Requests: u.requests, Uses: uses, OtherRequests: u.other}
}

// Leases returns the usage of every lease, by first use.
func (s *Summary) Leases() []LeaseUsage {
	out := make([]LeaseUsage, 0, len(s.leases))
	for _, u := range s.leases {
		out = append(out, LeaseUsage{
			Lease: u.lease, Subject: u.lease.Subject(), First: u.first, Last: u.last,
			AfterRevocation: u.after, Tally: u.tally(),
		})
	}
	slices.SortFunc(out, func(a, b LeaseUsage) int {
		return cmp.Or(a.First.Compare(b.First), cmp.Compare(a.Lease.ID, b.Lease.ID))
	})
	return out
}

// Subjects returns the usage per grant and subject, by grant and subject.
func (s *Summary) Subjects() []SubjectUsage {
	out := make([]SubjectUsage, 0, len(s.subjects))
	for k, u := range s.subjects {
		ids := make([]string, 0, len(s.members[k]))
		for id := range s.members[k] {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		out = append(out, SubjectUsage{Grant: k.grant, Namespace: k.namespace, Subject: k.subject, Leases: ids, Tally: u.tally()})
	}
	slices.SortFunc(out, func(a, b SubjectUsage) int {
		return cmp.Or(cmp.Compare(a.Grant, b.Grant), cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Subject.String(), b.Subject.String()))
	})
	return out
}

// notObservable reports whether a rule entry's use never shows in an
// audit log as a request: bind and escalate are checked while writing
// RBAC objects, approve and sign while writing CSRs, impersonate on the
// impersonating request (seen only as impersonatedUser), and create on
// pods/exec, attach and portforward is checked on a request the log shows
// as a get (a WebSocket upgrade).
func notObservable(verb, group, res string) bool {
	switch verb {
	case "bind", "escalate", "approve", "sign", "impersonate":
		return true
	case "create":
		return group == "" && (res == "pods/exec" || res == "pods/attach" || res == "pods/portforward")
	}
	return false
}

// Unused lists the entries of rules (one per verb × group × resource, or
// verb × non-resource URL) that no request of uses exercised: no request
// the rule entry matches, or only requests authorization refused (403).
// Entries are matched as RBAC matches them (wildcards "*", "*/subresource",
// a non-resource path ending in "*"); resourceNames are ignored, so an
// entry limited to some names counts as used by a use of any name.
// Entries whose use the audit log cannot show (bind, escalate, approve,
// sign, impersonate when no request impersonated, create on pods/exec,
// attach and portforward when unused) are returned apart, in unobservable:
// "never used" cannot be told of them.
func Unused(rules []rbacv1.PolicyRule, uses []Use) (unused, unobservable []Permission) {
	return UnusedIn("", rules, uses)
}

// UnusedIn is Unused for rules that apply in one namespace only (those a
// RoleBinding of namespace binds): only requests allowed in that namespace
// use them, and the permissions returned name it. namespace "" is
// Unused: rules of ClusterRoleBindings, which apply everywhere. A use
// allowed in more namespaces than it records counts as used in any.
func UnusedIn(namespace string, rules []rbacv1.PolicyRule, uses []Use) (unused, unobservable []Permission) {
	inScope := func(u Use) bool {
		return namespace == "" || u.ManyNamespaces || slices.Contains(u.AllowedIn, namespace)
	}
	seen := map[Permission]bool{}
	add := func(p Permission, used bool) {
		if used || seen[p] {
			return
		}
		seen[p] = true
		p.Namespace = namespace
		if notObservable(p.Verb, p.Group, p.Resource) {
			unobservable = append(unobservable, p)
		} else {
			unused = append(unused, p)
		}
	}
	for _, rule := range rules {
		for _, verb := range rule.Verbs {
			for _, path := range rule.NonResourceURLs {
				add(Permission{Verb: verb, Path: path}, slices.ContainsFunc(uses, func(u Use) bool {
					return u.Path != "" && exercised(u) && inScope(u) && verbMatches(verb, u.Verb) && pathMatches(path, u.Path)
				}))
			}
			for _, group := range rule.APIGroups {
				for _, res := range rule.Resources {
					add(Permission{Verb: verb, Group: group, Resource: res}, slices.ContainsFunc(uses, func(u Use) bool {
						return u.Resource != "" && exercised(u) && inScope(u) && verbMatches(verb, u.Verb) && resourceMatches(group, res, u.Group, u.Resource)
					}))
				}
			}
		}
	}
	byName := func(a, b Permission) int {
		return cmp.Or(cmp.Compare(a.Group, b.Group), cmp.Compare(a.Resource, b.Resource), cmp.Compare(a.Path, b.Path), cmp.Compare(a.Verb, b.Verb))
	}
	slices.SortFunc(unused, byName)
	slices.SortFunc(unobservable, byName)
	return unused, unobservable
}

// exercised reports whether authorization let at least one of u's
// requests through.
func exercised(u Use) bool { return u.Count > u.Denied }

func verbMatches(rule, verb string) bool { return rule == rbacv1.VerbAll || rule == verb }

func pathMatches(rule, path string) bool {
	if rule == rbacv1.NonResourceAll || rule == path {
		return true
	}
	prefix, ok := strings.CutSuffix(rule, "*")
	return ok && strings.HasPrefix(path, prefix)
}

// resourceMatches reports whether a rule's group and resource cover a
// used group and "resource[/subresource]", as RBAC matches them.
func resourceMatches(ruleGroup, ruleRes, group, res string) bool {
	if ruleGroup != rbacv1.APIGroupAll && ruleGroup != group {
		return false
	}
	if ruleRes == rbacv1.ResourceAll || ruleRes == res {
		return true
	}
	_, sub, ok := strings.Cut(res, "/")
	return ok && ruleRes == "*/"+sub
}
