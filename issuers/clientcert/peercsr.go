package clientcert

import (
	"crypto"
	"crypto/x509"
	"fmt"
	"io"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// CSR is what a client-certificate issuance asks the signer for: the
// CSR, its per-lease user and key fingerprint, and the private key if the
// broker made it (returned once, never logged or stored).
type CSR struct {
	// Parsed is the CSR, parsed and checked once (pki.ParseUserCSRPEM).
	Parsed      *x509.CertificateRequest
	KeyPEM      []byte
	User        string
	Fingerprint string
}

// UserName is the CSR's user, "" for none.
func (c *CSR) UserName() string {
	if c == nil {
		return ""
	}
	return c.User
}

// NewPeerCSR makes a key, read from rand, and a CSR for peer whose
// subject is CertificateUser(peer, key).
func NewPeerCSR(peer string, rand io.Reader) (*CSR, error) {
	csr, keyPEM, err := pki.NewParsedUserCSR(func(pub crypto.PublicKey) (string, error) {
		return apiv1.CertificateUser(peer, pub)
	}, rand)
	if err != nil {
		return nil, err
	}
	return &CSR{Parsed: csr, KeyPEM: keyPEM, User: csr.Subject.CommonName, Fingerprint: fingerprintOf(csr)}, nil
}

// ParsePeerCSR checks a CSR that peer sent: its subject must be exactly
// CertificateUser(peer, key), so that one key is one user. Its error says
// what is wrong with the CSR, for the caller.
func ParsePeerCSR(peer, csrPEM string) (*CSR, error) {
	csr, cn, err := pki.ParseUserCSRPEM([]byte(csrPEM))
	if err != nil {
		return nil, err
	}
	want, err := apiv1.CertificateUser(peer, csr.PublicKey)
	if err != nil {
		return nil, err
	}
	if cn != want {
		return nil, fmt.Errorf("the subject must be the common name %q (CertificateUser of your peer name and this key), not %q", want, cn)
	}
	return &CSR{Parsed: csr, User: cn, Fingerprint: fingerprintOf(csr)}, nil
}

func fingerprintOf(csr *x509.CertificateRequest) string {
	return apiv1.KeyFingerprint(csr.RawSubjectPublicKeyInfo)
}
