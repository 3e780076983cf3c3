package server

import (
	"fmt"
	"strings"
	"time"

	"go.uber.org/zap"
	"k8s.io/client-go/kubernetes"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/issuers/clientcert"
	"github.com/tokenbroker/tokenbroker/issuers/tokenrequest"
)

// issuerKinds is the one place credential kinds are registered: a new
// issuer is a package plus one line here.
var issuerKinds = []struct {
	kind string
	make func(IssuerDeps) broker.Issuer
}{
	{apiv1.CredentialToken, func(d IssuerDeps) broker.Issuer { return tokenrequest.New(d.Client.CoreV1()) }},
	{apiv1.CredentialClientCertificate, func(d IssuerDeps) broker.Issuer {
		return clientcert.New(d.Client, d.SigningTimeout, d.Logger.Named("clientcert"))
	}},
}

// IssuerDeps is what the issuers are made from.
type IssuerDeps struct {
	Client kubernetes.Interface
	Logger *zap.Logger
	// SigningTimeout bounds the wait for the cluster's signer (client
	// certificates); zero means clientcert.DefaultTimeout.
	SigningTimeout time.Duration
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
func NewIssuers(kinds []string, deps IssuerDeps) (map[string]broker.Issuer, error) {
	if deps.Logger == nil {
		deps.Logger = zap.NewNop()
	}
	iss := make(map[string]broker.Issuer, len(kinds))
next:
	for _, kind := range kinds {
		for _, k := range issuerKinds {
			if k.kind == kind {
				iss[kind] = k.make(deps)
				continue next
			}
		}
		return nil, fmt.Errorf("unknown or unsupported credential kind %q (this broker issues: %s)", kind, strings.Join(CredentialKinds(), ", "))
	}
	return iss, nil
}
