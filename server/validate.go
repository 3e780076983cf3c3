package server

import (
	"fmt"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Bounds on a KubeconfigRequest. The policy decides the real TTL; these only
// keep nonsense out before the broker sees it.
const (
	maxTTL         = 8760 * time.Hour // one year
	maxDurationLen = 32
	maxAudiences   = 16
	maxAudienceLen = 256
)

// validateKubeconfigRequest checks the syntax of a request and returns one
// FieldError per problem found; nil means valid. Whether the caller may have
// what it asks for is the broker's decision.
func validateKubeconfigRequest(req apiv1.KubeconfigRequest) []apiv1.FieldError {
	var errs []apiv1.FieldError
	add := func(field, detail string) {
		errs = append(errs, apiv1.FieldError{Field: field, Detail: detail})
	}

	if req.Namespace == "" {
		add("namespace", "is required")
	} else {
		for _, msg := range validation.IsDNS1123Label(req.Namespace) {
			add("namespace", msg)
		}
	}
	if req.ServiceAccount == "" {
		add("serviceAccount", "is required")
	} else {
		for _, msg := range validation.IsDNS1123Subdomain(req.ServiceAccount) {
			add("serviceAccount", msg)
		}
	}

	ttl, ttlOK := validateDuration("ttl", req.TTL, add)
	minTTL, minOK := validateDuration("minTTL", req.MinTTL, add)
	if ttlOK && minOK && ttl > 0 && minTTL > ttl {
		add("minTTL", "must not be longer than ttl")
	}

	if len(req.Audiences) > maxAudiences {
		add("audiences", fmt.Sprintf("must have at most %d items", maxAudiences))
	} else {
		for i, a := range req.Audiences {
			field := fmt.Sprintf("audiences[%d]", i)
			switch {
			case strings.TrimSpace(a) == "":
				add(field, "must not be empty")
			case len(a) > maxAudienceLen:
				add(field, fmt.Sprintf("must be at most %d characters", maxAudienceLen))
			}
		}
	}

	switch req.Credential {
	case "", apiv1.CredentialToken, apiv1.CredentialClientCertificate:
	default:
		add("credential", fmt.Sprintf("must be %q or %q", apiv1.CredentialToken, apiv1.CredentialClientCertificate))
	}
	return errs
}

// validateDuration checks an optional duration field. It returns the
// parsed value (0 if empty) and whether the field is valid.
func validateDuration(field, s string, add func(field, detail string)) (time.Duration, bool) {
	if s == "" {
		return 0, true
	}
	if len(s) > maxDurationLen {
		add(field, fmt.Sprintf("must be at most %d characters", maxDurationLen))
		return 0, false
	}
	d, err := time.ParseDuration(s)
	switch {
	case err != nil:
		add(field, `must be a duration such as "2h" or "90m"`)
		return 0, false
	case d <= 0:
		add(field, "must be positive")
		return 0, false
	case d > maxTTL:
		add(field, "must be at most 8760h")
		return 0, false
	}
	return d, true
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
