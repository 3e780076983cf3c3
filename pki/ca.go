package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/url"
	"time"
)

// Default lifetimes and the NotBefore backdate. They are constants, not
// variables, so that no caller can change them for everyone.
const (
	// DefaultCALifetime is the lifetime of a CA made by NewCA when
	// CAOptions.Lifetime is zero: long enough that rotation is a planned
	// event, short enough that it is not forgotten.
	DefaultCALifetime = 5 * 365 * 24 * time.Hour
	// DefaultServerLifetime is the lifetime of a server certificate when
	// ServerOptions.Lifetime is zero.
	DefaultServerLifetime = 90 * 24 * time.Hour
	// DefaultClientLifetime is the lifetime of a cluster client certificate
	// when ClientOptions.Lifetime is zero. It is short because enrolled
	// clients renew automatically; hand-issued bootstrap certificates (the
	// `pki issue client` command) ask for longer explicitly.
	DefaultClientLifetime = 24 * time.Hour
	// DefaultCACommonName is the subject common name of a CA made by NewCA
	// when CAOptions.CommonName is empty.
	DefaultCACommonName = "tokenbroker CA"
	// Backdate is how far NotBefore is set before the issuing time, so that a
	// peer whose clock is a little behind still accepts a fresh certificate.
	Backdate = 5 * time.Minute
)

// ErrLifetimeExceedsCA is returned (wrapped) when a requested certificate
// would outlive the CA that signs it. Issuance never shortens a lifetime
// silently; ask for a shorter one or rotate the CA. Not retryable.
var ErrLifetimeExceedsCA = errors.New("certificate lifetime exceeds the CA's validity")

// CAOptions configures NewCA. The zero value is usable: it makes a CA named
// DefaultCACommonName, valid for DefaultCALifetime, using the system clock and
// crypto/rand.
type CAOptions struct {
	// CommonName is the CA's subject common name.
	CommonName string
	// Lifetime is how long the CA is valid after it is made; zero means
	// DefaultCALifetime.
	Lifetime time.Duration
	// Now is the clock; nil means time.Now. It is also the clock the CA uses
	// later when it issues certificates.
	Now func() time.Time
	// Rand is the source of serial numbers; nil means crypto/rand.Reader.
	// It must be safe for concurrent use if the CA is. It is also handed to
	// x509.CreateCertificate, but since Go 1.26 key generation and ECDSA
	// signing use the system's secure source whatever Rand is (tests that
	// need deterministic keys use testing/cryptotest.SetGlobalRandom).
	Rand io.Reader
}

// CA is a certificate authority: its certificate and signing key, plus the
// clock and randomness it issues with. It is safe for concurrent use when its
// Rand is (the default is).
type CA struct {
	cert    *x509.Certificate
	certPEM []byte
	signer  crypto.Signer
	now     func() time.Time
	rand    io.Reader
}

