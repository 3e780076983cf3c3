package server

import (
	"fmt"
	"strings"

	"k8s.io/client-go/kubernetes"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/issuers/tokenrequest"
)

// issuerKinds is the one place credential kinds are registered: a new
// issuer is a package plus one line here.
var issuerKinds = []struct {
	kind string
	make func(kubernetes.Interface) broker.Issuer
}{
	{apiv1.CredentialToken, func(c kubernetes.Interface) broker.Issuer { return tokenrequest.New(c.CoreV1()) }},
}

// CredentialKinds are the credential kinds this build can issue.
func CredentialKinds() []string {
	kinds := make([]string, len(issuerKinds))
	for i, k := range issuerKinds {
		kinds[i] = k.kind
	}
	return kinds
}

// NewIssuers makes the issuers of the given kinds; an unknown kind fails
// closed.
func NewIssuers(kinds []string, client kubernetes.Interface) (map[string]broker.Issuer, error) {
	iss := make(map[string]broker.Issuer, len(kinds))
next:
	for _, kind := range kinds {
		for _, k := range issuerKinds {
			if k.kind == kind {
				iss[kind] = k.make(client)
				continue next
			}
		}
		return nil, fmt.Errorf("unknown or unsupported credential kind %q (this broker issues: %s)", kind, strings.Join(CredentialKinds(), ", "))
	}
	return iss, nil
}
