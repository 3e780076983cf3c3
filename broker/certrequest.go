package broker

import (
	"context"
	"errors"
	"fmt"

	"k8s.io/apimachinery/pkg/labels"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/lease"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/issuers"
	"github.com/tokenbroker/tokenbroker/issuers/clientcert"
	"github.com/tokenbroker/tokenbroker/pki"
)

// certificateRequest checks the caller's CSR (or makes a key and a CSR)
// as clientcert's Peer CSR functions do, and that its key backs no live
// lease of the peer, so that revoking a lease revokes everything its
// certificate can do.
func (b *Broker) certificateRequest(ctx context.Context, p *policy.Policy, d policy.Decision, req apiv1.KubeconfigRequest) (*clientcert.CSR, error) {
	if req.CSR == "" {
		return clientcert.NewPeerCSR(d.Peer, b.cfg.Rand)
	}
	csr, err := clientcert.ParsePeerCSR(d.Peer, req.CSR)
	if err != nil {
		return nil, problem.Invalid(apiv1.FieldError{Field: "csr", Detail: problem.Detail(err)})
	}
	live, err := b.store().List(ctx, p.Namespaces(), labels.Set{objects.LabelKeyFingerprint: csr.Fingerprint})
	if err != nil {
		return nil, err
	}
	now := b.cfg.Clock.Now()
	for i := range live {
		if !lease.Expired(&live[i], now) {
			return nil, problem.Errorf(problem.KindUnprocessable, "this key already backs the live lease %s: use a new key for every certificate, so that revoking one lease revokes all its certificate can do", live[i].Labels[objects.LabelLeaseID])
		}
	}
	return csr, nil
}

// classifyIssuer classifies an issuer's failure for the caller.
func classifyIssuer(err error, req apiv1.KubeconfigRequest) error {
	switch {
	case errors.Is(err, clientcert.ErrNotSigned):
		return problem.Wrap(problem.KindTimeout, "the cluster did not sign the certificate in time: it may not sign for "+clientcert.Signer+" at all (docs/security.md, Client certificates), or it is overloaded; nothing was issued", err)
	case errors.Is(err, clientcert.ErrRefused):
		return problem.Wrap(problem.KindUnprocessable, "the cluster refused the certificate signing request", err)
	case errors.Is(err, pki.ErrInvalidCSR):
		return problem.Wrap(problem.KindInternal, "", err)
	}
	if req.Credential == issuers.KindClientCertificate {
		return problem.Classify(err, "issue client certificate", fmt.Sprintf("role for namespace %s not found", req.Namespace))
	}
	return problem.Classify(err, "issue credential", fmt.Sprintf("ServiceAccount %s/%s not found", req.Namespace, req.ServiceAccount))
}
