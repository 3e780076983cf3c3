package pki

import (
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
)

const (
	spiffeScheme = "spiffe://"
	clusterPath  = "cluster"
	// maxIdentityLen is the SPIFFE ID limit (2048 bytes); ours are far
	// shorter because of the trust domain and label limits.
	maxIdentityLen = 2048
	maxDomainLen   = 253
	maxLabelLen    = 63
)

// ErrInvalidIdentity is wrapped by every identity validation error, so that
// callers can tell a malformed identity from other failures. Not retryable.
var ErrInvalidIdentity = errors.New("invalid cluster identity")

// ClusterIdentity validates a trust domain and a cluster name and returns the
// cluster identity spiffe://<trustDomain>/cluster/<cluster>.
//
// The trust domain is a lowercase DNS-style name: dot-separated labels of
// lowercase letters, digits and inner hyphens, at most 253 characters. The
// cluster name is a DNS-1123 label: lowercase letters, digits and inner
// hyphens, at most 63 characters. Nothing is normalised: "East" is rejected,
// not lowercased, so that one cluster has exactly one spelling.
func ClusterIdentity(trustDomain, cluster string) (string, error) {
	if err := validateTrustDomain(trustDomain); err != nil {
		return "", err
	}
	if err := validateClusterName(cluster); err != nil {
		return "", err
	}
	return spiffeScheme + trustDomain + "/" + clusterPath + "/" + cluster, nil
}

// ParseIdentity splits a cluster identity into its trust domain and cluster
// name. It accepts exactly the strings ClusterIdentity returns: no port, user
// info, query, fragment, percent-encoding, trailing slash or upper case.
func ParseIdentity(id string) (trustDomain, cluster string, err error) {
	if len(id) > maxIdentityLen {
		return "", "", fmt.Errorf("%w: longer than %d bytes", ErrInvalidIdentity, maxIdentityLen)
	}
	rest, ok := strings.CutPrefix(id, spiffeScheme)
	if !ok {
		return "", "", fmt.Errorf("%w: %q does not start with %q", ErrInvalidIdentity, id, spiffeScheme)
	}
	parts := strings.Split(rest, "/")
	if len(parts) != 3 || parts[1] != clusterPath {
		return "", "", fmt.Errorf("%w: %q is not of the form spiffe://<trust-domain>/cluster/<name>", ErrInvalidIdentity, id)
	}
	if err := validateTrustDomain(parts[0]); err != nil {
		return "", "", err
	}
	if err := validateClusterName(parts[2]); err != nil {
		return "", "", err
	}
	return parts[0], parts[2], nil
}

// IdentityFromCert returns the cluster identity a client certificate carries.
// Following the SPIFFE X.509-SVID rules, the certificate must not be a CA and
// must have exactly one URI SAN, which must be a valid cluster identity. It
// does not verify the certificate; do that first (the TLS handshake does).
func IdentityFromCert(cert *x509.Certificate) (string, error) {
	if cert == nil {
		return "", fmt.Errorf("%w: no certificate", ErrInvalidIdentity)
	}
	if cert.IsCA {
		return "", fmt.Errorf("%w: certificate is a CA", ErrInvalidIdentity)
	}
	if len(cert.URIs) != 1 {
		return "", fmt.Errorf("%w: certificate has %d URI SANs, want exactly 1", ErrInvalidIdentity, len(cert.URIs))
	}
	id := cert.URIs[0].String()
	if _, _, err := ParseIdentity(id); err != nil {
		return "", err
	}
	return id, nil
}

// Fingerprint returns "sha256:" and the lowercase hex SHA-256 of the
// certificate's DER encoding: the way logs and output name a certificate.
func Fingerprint(cert *x509.Certificate) string {
	sum := sha256.Sum256(cert.Raw)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func validateTrustDomain(td string) error {
	if td == "" {
		return fmt.Errorf("%w: empty trust domain", ErrInvalidIdentity)
	}
	if len(td) > maxDomainLen {
		return fmt.Errorf("%w: trust domain longer than %d characters", ErrInvalidIdentity, maxDomainLen)
	}
	for label := range strings.SplitSeq(td, ".") {
		if !isLabel(label) {
			return fmt.Errorf("%w: trust domain %q must be lowercase DNS labels separated by dots", ErrInvalidIdentity, td)
		}
	}
	return nil
}

func validateClusterName(name string) error {
	if !isLabel(name) {
		return fmt.Errorf("%w: cluster name %q must be a DNS-1123 label (lowercase letters, digits, inner '-', at most %d characters)",
			ErrInvalidIdentity, name, maxLabelLen)
	}
	return nil
}

// isLabel reports whether s is a DNS-1123 label.
func isLabel(s string) bool {
	if s == "" || len(s) > maxLabelLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c == '-' && i > 0 && i < len(s)-1:
		default:
			return false
		}
	}
	return true
}

// validateDNSName checks a server DNS SAN: lowercase DNS labels, optionally
// led by one "*" wildcard label.
func validateDNSName(name string) error {
	if name == "" || len(name) > maxDomainLen {
		return fmt.Errorf("invalid DNS name %q", name)
	}
	rest := name
	if after, ok := strings.CutPrefix(name, "*."); ok {
		rest = after
	}
	for label := range strings.SplitSeq(rest, ".") {
		if !isLabel(label) {
			return fmt.Errorf("invalid DNS name %q: want lowercase DNS labels separated by dots", name)
		}
	}
	return nil
}
