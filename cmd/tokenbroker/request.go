package main

import (
	"errors"
	"fmt"

	"github.com/spf13/pflag"
	"github.com/spf13/viper"

	"github.com/tokenbroker/tokenbroker/agent/config"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// brokerRequest is what "get kubeconfig" and "credential" ask a broker
// for, and as whom.
type brokerRequest struct {
	Broker      string
	IdentityDir string
	Request     config.RequestConfig
}

// addBrokerRequestFlags defines the flags of brokerRequest.
func addBrokerRequestFlags(fs *pflag.FlagSet) {
	fs.String("broker", "", "URL of the broker's mTLS listener, e.g. https://east.example.com:8443 (required)")
	fs.String("identity-dir", "", "directory with tls.crt, tls.key and ca.crt (required)")
	fs.String("namespace", "", "namespace of the ServiceAccount in the broker's cluster (required)")
	fs.String("service-account", "", "the ServiceAccount (required for a token)")
	fs.String("credential", "token", "token, or client-certificate (a certificate for a per-lease user with the grant's role; the key is made here)")
	fs.String("access", "", "direct (a credential of the API server) or gateway (a certificate for this lease, good only at the broker's lease gateway; the key is made here); empty means the mode of the grant")
	fs.String("ttl", "", "lifetime to ask for, e.g. 8h; empty means the broker's default")
	fs.String("min-ttl", "", "shortest lifetime accepted; the broker refuses rather than grant less")
	fs.StringSlice("audience", nil, "audience of the token (repeatable); empty means the API server's default")
}

// brokerRequestFrom reads the flags of addBrokerRequestFlags and checks
// them as the broker would (RequestConfig.Validate), every problem at once.
func brokerRequestFrom(v *viper.Viper) (brokerRequest, []error) {
	r := brokerRequest{
		Broker:      v.GetString("broker"),
		IdentityDir: v.GetString("identity-dir"),
		Request: config.RequestConfig{
			Namespace:      v.GetString("namespace"),
			ServiceAccount: v.GetString("service-account"),
			TTL:            v.GetString("ttl"),
			MinTTL:         v.GetString("min-ttl"),
			Audiences:      v.GetStringSlice("audience"),
			Access:         v.GetString("access"),
		},
	}
	var errs []error
	switch c := v.GetString("credential"); c {
	case apiv1.CredentialToken:
	case "client-certificate", apiv1.CredentialClientCertificate:
		r.Request.Credential = apiv1.CredentialClientCertificate
	default:
		errs = append(errs, fmt.Errorf("--credential must be token or client-certificate, not %q", c))
	}
	required := []struct{ flag, val string }{
		{"broker", r.Broker}, {"identity-dir", r.IdentityDir}, {"namespace", r.Request.Namespace},
	}
	if r.Request.Credential == "" {
		required = append(required, struct{ flag, val string }{"service-account", r.Request.ServiceAccount})
	} else if r.Request.ServiceAccount != "" {
		errs = append(errs, errors.New("--service-account is for tokens: a client certificate is for a per-lease user with the grant's role"))
	}
	for _, f := range required {
		if f.val == "" {
			errs = append(errs, fmt.Errorf("--%s is required", f.flag))
		}
	}
	if len(errs) == 0 {
		if err := r.Request.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	return r, errs
}
