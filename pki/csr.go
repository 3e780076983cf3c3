package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/url"
)

// MaxCSRPEMSize bounds a PEM certificate signing request. A CSR for an
// RSA-8192 key is about 2.5 KiB; the limit leaves room, not a parser's
// worth of work for an attacker.
const MaxCSRPEMSize = 16 << 10

const pemTypeCSR = "CERTIFICATE REQUEST"

// ErrInvalidCSR is wrapped by every error about a certificate signing request
// that this package refuses, so that callers can answer 400 rather than 500.
// The messages describe what is wrong and hold nothing secret. Not
// retryable.
var ErrInvalidCSR = errors.New("invalid certificate signing request")

// ParseCSRPEM parses a certificate signing request from an untrusted source
// and returns it with the cluster identity it asks for.
//
// data must be exactly one PEM "CERTIFICATE REQUEST" block of at most
// MaxCSRPEMSize bytes with nothing but whitespace around it and no headers
// (the strictness of ParseCertificatesPEM). The CSR's self-signature must
// verify, its key must be ECDSA P-256 or P-384, Ed25519 or RSA of 2048 to
// 8192 bits, and it must carry exactly one URI SAN, a valid cluster identity
// (see ParseIdentity), and no DNS, IP or email SANs. Other fields (subject,
// extensions) are allowed and ignored: SignClient takes nothing from the CSR
// but its public key. Errors wrap ErrInvalidCSR.
func ParseCSRPEM(data []byte) (*x509.CertificateRequest, string, error) {
	csr, err := parseCSRPEM(data)
	if err != nil {
		return nil, "", fmt.Errorf("parse CSR: %w: %w", ErrInvalidCSR, err)
	}
	id, err := checkCSR(csr)
	if err != nil {
		return nil, "", fmt.Errorf("parse CSR: %w: %w", ErrInvalidCSR, err)
	}
	return csr, id, nil
}

// parseCSRPEM decodes the one PEM block and parses the CSR without judging
// its content.
func parseCSRPEM(data []byte) (*x509.CertificateRequest, error) {
	if len(data) > MaxCSRPEMSize {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrPEMTooLarge, len(data), MaxCSRPEMSize)
	}
	rest := bytes.TrimLeft(data, " \t\r\n")
	if len(rest) == 0 {
		return nil, errors.New("no PEM certificate request found")
	}
	block, rest, err := decodeOne(rest)
	if err != nil {
		return nil, err
	}
	if block.Type != pemTypeCSR {
		return nil, fmt.Errorf("unexpected PEM type %q, want %q", block.Type, pemTypeCSR)
	}
	if len(bytes.TrimLeft(rest, " \t\r\n")) != 0 {
		return nil, errors.New("unexpected data after the certificate request block")
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, err
	}
	return csr, nil
}

// checkCSR applies ParseCSRPEM's rules to a parsed CSR and returns its
// identity.
func checkCSR(csr *x509.CertificateRequest) (string, error) {
	// The key first: it bounds the cost of checking the signature.
	if err := checkPublicKey(csr.PublicKey); err != nil {
		return "", err
	}
	if err := csr.CheckSignature(); err != nil {
		return "", fmt.Errorf("signature: %w", err)
	}
	if n := len(csr.DNSNames) + len(csr.IPAddresses) + len(csr.EmailAddresses); n != 0 {
		return "", fmt.Errorf("%d DNS, IP or email SANs, want none: a cluster certificate carries its identity only", n)
	}
	if len(csr.URIs) != 1 {
		return "", fmt.Errorf("%d URI SANs, want exactly 1 (the cluster identity)", len(csr.URIs))
	}
	id := csr.URIs[0].String()
	if _, _, err := ParseIdentity(id); err != nil {
		return "", err
	}
	return id, nil
}

// maxRSABits bounds an enrolled RSA key: a huge modulus would make every
// signature check a denial of service.
const maxRSABits = 8192

// checkPublicKey accepts the keys a cluster may enroll: ECDSA P-256 and
// P-384, Ed25519 and RSA of 2048 to 8192 bits.
func checkPublicKey(pub crypto.PublicKey) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		if k.Curve == elliptic.P256() || k.Curve == elliptic.P384() {
			return nil
		}
		return errors.New("unsupported ECDSA curve, want P-256 or P-384")
	case ed25519.PublicKey:
		return nil
	case *rsa.PublicKey:
		if k.N.BitLen() < minRSABits {
			return fmt.Errorf("RSA key of %d bits is shorter than %d", k.N.BitLen(), minRSABits)
		}
		if k.N.BitLen() > maxRSABits {
			return fmt.Errorf("RSA key of %d bits is longer than %d", k.N.BitLen(), maxRSABits)
		}
		return nil
	default:
		return fmt.Errorf("unsupported public key type %T", pub)
	}
}

// NewCSR makes a new ECDSA P-256 key and a CSR for identity signed with it,
// what a cluster sends to POST /v1/certificates. The CSR carries identity as
// its common name and only URI SAN. rnd nil means crypto/rand.Reader (since
// Go 1.26 key generation and signing use the system's secure source
// whatever rnd is). keyPEM is a PKCS#8 "PRIVATE KEY" block: a secret.
func NewCSR(identity string, rnd io.Reader) (csrPEM, keyPEM []byte, err error) {
	if _, _, err := ParseIdentity(identity); err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	u, err := url.Parse(identity)
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	_, rnd = clockAndRand(nil, rnd)
	key, err := newKey(rnd)
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	der, err := x509.CreateCertificateRequest(rnd, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: identity},
		URIs:    []*url.URL{u},
	}, key)
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	keyPEM, err = encodeKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: pemTypeCSR, Bytes: der}), keyPEM, nil
}
