package pki

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/asn1"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"time"
)

// Description is what "tokenbroker pki inspect" says about one
// certificate or CSR, without anything secret; it is also the JSON form
// (-o json prints a list of them).
type Description struct {
	// Type is "certificate" or "certificateRequest".
	Type           string     `json:"type"`
	Subject        string     `json:"subject"`
	Issuer         string     `json:"issuer,omitempty"`
	Identity       string     `json:"identity,omitempty"`
	IdentityError  string     `json:"identityError,omitempty"`
	DNSNames       []string   `json:"dnsNames,omitempty"`
	IPAddresses    []string   `json:"ipAddresses,omitempty"`
	URIs           []string   `json:"uris,omitempty"`
	EmailAddresses []string   `json:"emailAddresses,omitempty"`
	SerialNumber   string     `json:"serialNumber,omitempty"`
	NotBefore      *time.Time `json:"notBefore,omitempty"`
	NotAfter       *time.Time `json:"notAfter,omitempty"`
	// ExpiresIn is NotAfter minus now in seconds, negative once expired.
	ExpiresIn   *int64   `json:"expiresInSeconds,omitempty"`
	KeyType     string   `json:"keyType"`
	KeyUsage    []string `json:"keyUsage,omitempty"`
	ExtKeyUsage []string `json:"extKeyUsage,omitempty"`
	IsCA        bool     `json:"isCA"`
	// MaxPathLen is set for a CA with a path length constraint.
	MaxPathLen *int `json:"maxPathLen,omitempty"`
	SelfSigned bool `json:"selfSigned,omitempty"`
	// Fingerprint is "sha256:<hex>" of the DER encoding.
	Fingerprint string `json:"fingerprint"`
	// EnrollmentError, for a CSR, says why a broker would refuse it; empty
	// when it would be accepted.
	EnrollmentError string `json:"enrollmentError,omitempty"`
}

// Describe describes the certificates (a leaf, a chain, a bundle) or the
// CSR in PEM data; it refuses a private key, which it must never print.
func Describe(data []byte, now time.Time) ([]Description, error) {
	trimmed := bytes.TrimLeft(data, " \t\r\n")
	if bytes.Contains(trimmed, []byte("PRIVATE KEY-----")) {
		return nil, errors.New("this is a private key file; inspect describes certificates and CSRs only")
	}
	if bytes.HasPrefix(trimmed, []byte("-----BEGIN CERTIFICATE REQUEST-----")) {
		d, err := describeCSR(data)
		if err != nil {
			return nil, err
		}
		return []Description{d}, nil
	}
	certs, err := ParseCertificatesPEM(data)
	if err != nil {
		return nil, err
	}
	descs := make([]Description, 0, len(certs))
	for _, c := range certs {
		descs = append(descs, DescribeCertificate(c, now))
	}
	return descs, nil
}

// DescribeCertificate describes one certificate as of now.
func DescribeCertificate(c *x509.Certificate, now time.Time) Description {
	notBefore, notAfter := c.NotBefore.UTC(), c.NotAfter.UTC()
	expiresIn := int64(notAfter.Sub(now) / time.Second)
	d := Description{
		Type:           "certificate",
		Subject:        c.Subject.String(),
		Issuer:         c.Issuer.String(),
		DNSNames:       c.DNSNames,
		EmailAddresses: c.EmailAddresses,
		SerialNumber:   c.SerialNumber.Text(16),
		NotBefore:      &notBefore,
		NotAfter:       &notAfter,
		ExpiresIn:      &expiresIn,
		KeyType:        keyType(c.PublicKey),
		KeyUsage:       keyUsageNames(c.KeyUsage),
		ExtKeyUsage:    extKeyUsageNames(c.ExtKeyUsage, c.UnknownExtKeyUsage),
		IsCA:           c.BasicConstraintsValid && c.IsCA,
		SelfSigned:     bytes.Equal(c.RawIssuer, c.RawSubject) && c.CheckSignatureFrom(c) == nil,
		Fingerprint:    Fingerprint(c),
	}
	for _, ip := range c.IPAddresses {
		d.IPAddresses = append(d.IPAddresses, ip.String())
	}
	for _, u := range c.URIs {
		d.URIs = append(d.URIs, u.String())
	}
	if d.IsCA && (c.MaxPathLen > 0 || c.MaxPathLenZero) {
		n := c.MaxPathLen
		d.MaxPathLen = &n
	}
	if !d.IsCA {
		if id, err := IdentityFromCert(c); err == nil {
			d.Identity = id
		} else if len(c.URIs) > 0 {
			d.IdentityError = err.Error()
		}
	}
	return d
}

