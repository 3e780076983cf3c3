package v1

import (
	"crypto"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"fmt"
)

// CertificateUserPrefix starts the user name of every client certificate
// the broker issues. It is never a "system:" name, and it names no group.
const CertificateUserPrefix = "tokenbroker:"

// certificateUserHashLen is how many hex digits of the key's SHA-256 the
// user name keeps: 128 bits, so that two keys never share a user.
const certificateUserHashLen = 32

// CertificateUser is the Kubernetes user name of a client certificate for
// the policy peer named peer with public key pub:
// "tokenbroker:<peer>:<the first 32 hex digits of the SHA-256 of the key's
// SubjectPublicKeyInfo>". A caller that sends its own CSR computes it
// before asking (GET /v1/whoami says its peer name) and makes it the CSR's
// only subject attribute, the common name; the broker refuses any other.
// One key, one user: the broker refuses a key that backs a live lease, so
// revoking a lease revokes everything its certificate could do.
func CertificateUser(peer string, pub crypto.PublicKey) (string, error) {
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		return "", fmt.Errorf("certificate user: %w", err)
	}
	return CertificateUserPrefix + peer + ":" + KeyFingerprint(der), nil
}

// KeyFingerprint is the part of a certificate user name that comes from
// the key: the first 32 hex digits of the SHA-256 of its DER
// SubjectPublicKeyInfo. Lease Secrets carry it as a label, so a reused key
// is found with one selector.
func KeyFingerprint(spkiDER []byte) string {
	sum := sha256.Sum256(spkiDER)
	return hex.EncodeToString(sum[:])[:certificateUserHashLen]
}
