package policy

import (
	"errors"
	"fmt"
	"slices"
	"time"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// A token's audiences say which relying parties accept it. The API server
// accepts only tokens for its own audiences (its --api-audiences), and it
// is the API server that checks, at every request, that the lease Secret a
// token is bound to still exists. A relying party outside the cluster (AWS
// STS, GCP or Azure workload identity federation, Vault's kubernetes auth)
// verifies the token's signature itself, and unless it sends the token to
// this cluster's TokenReview it never learns that the lease was deleted:
// such a token outlives its revocation until it expires. So audiences are
// the policy's to give, never the peer's to choose: a grant lists the
// audiences a request may name (GrantSpec.Audiences), and a grant that lists
// none allows only requests that name none.

// ErrAudienceNotGranted is wrapped by the KindForbidden error of a request
// that a grant would allow but for an audience it names that the grant does
// not list. Callers see the same forbidden answer as for any other refusal;
// the audit trail and tokenbroker_denials_total tell the reason apart.
var ErrAudienceNotGranted = errors.New("a grant covers the request but does not list all the audiences it names")

// denyAudience is the tokenbroker_denials_total reason of a refusal for
// ErrAudienceNotGranted.
const DenyAudience = "audience_not_granted"

// maxGrantAudiences bounds a grant's audiences, as apiv1.MaxAudiences
// bounds a request's.
const maxGrantAudiences = apiv1.MaxAudiences

// allowsAudiences reports whether the grant lets a request name every one
// of audiences. No audiences (the API server's own) are always allowed;
// others must be listed exactly (case-sensitive, no wildcards), since that
// is how the relying party compares them.
func (g *GrantSpec) allowsAudiences(audiences []string) bool {
	for _, a := range audiences {
		if !slices.Contains(g.Audiences, a) {
			return false
		}
	}
	return true
}

// validateGrantAudiences checks a grant's audiences: only token grants have
// them, at most maxGrantAudiences, each a literal of 1 to MaxAudienceLen
// printable ASCII characters.
func validateGrantAudiences(g GrantSpec, gpath string, add func(field, format string, args ...any)) {
	if len(g.Audiences) == 0 {
		return
	}
	if g.Credential == apiv1.CredentialClientCertificate {
		add(gpath+".audiences", "only a token grant lists audiences: a client certificate has none")
		return
	}
	if len(g.Audiences) > maxGrantAudiences {
		add(gpath+".audiences", "at most %d audiences", maxGrantAudiences)
		return
	}
	for i, a := range g.Audiences {
		path := fmt.Sprintf("%s.audiences[%d]", gpath, i)
		switch {
		case a == "" || len(a) > apiv1.MaxAudienceLen || !printableASCII(a):
			add(path, "must be 1 to %d printable ASCII characters", apiv1.MaxAudienceLen)
		case a == "*":
			add(path, "is not a wildcard: audiences are compared exactly, so list each one a peer may ask for")
		}
	}
}

// DecideAudiences is DecideFor for a token request that names audiences:
// it is allowed only under a grant that lists every one of them. A refusal
// that is about the audiences alone wraps ErrAudienceNotGranted.
func (p *Policy) DecideAudiences(nss NamespaceLabels, identity string, workload *WorkloadRef, namespace, serviceAccount, credential string, audiences []string, requested, minTTL time.Duration) (Decision, error) {
	return p.decideFor(nss, identity, workload, namespace, serviceAccount, credential, "", audiences, requested, minTTL)
}

// DecideAccess is DecideAudiences for a request that may ask for an
// access mode (apiv1.AccessDirect or AccessGateway; "" for the mode of
// the grant that matches): only grants of that mode match.
func (p *Policy) DecideAccess(nss NamespaceLabels, identity string, workload *WorkloadRef, namespace, serviceAccount, credential, access string, audiences []string, requested, minTTL time.Duration) (Decision, error) {
	return p.decideFor(nss, identity, workload, namespace, serviceAccount, credential, access, audiences, requested, minTTL)
}