// NewCA makes a self-signed root CA with a new ECDSA P-256 key. The CA may
// sign leaf certificates only (path length 0).
func NewCA(opts CAOptions) (*CA, error) {
	now, rnd := clockAndRand(opts.Now, opts.Rand)
	lifetime := opts.Lifetime
	if lifetime == 0 {
		lifetime = DefaultCALifetime
	}
	if lifetime < 0 {
		return nil, fmt.Errorf("new CA: negative lifetime %s", lifetime)
	}
	cn := opts.CommonName
	if cn == "" {
		cn = DefaultCACommonName
	}
	key, err := newKey(rnd)
	if err != nil {
		return nil, fmt.Errorf("new CA: %w", err)
	}
	serial, err := newSerial(rnd)
	if err != nil {
		return nil, fmt.Errorf("new CA: %w", err)
	}
	t := now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             t.Add(-Backdate),
		NotAfter:              t.Add(lifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLen:            0,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rnd, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("new CA: create certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("new CA: parse certificate: %w", err)
	}
	return &CA{cert: cert, certPEM: encodeCert(der), signer: key, now: now, rand: rnd}, nil
}

// LoadCA reads a CA from a PEM certificate file (exactly one certificate) and
// a PEM private key file (PKCS#8, SEC1 or PKCS#1). The CA issues with the
// system clock and crypto/rand; LoadCAWithOptions injects them.
func LoadCA(certFile, keyFile string) (*CA, error) {
	return LoadCAWithOptions(certFile, keyFile, CAOptions{})
}

// LoadCAWithOptions is LoadCA with a clock and randomness; only opts.Now and
// opts.Rand are used.
func LoadCAWithOptions(certFile, keyFile string, opts CAOptions) (*CA, error) {
	certPEM, err := readFileLimited(certFile, MaxCertificatesPEMSize)
	if err != nil {
		return nil, fmt.Errorf("load CA certificate: %w", err)
	}
	keyPEM, err := readFileLimited(keyFile, MaxPrivateKeyPEMSize)
	if err != nil {
		return nil, fmt.Errorf("load CA key: %w", err)
	}
	ca, err := ParseCA(certPEM, keyPEM, opts)
	if err != nil {
		return nil, fmt.Errorf("load CA from %s: %w", certFile, err)
	}
	return ca, nil
}

// ParseCA builds a CA from PEM. Only opts.Now and opts.Rand are used. The
// certificate must be a CA allowed to sign certificates and the key must match
// it.
func ParseCA(certPEM, keyPEM []byte, opts CAOptions) (*CA, error) {
	certs, err := ParseCertificatesPEM(certPEM)
	if err != nil {
		return nil, fmt.Errorf("parse CA certificate: %w", err)
	}
	if len(certs) != 1 {
		return nil, fmt.Errorf("parse CA certificate: want exactly 1 certificate, got %d", len(certs))
	}
	cert := certs[0]
	if !cert.BasicConstraintsValid || !cert.IsCA {
		return nil, errors.New("parse CA certificate: not a CA certificate")
	}
	if cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return nil, errors.New("parse CA certificate: key usage does not allow signing certificates")
	}
	signer, err := ParsePrivateKeyPEM(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("parse CA key: %w", err)
	}
	if err := matchKey(cert, signer); err != nil {
		return nil, fmt.Errorf("parse CA: %w", err)
	}
	now, rnd := clockAndRand(opts.Now, opts.Rand)
	return &CA{cert: cert, certPEM: encodeCert(cert.Raw), signer: signer, now: now, rand: rnd}, nil
}

// Certificate returns the CA certificate. Callers must not modify it.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// CertPEM returns the CA certificate as PEM, the trust bundle peers need.
func (ca *CA) CertPEM() []byte { return append([]byte(nil), ca.certPEM...) }

// KeyPEM returns the CA private key as a PKCS#8 "PRIVATE KEY" PEM block.
// Handle it as a secret: never log it.
func (ca *CA) KeyPEM() ([]byte, error) {
	return encodeKey(ca.signer)
}

// CertPool returns a new pool holding only the CA certificate.
func (ca *CA) CertPool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// WriteFiles writes the CA certificate (mode 0644) and key (mode 0600), each
// atomically (temporary file and rename). It refuses, with an error wrapping
// fs.ErrExist, if either file exists; ReplaceFiles overwrites.
func (ca *CA) WriteFiles(certFile, keyFile string) error {
	return ca.writeFiles(certFile, keyFile, false)
}

// ReplaceFiles is WriteFiles that overwrites existing files.
func (ca *CA) ReplaceFiles(certFile, keyFile string) error {
	return ca.writeFiles(certFile, keyFile, true)
}

func (ca *CA) writeFiles(certFile, keyFile string, overwrite bool) error {
	keyPEM, err := ca.KeyPEM()
	if err != nil {
		return fmt.Errorf("write CA files: %w", err)
	}
	if err := writePair(certFile, ca.certPEM, keyFile, keyPEM, overwrite); err != nil {
		return fmt.Errorf("write CA files: %w", err)
	}
	return nil
}

