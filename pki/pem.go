package pki

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
)

// Limits on PEM input. Certificates and keys come from files and from peers,
// so every parser bounds what it reads before decoding it.
const (
	// MaxCertificatesPEMSize bounds a PEM certificate bundle.
	MaxCertificatesPEMSize = 1 << 20
	// MaxCertificates bounds the number of certificates in a bundle.
	MaxCertificates = 100
	// MaxPrivateKeyPEMSize bounds a PEM private key; an RSA-8192 PKCS#8
	// key is about 6.5 KiB.
	MaxPrivateKeyPEMSize = 16 << 10
	// minRSABits is the smallest RSA key accepted for an imported CA.
	minRSABits = 2048
)

const (
	pemTypeCertificate  = "CERTIFICATE"
	pemTypePrivateKey   = "PRIVATE KEY"
	pemTypeECPrivateKey = "EC PRIVATE KEY"
	pemTypeRSAKey       = "RSA PRIVATE KEY"
	pemTypeECParameters = "EC PARAMETERS"
)

// ErrPEMTooLarge is wrapped when PEM input exceeds a size or count limit.
var ErrPEMTooLarge = errors.New("PEM input too large")

// ParseCertificatesPEM parses one or more PEM "CERTIFICATE" blocks. The input
// is untrusted: it may be at most MaxCertificatesPEMSize bytes and hold at
// most MaxCertificates certificates, and anything but whitespace outside the
// blocks, a block of another type or a block with headers is an error.
func ParseCertificatesPEM(data []byte) ([]*x509.Certificate, error) {
	if len(data) > MaxCertificatesPEMSize {
		return nil, fmt.Errorf("parse certificates: %w: %d bytes, limit %d", ErrPEMTooLarge, len(data), MaxCertificatesPEMSize)
	}
	var certs []*x509.Certificate
	rest := data
	for {
		rest = bytes.TrimLeft(rest, " \t\r\n")
		if len(rest) == 0 {
			break
		}
		block, next, err := decodeOne(rest)
		if err != nil {
			return nil, fmt.Errorf("parse certificates: block %d: %w", len(certs)+1, err)
		}
		if block.Type != pemTypeCertificate {
			return nil, fmt.Errorf("parse certificates: block %d: unexpected PEM type %q", len(certs)+1, block.Type)
		}
		if len(certs) == MaxCertificates {
			return nil, fmt.Errorf("parse certificates: %w: more than %d certificates", ErrPEMTooLarge, MaxCertificates)
		}
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificates: block %d: %w", len(certs)+1, err)
		}
		certs = append(certs, cert)
		rest = next
	}
	if len(certs) == 0 {
		return nil, errors.New("parse certificates: no PEM certificate found")
	}
	return certs, nil
}

// ParsePrivateKeyPEM parses one PEM private key: PKCS#8 "PRIVATE KEY"
// (what this package writes), SEC1 "EC PRIVATE KEY" (optionally after the "EC
// PARAMETERS" block openssl ecparam writes) or PKCS#1 "RSA PRIVATE KEY". The
// input is untrusted: at most MaxPrivateKeyPEMSize bytes, no encrypted or
// header-carrying blocks, no trailing data. Accepted keys are ECDSA P-256,
// P-384 and P-521, RSA of at least 2048 bits, and Ed25519.
func ParsePrivateKeyPEM(data []byte) (crypto.Signer, error) {
	if len(data) > MaxPrivateKeyPEMSize {
		return nil, fmt.Errorf("parse private key: %w: %d bytes, limit %d", ErrPEMTooLarge, len(data), MaxPrivateKeyPEMSize)
	}
	rest := bytes.TrimLeft(data, " \t\r\n")
	block, rest, err := decodeOne(rest)
	if err != nil {
		return nil, fmt.Errorf("parse private key: %w", err)
	}
	if block.Type == pemTypeECParameters {
		block, rest, err = decodeOne(bytes.TrimLeft(rest, " \t\r\n"))
		if err != nil {
			return nil, fmt.Errorf("parse private key: %w", err)
		}
		if block.Type != pemTypeECPrivateKey {
			return nil, fmt.Errorf("parse private key: %q block must be followed by %q", pemTypeECParameters, pemTypeECPrivateKey)
		}
	}
	if len(bytes.TrimSpace(rest)) != 0 {
		return nil, errors.New("parse private key: unexpected data after the key block")
	}
	var key any
	switch block.Type {
	case pemTypePrivateKey:
		key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
	case pemTypeECPrivateKey:
		key, err = x509.ParseECPrivateKey(block.Bytes)
	case pemTypeRSAKey:
		key, err = x509.ParsePKCS1PrivateKey(block.Bytes)
	default:
		return nil, fmt.Errorf("parse private key: unexpected PEM type %q", block.Type)
	}
	if err != nil {
		return nil, fmt.Errorf("parse private key: %w", err)
	}
	switch k := key.(type) {
	case *ecdsa.PrivateKey:
		switch k.Curve {
		case elliptic.P256(), elliptic.P384(), elliptic.P521():
			return k, nil
		}
		return nil, errors.New("parse private key: unsupported ECDSA curve")
	case *rsa.PrivateKey:
		if k.N.BitLen() < minRSABits {
			return nil, fmt.Errorf("parse private key: RSA key of %d bits is shorter than %d", k.N.BitLen(), minRSABits)
		}
		return k, nil
	case ed25519.PrivateKey:
		return k, nil
	default:
		return nil, fmt.Errorf("parse private key: unsupported key type %T", key)
	}
}

// LoadCertPool reads a PEM bundle of CA certificates (see
// ParseCertificatesPEM) into a new pool that holds only them, never the
// system roots.
func LoadCertPool(file string) (*x509.CertPool, error) {
	certs, err := loadCertificatesFile(file, "cert pool")
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	for _, c := range certs {
		pool.AddCert(c)
	}
	return pool, nil
}

// decodeOne decodes the PEM block that data starts with. Unlike pem.Decode it
// refuses to skip text before the block, and it refuses headers (which is how
// encrypted legacy keys are marked).
func decodeOne(data []byte) (*pem.Block, []byte, error) {
	if !bytes.HasPrefix(data, []byte("-----BEGIN ")) {
		return nil, nil, errors.New("unexpected data outside PEM blocks")
	}
	block, rest := pem.Decode(data)
	if block == nil {
		return nil, nil, errors.New("malformed PEM block")
	}
	if len(block.Headers) != 0 {
		return nil, nil, errors.New("PEM headers (such as encryption) are not supported")
	}
	return block, rest, nil
}

// loadCertificatesFile reads and parses a PEM file of certificates; what
// names it in errors.
func loadCertificatesFile(file, what string) ([]*x509.Certificate, error) {
	data, err := readFileLimited(file, MaxCertificatesPEMSize)
	if err != nil {
		return nil, fmt.Errorf("load %s: %w", what, err)
	}
	certs, err := ParseCertificatesPEM(data)
	if err != nil {
		return nil, fmt.Errorf("load %s from %s: %w", what, file, err)
	}
	return certs, nil
}

// readFileLimited is ReadFileLimit for PEM files: a file over the limit
// also wraps ErrPEMTooLarge, as PEM input over a limit does.
func readFileLimited(name string, limit int64) ([]byte, error) {
	data, err := ReadFileLimit(name, limit)
	if errors.Is(err, ErrFileTooLarge) {
		return nil, fmt.Errorf("%w: %w", ErrPEMTooLarge, err)
	}
	return data, err
}
