package server

import (
	"fmt"
	"strings"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// validateKubeconfigRequest checks the syntax of a request with the rule
// set the agent shares (apiv1.ValidateKubeconfigRequest) and returns one
// FieldError per problem found; nil means valid.
func validateKubeconfigRequest(req apiv1.KubeconfigRequest) []apiv1.FieldError {
	return apiv1.FieldErrors(apiv1.ValidateKubeconfigRequest(req, nil))
}

// validateCertificateRequest checks the syntax of a certificate request:
// a CSR is required and bounded. Parsing it, and whether its identity is
// the caller's, are the broker's.
func validateCertificateRequest(req apiv1.CertificateRequest) []apiv1.FieldError {
	switch {
	case strings.TrimSpace(req.CSR) == "":
		return []apiv1.FieldError{{Field: "csr", Detail: "is required"}}
	case len(req.CSR) > pki.MaxCSRPEMSize:
		return []apiv1.FieldError{{Field: "csr", Detail: fmt.Sprintf("must be at most %d bytes", pki.MaxCSRPEMSize)}}
	}
	return nil
}
