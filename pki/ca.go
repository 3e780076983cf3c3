package pki

import (
	"bytes"
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
	// PathLen is how many intermediate CAs may sit below this CA: 0 (the
	// default) makes a CA that signs leaf certificates only, 1 a root that
	// may sign one level of intermediates (see NewIntermediate) or cluster
	// CAs (SignClusterCA). Negative values are refused. NewCA and
	// NewIntermediate use it.
	PathLen int
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
//
// A CA is either a self-signed root or an intermediate. An intermediate
// knows its chain (Chain: itself first, then any CAs between it and the
// root) and, when it was made or loaded with it, its root (BundlePEM). Every
// KeyPair it issues carries the leaf followed by Chain, so a TLS peer that
// trusts only the root can verify it.
type CA struct {
	cert *x509.Certificate
	// chain is the signing CA's certificate and its issuers up to, not
	// including, the root; empty for a root CA.
	chain []*x509.Certificate
	// roots are the trust anchors: the CA itself for a root, the root for
	// an intermediate when it is known, else empty.
	roots   []*x509.Certificate
	certPEM []byte
	signer  crypto.Signer
	now     func() time.Time
	rand    io.Reader
}

// NewCA makes a self-signed root CA with a new ECDSA P-256 key. With the
// default opts.PathLen of 0 it may sign leaf certificates only; with 1 it may
// also sign intermediates (NewIntermediate), which themselves sign leaves
// only.
func NewCA(opts CAOptions) (*CA, error) {
	now, rnd := clockAndRand(opts.Now, opts.Rand)
	lifetime := opts.Lifetime
	if lifetime == 0 {
		lifetime = DefaultCALifetime
	}
	if lifetime < 0 {
		return nil, fmt.Errorf("new CA: negative lifetime %s", lifetime)
	}
	if opts.PathLen < 0 {
		return nil, fmt.Errorf("new CA: negative path length %d", opts.PathLen)
	}
	key, err := newKey(rnd)
	if err != nil {
		return nil, fmt.Errorf("new CA: %w", err)
	}
	t := now()
	tmpl := caTemplate(opts.CommonName, opts.PathLen, t, t.Add(lifetime))
	cert, err := createCert(rnd, tmpl, nil, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("new CA: %w", err)
	}
	return &CA{
		cert:    cert,
		roots:   []*x509.Certificate{cert},
		certPEM: encodeCert(cert.Raw),
		signer:  key,
		now:     now,
		rand:    rnd,
	}, nil
}

// NewIntermediate makes an intermediate CA with a new ECDSA P-256 key, signed
// by ca, which must allow a path length of at least 1 (a root made with
// CAOptions.PathLen 1). With the default opts.PathLen of 0 the intermediate
// signs leaf certificates only, so it cannot make further CAs; with 1 it
// may sign cluster CAs (SignClusterCA), and ca must then allow 2.
//
// opts.CommonName names it (default DefaultCACommonName + " intermediate").
// A zero opts.Lifetime makes it expire with ca; a longer lifetime than ca's
// remaining validity fails with ErrLifetimeExceedsCA. opts.Now and opts.Rand
// default to ca's.
func (ca *CA) NewIntermediate(opts CAOptions) (*CA, error) {
	if opts.PathLen < 0 {
		return nil, fmt.Errorf("new intermediate CA: negative path length %d", opts.PathLen)
	}
	// A parsed certificate has MaxPathLen -1 when it sets no limit.
	if ca.cert.MaxPathLen == 0 {
		return nil, errors.New("new intermediate CA: the parent CA's path length does not allow intermediates")
	}
	if ca.cert.MaxPathLen > 0 && opts.PathLen >= ca.cert.MaxPathLen {
		return nil, fmt.Errorf("new intermediate CA: the parent CA's path length %d allows an intermediate of path length %d at most", ca.cert.MaxPathLen, ca.cert.MaxPathLen-1)
	}
	now, rnd := ca.now, ca.rand
	if opts.Now != nil {
		now = opts.Now
	}
	if opts.Rand != nil {
		rnd = opts.Rand
	}
	if opts.Lifetime < 0 {
		return nil, fmt.Errorf("new intermediate CA: negative lifetime %s", opts.Lifetime)
	}
	cn := opts.CommonName
	if cn == "" {
		cn = DefaultCACommonName + " intermediate"
	}
	t := now()
	notAfter := ca.cert.NotAfter
	if opts.Lifetime != 0 {
		notAfter = t.Add(opts.Lifetime)
	}
	if err := ca.checkValidity(t, notAfter); err != nil {
		return nil, fmt.Errorf("new intermediate CA: %w", err)
	}
	key, err := newKey(rnd)
	if err != nil {
		return nil, fmt.Errorf("new intermediate CA: %w", err)
	}
	cert, err := createCert(rnd, caTemplate(cn, opts.PathLen, t, notAfter), ca.cert, key.Public(), ca.signer)
	if err != nil {
		return nil, fmt.Errorf("new intermediate CA: %w", err)
	}
	chain := append([]*x509.Certificate{cert}, ca.chain...)
	return &CA{
		cert:    cert,
		chain:   chain,
		roots:   append([]*x509.Certificate(nil), ca.roots...),
		certPEM: encodeCerts(chain),
		signer:  key,
		now:     now,
		rand:    rnd,
	}, nil
}

// caTemplate is the template of every CA certificate this package makes.
// The serial number is filled in by createCert.
func caTemplate(cn string, pathLen int, now, notAfter time.Time) *x509.Certificate {
	if cn == "" {
		cn = DefaultCACommonName
	}
	return &x509.Certificate{
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             now.Add(-Backdate),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLen:            pathLen,
		MaxPathLenZero:        pathLen == 0,
	}
}

// createCert draws a serial, signs tmpl with signer as parent (self-signed
// when parent is nil) and parses the result.
func createCert(rnd io.Reader, tmpl, parent *x509.Certificate, pub crypto.PublicKey, signer crypto.Signer) (*x509.Certificate, error) {
	serial, err := newSerial(rnd)
	if err != nil {
		return nil, err
	}
	tmpl.SerialNumber = serial
	if parent == nil {
		parent = tmpl
	}
	der, err := x509.CreateCertificate(rnd, tmpl, parent, pub, signer)
	if err != nil {
		return nil, fmt.Errorf("create certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse certificate: %w", err)
	}
	return cert, nil
}

// LoadCA reads a CA from a PEM certificate file and a PEM private key file
// (PKCS#8, SEC1 or PKCS#1). The certificate file holds the signing CA's
// certificate first, then, for an intermediate, its issuers in order up to
// the root, which may be left out (see ParseCA). Without the root the CA's
// trust anchors are unknown; LoadCAChain takes them from a bundle file. The
// CA issues with the system clock and crypto/rand; LoadCAWithOptions injects
// them.
func LoadCA(certFile, keyFile string) (*CA, error) {
	return LoadCAWithOptions(certFile, keyFile, CAOptions{})
}

// LoadCAWithOptions is LoadCA with a clock and randomness; only opts.Now and
// opts.Rand are used.
func LoadCAWithOptions(certFile, keyFile string, opts CAOptions) (*CA, error) {
	return LoadCAChain(certFile, keyFile, "", opts)
}

// LoadCAChain is LoadCAWithOptions that also reads the trust bundle
// (bundle.crt as `pki init` writes it) and requires the CA to chain to one
// of its certificates, which becomes the CA's root (BundlePEM). It is how an
// intermediate whose certificate file leaves the root out is loaded. An empty
// bundleFile means no bundle, as LoadCAWithOptions.
func LoadCAChain(certFile, keyFile, bundleFile string, opts CAOptions) (*CA, error) {
	certPEM, keyPEM, err := readCAFiles(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	ca, err := ParseCA(certPEM, keyPEM, opts)
	if err != nil {
		return nil, fmt.Errorf("load CA from %s: %w", certFile, err)
	}
	if bundleFile == "" {
		return ca, nil
	}
	bundle, err := loadCertificatesFile(bundleFile, "CA trust bundle")
	if err != nil {
		return nil, err
	}
	if err := ca.setRootFrom(bundle); err != nil {
		return nil, fmt.Errorf("load CA from %s with bundle %s: %w", certFile, bundleFile, err)
	}
	return ca, nil
}

// readCAFiles reads a CA's certificate (chain) and key files, each within
// its size limit, for LoadCAChain and CAReloader.
func readCAFiles(certFile, keyFile string) (certPEM, keyPEM []byte, err error) {
	certPEM, err = readFileLimited(certFile, MaxCertificatesPEMSize)
	if err != nil {
		return nil, nil, fmt.Errorf("load CA certificate: %w", err)
	}
	keyPEM, err = readFileLimited(keyFile, MaxPrivateKeyPEMSize)
	if err != nil {
		return nil, nil, fmt.Errorf("load CA key: %w", err)
	}
	return certPEM, keyPEM, nil
}

// ParseCA builds a CA from PEM. Only opts.Now and opts.Rand are used.
//
// certPEM holds the signing CA's certificate first. For an intermediate CA it
// is followed by the certificates that issued it, in order, up to the root;
// the self-signed root may end the list or be left out. Each certificate must
// be a CA allowed to sign certificates and must be signed by the next one.
// The key must match the first certificate.
func ParseCA(certPEM, keyPEM []byte, opts CAOptions) (*CA, error) {
	certs, err := ParseCertificatesPEM(certPEM)
	if err != nil {
		return nil, fmt.Errorf("parse CA certificate: %w", err)
	}
	for i, cert := range certs {
		if !cert.BasicConstraintsValid || !cert.IsCA {
			return nil, fmt.Errorf("parse CA certificate: certificate %d is not a CA certificate", i+1)
		}
		if cert.KeyUsage&x509.KeyUsageCertSign == 0 {
			return nil, fmt.Errorf("parse CA certificate: certificate %d: key usage does not allow signing certificates", i+1)
		}
		if i > 0 {
			if err := certs[i-1].CheckSignatureFrom(cert); err != nil {
				return nil, fmt.Errorf("parse CA certificate: certificate %d is not signed by certificate %d, want the CA followed by its issuers in order: %w", i, i+1, err)
			}
		}
	}
	signer, err := ParsePrivateKeyPEM(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("parse CA key: %w", err)
	}
	if err := matchKey(certs[0], signer); err != nil {
		return nil, fmt.Errorf("parse CA: %w", err)
	}
	now, rnd := clockAndRand(opts.Now, opts.Rand)
	ca := &CA{cert: certs[0], signer: signer, now: now, rand: rnd}
	chain := certs
	if last := certs[len(certs)-1]; isSelfSigned(last) {
		ca.roots = []*x509.Certificate{last}
		chain = certs[:len(certs)-1]
	}
	ca.chain = chain
	ca.certPEM = encodeCerts(certs[:max(len(chain), 1)])
	return ca, nil
}

// setRootFrom finds the root among bundle that the CA's chain ends at.
func (ca *CA) setRootFrom(bundle []*x509.Certificate) error {
	top := ca.cert
	if len(ca.chain) > 0 {
		top = ca.chain[len(ca.chain)-1]
	}
	for _, b := range bundle {
		if !b.IsCA {
			continue
		}
		if b.Equal(top) && isSelfSigned(b) {
			ca.roots = []*x509.Certificate{b}
			return nil
		}
		if top.CheckSignatureFrom(b) == nil && bytes.Equal(top.RawIssuer, b.RawSubject) {
			ca.roots = []*x509.Certificate{b}
			return nil
		}
	}
	return errors.New("the CA does not chain to any certificate of the trust bundle")
}

// isSelfSigned reports whether cert is signed by its own key under its own
// name, that is, a root.
func isSelfSigned(cert *x509.Certificate) bool {
	return bytes.Equal(cert.RawIssuer, cert.RawSubject) && cert.CheckSignatureFrom(cert) == nil
}

// Certificate returns the signing CA's certificate (for an intermediate CA,
// the intermediate). Callers must not modify it.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// CertPEM returns what the CA's certificate file holds: for a root CA its
// certificate (which is also its trust bundle), for an intermediate CA the
// PEM of Chain. WriteFiles writes it. Peers trust BundlePEM, not this.
func (ca *CA) CertPEM() []byte { return append([]byte(nil), ca.certPEM...) }

// Chain returns the intermediate CA certificates that leaves issued by ca
// need to reach the root: the signing CA first, then its issuers, the root
// excluded. It is empty for a root CA. Callers must not modify the
// certificates.
func (ca *CA) Chain() []*x509.Certificate { return append([]*x509.Certificate(nil), ca.chain...) }

// BundlePEM returns the trust anchors peers should trust to verify what ca
// issues: the root certificate (for a root CA, its own certificate). If the
// root is unknown (an intermediate loaded without it, see LoadCAChain), it
// falls back to the topmost certificate of the chain, which Go and curl
// accept as an anchor but strict OpenSSL clients do not.
func (ca *CA) BundlePEM() []byte { return encodeCerts(ca.anchors()) }

// anchors returns the roots, or the topmost known CA when the root is
// unknown.
func (ca *CA) anchors() []*x509.Certificate {
	if len(ca.roots) > 0 {
		return ca.roots
	}
	return ca.chain[len(ca.chain)-1:]
}

// KeyPEM returns the CA private key as a PKCS#8 "PRIVATE KEY" PEM block.
// Handle it as a secret: never log it.
func (ca *CA) KeyPEM() ([]byte, error) {
	return encodeKey(ca.signer)
}

// CertPool returns a new pool holding only the trust anchors of BundlePEM:
// the pool that verifies what ca issues (give it the leaf's chain as
// intermediates; TLS does).
func (ca *CA) CertPool() *x509.CertPool {
	p := x509.NewCertPool()
	for _, c := range ca.anchors() {
		p.AddCert(c)
	}
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
	// CertPEM is the certificate as a PEM "CERTIFICATE" block followed, when
	// the issuing CA is an intermediate, by the CA's Chain, so that a TLS
	// peer trusting only the root can verify it.
	CertPEM []byte
	// KeyPEM is the private key as a PKCS#8 "PRIVATE KEY" PEM block. It is a
	// secret: never log it. It is empty for a certificate signed from a CSR.
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
	tmpl, err := clientTemplate(opts.Identity)
	if err != nil {
		return nil, fmt.Errorf("issue client certificate: %w", err)
	}
	kp, err := ca.issue(tmpl, opts.Lifetime, DefaultClientLifetime)
	if err != nil {
		return nil, fmt.Errorf("issue client certificate: %w", err)
	}
	return kp, nil
}

// SignClient issues a client-authentication certificate for identity with
// the public key of csr, for enrollment and renewal. The CSR is untrusted
// and contributes its public key only: the subject (common name identity),
// the single URI SAN (identity), key usages, lifetime and every extension
// come from this package and the arguments, whatever else the CSR asks for.
// csr should come from ParseCSRPEM; its signature and key are checked again
// here all the same. Choosing identity (from a verified join token or the
// renewing client certificate, and comparing it with the CSR's) is the
// caller's job.
//
// lifetime zero means DefaultClientLifetime. It fails with
// ErrLifetimeExceedsCA if the certificate would outlive the CA. The returned
// KeyPair has an empty KeyPEM (the key stays with the requester) and CertPEM
// holds the leaf followed by Chain. Errors are not retryable.
func (ca *CA) SignClient(csr *x509.CertificateRequest, identity string, lifetime time.Duration) (*KeyPair, error) {
	if csr == nil {
		return nil, fmt.Errorf("sign client certificate: %w: no CSR", ErrInvalidCSR)
	}
	if err := checkPublicKey(csr.PublicKey); err != nil {
		return nil, fmt.Errorf("sign client certificate: %w: %w", ErrInvalidCSR, err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("sign client certificate: %w: signature: %w", ErrInvalidCSR, err)
	}
	tmpl, err := clientTemplate(identity)
	if err != nil {
		return nil, fmt.Errorf("sign client certificate: %w", err)
	}
	cert, err := ca.sign(tmpl, csr.PublicKey, lifetime, DefaultClientLifetime)
	if err != nil {
		return nil, fmt.Errorf("sign client certificate: %w", err)
	}
	return &KeyPair{Cert: cert, CertPEM: ca.chainPEM(cert)}, nil
}

func clientTemplate(identity string) (*x509.Certificate, error) {
	if _, _, err := ParseIdentity(identity); err != nil {
		return nil, err
	}
	u, err := url.Parse(identity)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidIdentity, err)
	}
	return &x509.Certificate{
		Subject:     pkix.Name{CommonName: identity},
		URIs:        []*url.URL{u},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, nil
}

// issue makes a key and signs a leaf for it.
func (ca *CA) issue(tmpl *x509.Certificate, lifetime, def time.Duration) (*KeyPair, error) {
	// Check the lifetime before spending a key on a request that fails.
	if err := ca.checkLifetime(lifetime, def); err != nil {
		return nil, err
	}
	key, err := newKey(ca.rand)
	if err != nil {
		return nil, err
	}
	cert, err := ca.sign(tmpl, key.Public(), lifetime, def)
	if err != nil {
		return nil, err
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return nil, err
	}
	return &KeyPair{Cert: cert, CertPEM: ca.chainPEM(cert), KeyPEM: keyPEM}, nil
}

func (ca *CA) checkLifetime(lifetime, def time.Duration) error {
	if lifetime == 0 {
		lifetime = def
	}
	if lifetime < 0 {
		return fmt.Errorf("negative lifetime %s", lifetime)
	}
	t := ca.now()
	return ca.checkValidity(t, t.Add(lifetime))
}

// checkValidity refuses a certificate issued at t until notAfter that the
// CA cannot back.
func (ca *CA) checkValidity(t, notAfter time.Time) error {
	if t.After(ca.cert.NotAfter) {
		return fmt.Errorf("CA expired at %s", ca.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	if notAfter.After(ca.cert.NotAfter) {
		return fmt.Errorf("%w: requested until %s, CA valid until %s", ErrLifetimeExceedsCA,
			notAfter.UTC().Format(time.RFC3339), ca.cert.NotAfter.UTC().Format(time.RFC3339))
	}
	return nil
}

// validity is the NotBefore (Backdate ago) and NotAfter of a certificate
// of lifetime (def when zero) that ca signs now, which must end within
// ca's own validity.
func (ca *CA) validity(lifetime, def time.Duration) (notBefore, notAfter time.Time, err error) {
	if lifetime == 0 {
		lifetime = def
	}
	if lifetime < 0 {
		return time.Time{}, time.Time{}, fmt.Errorf("negative lifetime %s", lifetime)
	}
	t := ca.now()
	notAfter = t.Add(lifetime)
	if err := ca.checkValidity(t, notAfter); err != nil {
		return time.Time{}, time.Time{}, err
	}
	return t.Add(-Backdate), notAfter, nil
}

// sign fills in the fields every leaf shares and signs tmpl for pub.
func (ca *CA) sign(tmpl *x509.Certificate, pub crypto.PublicKey, lifetime, def time.Duration) (*x509.Certificate, error) {
	notBefore, notAfter, err := ca.validity(lifetime, def)
	if err != nil {
		return nil, err
	}
	tmpl.NotBefore = notBefore
	tmpl.NotAfter = notAfter
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.BasicConstraintsValid = true
	tmpl.IsCA = false
	return createCert(ca.rand, tmpl, ca.cert, pub, ca.signer)
}

// chainPEM is the PEM of leaf followed by the CA's chain.
func (ca *CA) chainPEM(leaf *x509.Certificate) []byte {
	return encodeCerts(append([]*x509.Certificate{leaf}, ca.chain...))
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

func encodeCerts(certs []*x509.Certificate) []byte {
	var out []byte
	for _, c := range certs {
		out = append(out, encodeCert(c.Raw)...)
	}
	return out
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