// ServerOptions describes a server certificate. At least one DNS name or IP
// address is required.
type ServerOptions struct {
	// DNSNames are the DNS SANs; a leading "*." wildcard label is allowed.
	DNSNames []string
	// IPAddresses are the IP SANs.
	IPAddresses []net.IP
	// Lifetime is the validity after issuance; zero means
	// DefaultServerLifetime.
	Lifetime time.Duration
}

// ClientOptions describes a cluster client certificate.
type ClientOptions struct {
	// Identity is the cluster identity, spiffe://<trust-domain>/cluster/<name>
	// (see ClusterIdentity). It becomes the only URI SAN and the common name.
	Identity string
	// Lifetime is the validity after issuance; zero means
	// DefaultClientLifetime.
	Lifetime time.Duration
}

// KeyPair is an issued certificate with its new private key.
type KeyPair struct {
	// Cert is the parsed certificate.
	Cert *x509.Certificate
	// CertPEM is the certificate as a PEM "CERTIFICATE" block.
	CertPEM []byte
	// KeyPEM is the private key as a PKCS#8 "PRIVATE KEY" PEM block. It is a
	// secret: never log it.
	KeyPEM []byte
}

// IssueServer issues a server-authentication certificate with a new ECDSA
// P-256 key. It fails with ErrLifetimeExceedsCA if the certificate would
// outlive the CA.
func (ca *CA) IssueServer(opts ServerOptions) (*KeyPair, error) {
	if len(opts.DNSNames) == 0 && len(opts.IPAddresses) == 0 {
		return nil, errors.New("issue server certificate: at least one DNS name or IP address is required")
	}
	for _, n := range opts.DNSNames {
		if err := validateDNSName(n); err != nil {
			return nil, fmt.Errorf("issue server certificate: %w", err)
		}
	}
	ips := make([]net.IP, 0, len(opts.IPAddresses))
	for _, ip := range opts.IPAddresses {
		if len(ip) != net.IPv4len && len(ip) != net.IPv6len {
			return nil, fmt.Errorf("issue server certificate: invalid IP address %q", ip.String())
		}
		ips = append(ips, ip)
	}
	// The common name is legacy for servers (clients match SANs) but makes
	// the certificate readable in logs and openssl output.
	var cn string
	if len(opts.DNSNames) > 0 {
		cn = opts.DNSNames[0]
	} else {
		cn = ips[0].String()
	}
	kp, err := ca.issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: cn},
		DNSNames:    append([]string(nil), opts.DNSNames...),
		IPAddresses: ips,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, opts.Lifetime, DefaultServerLifetime)
	if err != nil {
		return nil, fmt.Errorf("issue server certificate: %w", err)
	}
	return kp, nil
}

// IssueClient issues a client-authentication certificate for a cluster
// identity with a new ECDSA P-256 key. The identity must be valid (see
// ParseIdentity). It fails with ErrLifetimeExceedsCA if the certificate would
// outlive the CA.
func (ca *CA) IssueClient(opts ClientOptions) (*KeyPair, error) {
	if _, _, err := ParseIdentity(opts.Identity); err != nil {
		return nil, fmt.Errorf("issue client certificate: %w", err)
	}
	u, err := url.Parse(opts.Identity)
	if err != nil {
		return nil, fmt.Errorf("issue client certificate: %w", err)
	}
	kp, err := ca.issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: opts.Identity},
		URIs:        []*url.URL{u},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, opts.Lifetime, DefaultClientLifetime)
	if err != nil {
		return nil, fmt.Errorf("issue client certificate: %w", err)
	}
	return kp, nil
}

