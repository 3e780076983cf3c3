package pki

import (
	"crypto"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
)

// oidCommonName is the X.520 commonName attribute.
var oidCommonName = asn1.ObjectIdentifier{2, 5, 4, 3}

// ParseUserCSRPEM parses, from an untrusted source, a certificate signing
// request for a Kubernetes client certificate (signer
// kubernetes.io/kube-apiserver-client, which makes the common name the
// user name and each organization a group). data must be exactly one PEM
// "CERTIFICATE REQUEST" block of at most MaxCSRPEMSize bytes, as for
// ParseCSRPEM; its self-signature must verify; its key must be ECDSA P-256
// or P-384, Ed25519 or RSA of 2048 to 8192 bits; its subject must be a
// single common name and nothing else (no organization: no groups); and it
// must ask for no SAN. It returns the CSR and its common name. Errors wrap
// ErrInvalidCSR.
func ParseUserCSRPEM(data []byte) (*x509.CertificateRequest, string, error) {
	csr, err := parseCSRPEM(data)
	if err == nil {
		err = checkUserCSR(csr)
	}
	if err != nil {
		return nil, "", fmt.Errorf("parse CSR: %w: %w", ErrInvalidCSR, err)
	}
	return csr, csr.Subject.CommonName, nil
}

func checkUserCSR(csr *x509.CertificateRequest) error {
	if err := checkPublicKey(csr.PublicKey); err != nil {
		return err
	}
	if err := csr.CheckSignature(); err != nil {
		return fmt.Errorf("signature: %w", err)
	}
	if n := len(csr.DNSNames) + len(csr.IPAddresses) + len(csr.EmailAddresses) + len(csr.URIs); n != 0 {
		return fmt.Errorf("%d SANs, want none: a Kubernetes client certificate names its user in the common name only", n)
	}
	// Subject.Names holds every attribute of the subject as parsed,
	// including ones pkix.Name has no field for.
	if len(csr.Subject.Names) != 1 || !csr.Subject.Names[0].Type.Equal(oidCommonName) || csr.Subject.CommonName == "" {
		return errors.New("the subject must be a single common name (the user) and nothing else: no organization, which Kubernetes would make a group")
	}
	return nil
}

// NewUserCSR makes a new ECDSA P-256 key and a CSR for a Kubernetes client
// certificate whose only subject attribute is the common name user(the
// key's public half): what ParseUserCSRPEM accepts. A user name derived
// from the key (api/v1.CertificateUser) needs the key first. rnd nil
// means crypto/rand.Reader. keyPEM is a PKCS#8 "PRIVATE KEY" block: a
// secret.
func NewUserCSR(user func(crypto.PublicKey) (string, error), rnd io.Reader) (csrPEM, keyPEM []byte, name string, err error) {
	csr, keyPEM, err := NewParsedUserCSR(user, rnd)
	if err != nil {
		return nil, nil, "", err
	}
	return pem.EncodeToMemory(&pem.Block{Type: pemTypeCSR, Bytes: csr.Raw}), keyPEM, csr.Subject.CommonName, nil
}

// NewParsedUserCSR is NewUserCSR for the broker, which submits the CSR
// itself: the CSR parsed (its DER in Raw) instead of PEM, never checked
// again against its own signature (about 60 µs of CPU per issuance).
func NewParsedUserCSR(user func(crypto.PublicKey) (string, error), rnd io.Reader) (csr *x509.CertificateRequest, keyPEM []byte, err error) {
	_, rnd = clockAndRand(nil, rnd)
	key, err := newKey(rnd)
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	name, err := user(key.Public())
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	if name == "" {
		return nil, nil, errors.New("new CSR: empty user name")
	}
	der, err := x509.CreateCertificateRequest(rnd, &x509.CertificateRequest{Subject: pkix.Name{CommonName: name}}, key)
	if err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	if csr, err = x509.ParseCertificateRequest(der); err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	if keyPEM, err = encodeKey(key); err != nil {
		return nil, nil, fmt.Errorf("new CSR: %w", err)
	}
	return csr, keyPEM, nil
}