func describeCSR(data []byte) (Description, error) {
	block, _ := pem.Decode(bytes.TrimLeft(data, " \t\r\n"))
	if block == nil {
		return Description{}, errors.New("malformed PEM certificate request")
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return Description{}, fmt.Errorf("parse certificate request: %w", err)
	}
	sum := sha256.Sum256(csr.Raw)
	d := Description{
		Type:           "certificateRequest",
		Subject:        csr.Subject.String(),
		DNSNames:       csr.DNSNames,
		EmailAddresses: csr.EmailAddresses,
		KeyType:        keyType(csr.PublicKey),
		Fingerprint:    "sha256:" + hex.EncodeToString(sum[:]),
	}
	for _, ip := range csr.IPAddresses {
		d.IPAddresses = append(d.IPAddresses, ip.String())
	}
	for _, u := range csr.URIs {
		d.URIs = append(d.URIs, u.String())
	}
	// The broker's verdict, with the broker's parser.
	if _, id, err := ParseCSRPEM(data); err != nil {
		d.EnrollmentError = err.Error()
	} else {
		d.Identity = id
	}
	return d, nil
}

func keyType(pub any) string {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		return "ECDSA " + k.Curve.Params().Name
	case *rsa.PublicKey:
		return fmt.Sprintf("RSA %d", k.N.BitLen())
	case ed25519.PublicKey:
		return "Ed25519"
	default:
		return fmt.Sprintf("unknown (%T)", pub)
	}
}

var keyUsageBits = []struct {
	bit  x509.KeyUsage
	name string
}{
	{x509.KeyUsageDigitalSignature, "digitalSignature"},
	{x509.KeyUsageContentCommitment, "contentCommitment"},
	{x509.KeyUsageKeyEncipherment, "keyEncipherment"},
	{x509.KeyUsageDataEncipherment, "dataEncipherment"},
	{x509.KeyUsageKeyAgreement, "keyAgreement"},
	{x509.KeyUsageCertSign, "keyCertSign"},
	{x509.KeyUsageCRLSign, "cRLSign"},
	{x509.KeyUsageEncipherOnly, "encipherOnly"},
	{x509.KeyUsageDecipherOnly, "decipherOnly"},
}

func keyUsageNames(u x509.KeyUsage) []string {
	var names []string
	for _, b := range keyUsageBits {
		if u&b.bit != 0 {
			names = append(names, b.name)
		}
	}
	return names
}

func extKeyUsageNames(usages []x509.ExtKeyUsage, unknown []asn1.ObjectIdentifier) []string {
	known := map[x509.ExtKeyUsage]string{
		x509.ExtKeyUsageAny:             "any",
		x509.ExtKeyUsageServerAuth:      "serverAuth",
		x509.ExtKeyUsageClientAuth:      "clientAuth",
		x509.ExtKeyUsageCodeSigning:     "codeSigning",
		x509.ExtKeyUsageEmailProtection: "emailProtection",
		x509.ExtKeyUsageTimeStamping:    "timeStamping",
		x509.ExtKeyUsageOCSPSigning:     "OCSPSigning",
	}
	var names []string
	for _, u := range usages {
		if n, ok := known[u]; ok {
			names = append(names, n)
		} else {
			names = append(names, fmt.Sprintf("extKeyUsage(%d)", u))
		}
	}
	for _, oid := range unknown {
		names = append(names, oid.String())
	}
	return names
}