// issue fills in the fields every leaf shares, makes a key and signs.
func (ca *CA) issue(tmpl *x509.Certificate, lifetime, def time.Duration) (*KeyPair, error) {
	if lifetime == 0 {
		lifetime = def
	}
	if lifetime < 0 {
		return nil, fmt.Errorf("negative lifetime %s", lifetime)
	}
	t := ca.now()
	if t.After(ca.cert.NotAfter) {
		return nil, fmt.Errorf("CA expired at %s", ca.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	notAfter := t.Add(lifetime)
	if notAfter.After(ca.cert.NotAfter) {
		return nil, fmt.Errorf("%w: requested until %s, CA valid until %s", ErrLifetimeExceedsCA,
			notAfter.UTC().Format(time.RFC3339), ca.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	key, err := newKey(ca.rand)
	if err != nil {
		return nil, err
	}
	serial, err := newSerial(ca.rand)
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber = serial
	tmpl.NotBefore = t.Add(-Backdate)
	tmpl.NotAfter = notAfter
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.BasicConstraintsValid = true
	tmpl.IsCA = false
	der, err := x509.CreateCertificate(ca.rand, tmpl, ca.cert, key.Public(), ca.signer)
	if err != nil {
		return nil, fmt.Errorf("create certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse certificate: %w", err)
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return nil, err
	}
	return &KeyPair{Cert: cert, CertPEM: encodeCert(der), KeyPEM: keyPEM}, nil
}

// WriteFiles writes the certificate (mode 0644) and key (mode 0600), each
// atomically, overwriting existing files so that it can rotate files a
// CertReloader watches. The key is written first; a reader that sees a new key
// with the old certificate keeps its old pair until both match. CreateFiles
// refuses to overwrite.
func (kp *KeyPair) WriteFiles(certFile, keyFile string) error {
	if err := writePair(certFile, kp.CertPEM, keyFile, kp.KeyPEM, true); err != nil {
		return fmt.Errorf("write key pair: %w", err)
	}
	return nil
}

// CreateFiles is WriteFiles that refuses, with an error wrapping fs.ErrExist,
// if either file exists.
func (kp *KeyPair) CreateFiles(certFile, keyFile string) error {
	if err := writePair(certFile, kp.CertPEM, keyFile, kp.KeyPEM, false); err != nil {
		return fmt.Errorf("create key pair files: %w", err)
	}
	return nil
}

// TLSCertificate returns the pair as a tls.Certificate with Leaf set.
func (kp *KeyPair) TLSCertificate() (tls.Certificate, error) {
	c, err := tls.X509KeyPair(kp.CertPEM, kp.KeyPEM)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("key pair: %w", err)
	}
	return c, nil
}

func clockAndRand(now func() time.Time, rnd io.Reader) (func() time.Time, io.Reader) {
	if now == nil {
		now = time.Now
	}
	if rnd == nil {
		rnd = rand.Reader
	}
	return now, rnd
}

func newKey(rnd io.Reader) (*ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rnd)
	if err != nil {
		return nil, fmt.Errorf("generate ECDSA P-256 key: %w", err)
	}
	return key, nil
}

// newSerial draws a uniform positive serial below 2^128 (RFC 5280 allows up
// to 20 octets; the CA/B Forum asks for at least 64 random bits).
func newSerial(rnd io.Reader) (*big.Int, error) {
	limit := new(big.Int).Lsh(big.NewInt(1), 128)
	// Zero is not a positive serial; drawing it is a 2^-128 event, but a
	// broken reader returning zeros must not produce one.
	for range 3 {
		n, err := rand.Int(rnd, limit)
		if err != nil {
			return nil, fmt.Errorf("generate serial number: %w", err)
		}
		if n.Sign() > 0 {
			return n, nil
		}
	}
	return nil, errors.New("generate serial number: random source returned zero repeatedly")
}

func encodeCert(der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: pemTypeCertificate, Bytes: der})
}

func encodeKey(key crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("marshal private key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: pemTypePrivateKey, Bytes: der}), nil
}

// matchKey reports an error unless signer holds the private half of cert's
// public key.
func matchKey(cert *x509.Certificate, signer crypto.Signer) error {
	pub, ok := cert.PublicKey.(interface{ Equal(crypto.PublicKey) bool })
	if !ok || !pub.Equal(signer.Public()) {
		return errors.New("private key does not match certificate")
	}
	return nil
}
