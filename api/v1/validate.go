package v1

import (
	"fmt"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// Bounds on a KubeconfigRequest. The broker's policy decides the real TTL;
// these only keep nonsense out before it is asked.
const (
	MaxRequestTTL  = 8760 * time.Hour // one year
	maxDurationLen = 32
	MaxAudiences   = 16
	MaxAudienceLen = 256
	// MaxCSRLen bounds the PEM CSR of a client-certificate request (one
	// for an RSA-8192 key is about 2.5 KiB).
	MaxCSRLen = 16 << 10
)

// ValidateKubeconfigRequest checks the syntax of a request, the one rule
// set of the broker (which answers 400 with the problems) and of the agent
// and "tokenbroker get kubeconfig" (which refuse to send such a request).
// Field paths are below path (nil for the request body itself). Whether
// the caller may have what it asks for is the broker's decision.
func ValidateKubeconfigRequest(req KubeconfigRequest, path *field.Path) field.ErrorList {
	var errs field.ErrorList
	if req.Namespace == "" {
		errs = append(errs, field.Required(path.Child("namespace"), "is required"))
	} else if msgs := validation.IsDNS1123Label(req.Namespace); len(msgs) > 0 {
		errs = append(errs, field.Invalid(path.Child("namespace"), req.Namespace, strings.Join(msgs, "; ")))
	}
	cert := req.Credential == CredentialClientCertificate
	switch {
	case cert && req.ServiceAccount != "":
		errs = append(errs, field.Forbidden(path.Child("serviceAccount"), "must be empty for a clientCertificate: the certificate is for a per-lease user with the grant's role"))
	case cert:
	case req.ServiceAccount == "":
		errs = append(errs, field.Required(path.Child("serviceAccount"), "is required"))
	default:
		if msgs := validation.IsDNS1123Subdomain(req.ServiceAccount); len(msgs) > 0 {
			errs = append(errs, field.Invalid(path.Child("serviceAccount"), req.ServiceAccount, strings.Join(msgs, "; ")))
		}
	}
	switch req.Access {
	case "", AccessDirect:
	case AccessGateway:
		if cert {
			errs = append(errs, field.Forbidden(path.Child("credential"), "must be token (or empty) with access gateway: the gateway forwards as the ServiceAccount"))
		}
		if len(req.Audiences) > 0 {
			errs = append(errs, field.Forbidden(path.Child("audiences"), "must be empty with access gateway: the credential is a client certificate for the gateway, which has no audience"))
		}
	default:
		errs = append(errs, field.Invalid(path.Child("access"), req.Access, fmt.Sprintf("must be %q or %q", AccessDirect, AccessGateway)))
	}
	switch {
	case req.CSR != "" && !cert && req.Access == AccessDirect:
		errs = append(errs, field.Forbidden(path.Child("csr"), "is only for credential clientCertificate or access gateway"))
	case len(req.CSR) > MaxCSRLen:
		errs = append(errs, field.Invalid(path.Child("csr"), "", fmt.Sprintf("must be at most %d bytes", MaxCSRLen)))
	}
	if cert && len(req.Audiences) > 0 {
		errs = append(errs, field.Forbidden(path.Child("audiences"), "only tokens have audiences"))
	}

	ttl, ttlErr := validateDuration(path.Child("ttl"), req.TTL)
	minTTL, minErr := validateDuration(path.Child("minTTL"), req.MinTTL)
	errs = append(errs, ttlErr...)
	errs = append(errs, minErr...)
	if ttlErr == nil && minErr == nil && ttl > 0 && minTTL > ttl {
		errs = append(errs, field.Invalid(path.Child("minTTL"), req.MinTTL, "must not be longer than ttl"))
	}

	if len(req.Audiences) > MaxAudiences {
		errs = append(errs, field.TooMany(path.Child("audiences"), len(req.Audiences), MaxAudiences)) // "must have at most 16 items"
	} else {
		for i, a := range req.Audiences {
			switch {
			case strings.TrimSpace(a) == "":
				errs = append(errs, field.Invalid(path.Child("audiences").Index(i), a, "must not be empty"))
			case len(a) > MaxAudienceLen:
				errs = append(errs, field.Invalid(path.Child("audiences").Index(i), "", fmt.Sprintf("must be at most %d characters", MaxAudienceLen)))
			}
		}
	}

	switch req.Credential {
	case "", CredentialToken, CredentialClientCertificate:
	default:
		errs = append(errs, field.Invalid(path.Child("credential"), req.Credential, fmt.Sprintf("must be %q or %q", CredentialToken, CredentialClientCertificate)))
	}
	return errs
}

// validateDuration checks an optional duration field; it returns the
// parsed value (0 if empty).
func validateDuration(path *field.Path, s string) (time.Duration, field.ErrorList) {
	if s == "" {
		return 0, nil
	}
	if len(s) > maxDurationLen {
		return 0, field.ErrorList{field.Invalid(path, "", fmt.Sprintf("must be at most %d characters", maxDurationLen))}
	}
	d, err := time.ParseDuration(s)
	switch {
	case err != nil:
		return 0, field.ErrorList{field.Invalid(path, s, `must be a duration such as "2h" or "90m"`)}
	case d <= 0:
		return 0, field.ErrorList{field.Invalid(path, s, "must be positive")}
	case d > MaxRequestTTL:
		return 0, field.ErrorList{field.Invalid(path, s, "must be at most 8760h")}
	}
	return d, nil
}

// FieldErrors turns a field.ErrorList into the problem+json form: the
// field path and the message, without the value (which may be long or
// secret) or the error type.
func FieldErrors(errs field.ErrorList) []FieldError {
	if len(errs) == 0 {
		return nil
	}
	out := make([]FieldError, len(errs))
	for i, e := range errs {
		out[i] = FieldError{Field: e.Field, Detail: e.Detail}
	}
	return out
}
