package broker

import (
	"context"
	"crypto"
	"crypto/x509"
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

// certRequest is what a client-certificate issuance asks the signer for:
// the CSR, its per-lease user and key fingerprint, and the private key if
// the broker made it (returned once, never logged or stored).
type certRequest struct {
	csrPEM      []byte
	keyPEM      []byte
	user        string
	fingerprint string
}

func (c *certRequest) userName() string {
	if c == nil {
		return ""
	}
	return c.user
}

// certificateRequest checks the caller's CSR (or makes a key and a CSR):
// its subject must be exactly CertificateUser(peer, key), so that one key
// is one user, and its key must back no live lease of the peer, so that
// revoking a lease revokes everything its certificate can do.
func (b *Broker) certificateRequest(ctx context.Context, p *policy.Policy, d policy.Decision, req apiv1.KubeconfigRequest) (*certRequest, error) {
	if req.CSR == "" {
		csrPEM, keyPEM, user, err := pki.NewUserCSR(func(pub crypto.PublicKey) (string, error) {
			return apiv1.CertificateUser(d.Peer, pub)
		}, b.cfg.Rand)
		if err != nil {
			return nil, err
		}
		csr, _, err := pki.ParseUserCSRPEM(csrPEM)
		if err != nil {
			return nil, err
		}
		return &certRequest{csrPEM: csrPEM, keyPEM: keyPEM, user: user, fingerprint: fingerprintOf(csr)}, nil
	}
	csr, cn, err := pki.ParseUserCSRPEM([]byte(req.CSR))
	if err != nil {
		return nil, problem.Invalid(apiv1.FieldError{Field: "csr", Detail: problem.Detail(err)})
	}
	want, err := apiv1.CertificateUser(d.Peer, csr.PublicKey)
	if err != nil {
		return nil, problem.Invalid(apiv1.FieldError{Field: "csr", Detail: problem.Detail(err)})
	}
	if cn != want {
		return nil, problem.Invalid(apiv1.FieldError{Field: "csr", Detail: fmt.Sprintf("the subject must be the common name %q (CertificateUser of your peer name and this key), not %q", want, cn)})
	}
	fp := fingerprintOf(csr)
	live, err := b.store().List(ctx, p.Namespaces(), labels.Set{objects.LabelKeyFingerprint: fp})
	if err != nil {
		return nil, err
	}
	now := b.cfg.Clock.Now()
	for i := range live {
		if !lease.Expired(&live[i], now) {
			return nil, problem.Errorf(problem.KindUnprocessable, "this key already backs the live lease %s: use a new key for every certificate, so that revoking one lease revokes all its certificate can do", live[i].Labels[objects.LabelLeaseID])
		}
	}
	return &certRequest{csrPEM: []byte(req.CSR), user: cn, fingerprint: fp}, nil
}

func fingerprintOf(csr *x509.CertificateRequest) string {
	return apiv1.KeyFingerprint(csr.RawSubjectPublicKeyInfo)
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
