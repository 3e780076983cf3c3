package broker

import (
	"fmt"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metav1validation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
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

// Decide is DecideIn without namespaces: grants by namespaceSelector match
// nothing, grants by name decide alone.
func (p *Policy) Decide(identity, namespace, serviceAccount, credential string, requested, minTTL time.Duration) (Decision, error) {
	return p.DecideIn(nil, identity, namespace, serviceAccount, credential, requested, minTTL)
}

// covers reports whether the grant covers namespace: it is listed by name,
// or the grant's selector matches the namespace's labels now.
func (g *GrantSpec) covers(nss NamespaceLabels, namespace string) bool {
	if slices.Contains(g.Namespaces, namespace) {
		return true
	}
	return g.selectorMatches(nss, namespace)
}

// selectorMatches reports whether the grant's selector matches namespace
// (false for a grant without one, or a namespace nss does not know).
func (g *GrantSpec) selectorMatches(nss NamespaceLabels, namespace string) bool {
	if g.selector == nil || nss == nil {
		return false
	}
	set, ok := nss.NamespaceLabels(namespace)
	return ok && g.selector.Matches(set)
}

// keptTrue reports whether leases issued under the grant are revoked when
// their namespace stops being covered: selector grants, unless they say
// revokeOnUnmatch: false.
func (g *GrantSpec) keptTrue() bool {
	return g.NamespaceSelector != nil && (g.RevokeOnUnmatch == nil || *g.RevokeOnUnmatch)
}

// grantRef names g, one of ps's grants, as a lease records it: its name,
// or its position for an unnamed grant.
func (ps *PeerSpec) grantRef(g *GrantSpec) string {
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
func (ps *PeerSpec) grantNamed(name string) *GrantSpec {
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
func (p *Policy) peerNamed(name string) *PeerSpec {
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
	g.selector = nil
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
		return
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
	g.selector = s
}

// selectorGrant is one grant by namespace selector, by peer and grant name.
type selectorGrant struct{ peer, grant string }

// selectorGrants returns the policy's grants by namespace selector.
func (p *Policy) selectorGrants() map[selectorGrant]*GrantSpec {
	out := map[selectorGrant]*GrantSpec{}
	if p == nil {
		return out
	}
	for i := range p.Peers {
		for j := range p.Peers[i].Grants {
			g := &p.Peers[i].Grants[j]
			if g.selector != nil {
				out[selectorGrant{p.Peers[i].Name, g.Name}] = g
			}
		}
	}
	return out
}

// apiSelector is a selector as GET /v1/whoami shows it.
func apiSelector(s *metav1.LabelSelector) *apiv1.LabelSelector {
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
