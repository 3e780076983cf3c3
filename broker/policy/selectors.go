package policy

import (
	"fmt"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// NamespaceLabels tells a grant's namespaceSelector what a namespace looks
// like now. The broker's implementation reads a watched cache of
// namespaces (metadata only), so a decision costs a map lookup, not an API
// call.
type NamespaceLabels interface {
	// NamespaceLabels returns the labels of a namespace that exists and is
	// not being deleted; ok is false otherwise.
	NamespaceLabels(name string) (set labels.Set, ok bool)
}

// NamespaceOwners is an optional ability of a NamespaceLabels, found by
// type assertion: the owner references of a namespace, for grants with a
// namespaceOwner. Without it such grants match nothing.
type NamespaceOwners interface {
	// NamespaceOwners returns the owner references of a namespace that
	// exists and is not being deleted.
	NamespaceOwners(name string) []metav1.OwnerReference
}

// NamespaceOwner is the object a selector grant's namespaces must be
// owned by: an ownerReference of the namespace with this UID, kind, name
// and API group. The version in APIVersion is not compared, so that an
// owner's CRD serving a new version (Capsule's v1beta1 to v1beta2) keeps
// its namespaces; the UID is what no one can give a new object, so a
// Tenant deleted and created again under the same name owns nothing until
// the policy names its new UID.
type NamespaceOwner struct {
	APIVersion string    `json:"apiVersion"`
	Kind       string    `json:"kind"`
	Name       string    `json:"name"`
	UID        types.UID `json:"uid"`
}

// api is o as GET /v1/whoami shows it (nil for nil).
func (o *NamespaceOwner) API() *apiv1.NamespaceOwner {
	if o == nil {
		return nil
	}
	return &apiv1.NamespaceOwner{APIVersion: o.APIVersion, Kind: o.Kind, Name: o.Name, UID: string(o.UID)}
}

// owns reports whether one of refs is o.
func (o *NamespaceOwner) owns(refs []metav1.OwnerReference) bool {
	group := apiGroup(o.APIVersion)
	for _, r := range refs {
		if r.UID == o.UID && r.Kind == o.Kind && r.Name == o.Name && apiGroup(r.APIVersion) == group {
			return true
		}
	}
	return false
}

// apiGroup is the group of an apiVersion ("" for the core group, or one
// that does not parse).
func apiGroup(apiVersion string) string {
	gv, err := schema.ParseGroupVersion(apiVersion)
	if err != nil {
		return ""
	}
	return gv.Group
}

// selects reports whether the grant's selector, and its namespaceOwner if
// it has one, take a namespace with these labels and owner references.
func (g *GrantSpec) Selects(set labels.Set, owners []metav1.OwnerReference) bool {
	return g.Selector != nil && g.Selector.Matches(set) && (g.NamespaceOwner == nil || g.NamespaceOwner.owns(owners))
}

// Decide is DecideIn without namespaces: grants by namespaceSelector match
// nothing, grants by name decide alone.
func (p *Policy) Decide(identity, namespace, serviceAccount, credential string, requested, minTTL time.Duration) (Decision, error) {
	return p.DecideIn(nil, identity, namespace, serviceAccount, credential, requested, minTTL)
}

// covers reports whether the grant covers namespace: it is listed by name,
// or the grant's selector matches the namespace's labels now.
func (g *GrantSpec) Covers(nss NamespaceLabels, namespace string) bool {
	if slices.Contains(g.Namespaces, namespace) {
		return true
	}
	return g.selectorMatches(nss, namespace)
}

// selectorMatches reports whether the grant's selector matches namespace
// (false for a grant without one, or a namespace nss does not know).
func (g *GrantSpec) selectorMatches(nss NamespaceLabels, namespace string) bool {
	if g.Selector == nil || nss == nil {
		return false
	}
	set, ok := nss.NamespaceLabels(namespace)
	if !ok {
		return false
	}
	var owners []metav1.OwnerReference
	if g.NamespaceOwner != nil {
		no, ok := nss.(NamespaceOwners)
		if !ok {
			return false
		}
		owners = no.NamespaceOwners(namespace)
	}
	return g.Selects(set, owners)
}

// keptTrue reports whether leases issued under the grant are revoked when
// their namespace stops being covered: selector grants, unless they say
// revokeOnUnmatch: false.
func (g *GrantSpec) KeptTrue() bool {
	return g.NamespaceSelector != nil && (g.RevokeOnUnmatch == nil || *g.RevokeOnUnmatch)
}

// grantRef names g, one of ps's grants, as a lease records it: its name,
// or its position for an unnamed grant.
func (ps *PeerSpec) GrantRef(g *GrantSpec) string {
	if g.Name != "" {
		return g.Name
	}
	for i := range ps.Grants {
		if &ps.Grants[i] == g {
			return fmt.Sprintf("grants[%d]", i)
		}
	}
	return ""
}

// grantNamed returns the peer's grant with the given name, or nil.
func (ps *PeerSpec) GrantNamed(name string) *GrantSpec {
	if name == "" {
		return nil
	}
	for i := range ps.Grants {
		if ps.Grants[i].Name == name {
			return &ps.Grants[i]
		}
	}
	return nil
}

// peerNamed returns the peer with the given policy name, or nil.
func (p *Policy) PeerNamed(name string) *PeerSpec {
	for i := range p.Peers {
		if p.Peers[i].Name == name {
			return &p.Peers[i]
		}
	}
	return nil
}

// maxRevokeDelayNote explains the bound of revokeDelay.
const maxRevokeDelayNote = "must be between 0 and ttl.max (%s): a longer delay outlives every lease it would revoke"

// validateTenantGrant checks the fields of a grant by namespace selector
// and compiles its selector into g. names collects the peer's grant names.
func validateTenantGrant(g *GrantSpec, gpath string, maxTTL time.Duration, names map[string]bool, add func(field, format string, args ...any)) {
	g.Selector = nil
	if g.Name != "" {
		if errs := validation.IsDNS1123Label(g.Name); len(errs) > 0 {
			add(gpath+".name", "%s", strings.Join(errs, "; "))
		} else if names[g.Name] {
			add(gpath+".name", "duplicate grant name %q in this peer", g.Name)
		}
		names[g.Name] = true
	}
	if g.NamespaceSelector == nil {
		if g.RevokeOnUnmatch != nil {
			add(gpath+".revokeOnUnmatch", "only a grant with namespaceSelector revokes on unmatch")
		}
		if g.RevokeDelay != 0 {
			add(gpath+".revokeDelay", "only a grant with namespaceSelector revokes on unmatch")
		}
		if g.NamespaceOwner != nil {
			add(gpath+".namespaceOwner", "only a grant with namespaceSelector has one: a namespace listed by name is granted by its name")
		}
		return
	}
	if o := g.NamespaceOwner; o != nil {
		validateNamespaceOwner(o, gpath+".namespaceOwner", add)
	}
	spath := gpath + ".namespaceSelector"
	if g.Name == "" {
		add(gpath+".name", "is required with namespaceSelector: leases record their grant by name, and revocation finds them by it")
	}
	if g.Credential == apiv1.CredentialClientCertificate {
		add(spath, "is for token grants only: a clientCertificate grant names each namespace, so that one namespace has one role")
	}
	if d := time.Duration(g.RevokeDelay); d < 0 || d > maxTTL {
		add(gpath+".revokeDelay", maxRevokeDelayNote, maxTTL)
	}
	sel := g.NamespaceSelector
	if len(sel.MatchLabels) == 0 && len(sel.MatchExpressions) == 0 {
		add(spath, "must have matchLabels or matchExpressions: an empty selector would grant every namespace")
		return
	}
	errs := metav1validation.ValidateLabelSelector(sel, metav1validation.LabelSelectorValidationOptions{}, field.NewPath("namespaceSelector"))
	for _, e := range errs {
		add(gpath+"."+e.Field, "%s", e.ErrorBody())
	}
	if len(errs) > 0 {
		return
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		add(spath, "%v", err)
		return
	}
	g.Selector = s
}

// maxKindLen bounds a namespaceOwner's kind (a Kubernetes kind is a
// DNS-1035 label in CamelCase, at most 63 characters).
const maxKindLen = 63

// validateNamespaceOwner checks a grant's namespaceOwner: every field is
// required, the UID is what an ownerReference holds (a UUID), and the
// kind and name are what Kubernetes allows.
func validateNamespaceOwner(o *NamespaceOwner, path string, add func(field, format string, args ...any)) {
	switch gv, err := schema.ParseGroupVersion(o.APIVersion); {
	case o.APIVersion == "":
		add(path+".apiVersion", "is required: the owner's group/version, such as capsule.clastix.io/v1beta2")
	case err != nil || gv.Version == "" || len(o.APIVersion) > 316:
		add(path+".apiVersion", "must be group/version (or v1 for the core group), such as capsule.clastix.io/v1beta2")
	case gv.Group != "" && len(validation.IsDNS1123Subdomain(gv.Group)) > 0:
		add(path+".apiVersion", "the group must be a DNS subdomain, such as capsule.clastix.io")
	case len(validation.IsDNS1035Label(strings.ToLower(gv.Version))) > 0:
		add(path+".apiVersion", "the version must be a DNS-1035 label, such as v1beta2")
	}
	switch {
	case o.Kind == "":
		add(path+".kind", "is required: the owner's kind, such as Tenant")
	case len(o.Kind) > maxKindLen || !kindName(o.Kind):
		add(path+".kind", "must be a Kubernetes kind: a letter, then letters and digits, at most %d characters", maxKindLen)
	}
	if o.Name == "" {
		add(path+".name", "is required: the owner's name")
	} else if errs := validation.IsDNS1123Subdomain(o.Name); len(errs) > 0 {
		add(path+".name", "%s", strings.Join(errs, "; "))
	}
	if o.UID == "" {
		add(path+".uid", "is required: the owner's metadata.uid (kubectl get <kind> <name> -o jsonpath='{.metadata.uid}'), which no object created later can have")
	} else if !pki.ValidUID(strings.ToLower(string(o.UID))) {
		add(path+".uid", "must be a UID as Kubernetes writes it (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
	}
}

// kindName reports whether s looks like a Kubernetes kind: an ASCII
// letter, then ASCII letters and digits.
func kindName(s string) bool {
	for i, r := range s {
		letter := (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z')
		if !letter && (i == 0 || r < '0' || r > '9') {
			return false
		}
	}
	return s != ""
}

// selectorGrant is one grant by namespace selector, by peer and grant name.
type SelectorGrant struct{ Peer, Grant string }

// selectorGrants returns the policy's grants by namespace selector.
func (p *Policy) SelectorGrants() map[SelectorGrant]*GrantSpec {
	out := map[SelectorGrant]*GrantSpec{}
	if p == nil {
		return out
	}
	for i := range p.Peers {
		for j := range p.Peers[i].Grants {
			g := &p.Peers[i].Grants[j]
			if g.Selector != nil {
				out[SelectorGrant{p.Peers[i].Name, g.Name}] = g
			}
		}
	}
	return out
}

// aPISelector is a selector as GET /v1/whoami shows it.
func APISelector(s *metav1.LabelSelector) *apiv1.LabelSelector {
	if s == nil {
		return nil
	}
	out := &apiv1.LabelSelector{MatchLabels: s.MatchLabels}
	for _, e := range s.MatchExpressions {
		out.MatchExpressions = append(out.MatchExpressions, apiv1.LabelSelectorRequirement{
			Key: e.Key, Operator: string(e.Operator), Values: slices.Clone(e.Values),
		})
	}
	return out
}
