package pki

import (
	"crypto"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// A lease certificate is the credential of one gateway lease: a client
// certificate that names the lease (the Secret's namespace, name and UID)
// and the ServiceAccount the gateway forwards its requests as. Its URI
// SAN is a URN, never a SPIFFE ID, so that the mutual-TLS API listener
// and every peer, which trust the same CA for cluster identities, find
// none in it (IdentityFromCert refuses it, and the API listener names the
// refusal: IsLeaseCertificate).

// leaseURNPrefix starts a lease certificate's one URI SAN:
// urn:tokenbroker:lease:v1:<namespace>:<serviceaccount>:<lease-id>:<uid>.
const leaseURNPrefix = "urn:tokenbroker:lease:v1:"

// maxLeaseURN bounds the URN a parser reads: the longest valid one is far
// shorter.
const maxLeaseURN = 512

// ErrInvalidLeaseCertificate is wrapped by every refusal of
// VerifyLeaseCertificate and ParseLeaseURN.
var ErrInvalidLeaseCertificate = errors.New("invalid lease certificate")

// LeaseName is what a lease certificate names: the lease Secret
// (Namespace, ID, UID), the ServiceAccount its requests are forwarded as,
// and the peer identity it was issued to (kept in the subject's
// organization, not in a URI, so that it is no identity anywhere).
type LeaseName struct {
	Namespace      string
	ServiceAccount string
	ID             string
	UID            string
	Peer           string
}

// URN is the lease's URI SAN.
func (n LeaseName) URN() string {
	return leaseURNPrefix + n.Namespace + ":" + n.ServiceAccount + ":" + n.ID + ":" + n.UID
}

func (n LeaseName) validate() error {
	if msgs := validation.IsDNS1123Label(n.Namespace); len(msgs) > 0 {
		return fmt.Errorf("%w: namespace %q: %s", ErrInvalidLeaseCertificate, n.Namespace, strings.Join(msgs, "; "))
	}
	if msgs := validation.IsDNS1123Subdomain(n.ServiceAccount); len(msgs) > 0 {
		return fmt.Errorf("%w: service account %q: %s", ErrInvalidLeaseCertificate, n.ServiceAccount, strings.Join(msgs, "; "))
	}
	if !apiv1.ValidLeaseID(n.ID) {
		return fmt.Errorf("%w: lease id %q", ErrInvalidLeaseCertificate, n.ID)
	}
	if !ValidUID(n.UID) {
		return fmt.Errorf("%w: uid %q", ErrInvalidLeaseCertificate, n.UID)
	}
	return nil
}

// ValidUID reports whether uid is what the API server writes as an
// object's UID (a Pod's, a Secret's): a UUID in its canonical lower-case
// form, 8-4-4-4-12 hexadecimal digits.
func ValidUID(uid string) bool {
	if len(uid) != 36 {
		return false
	}
	for i, c := range uid {
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return false
			}
		default:
			if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
				return false
			}
		}
	}
	return true
}

// ParseLeaseURN reads the URN of a lease certificate. It is strict: every
// part must be valid and nothing may follow the UID.
func ParseLeaseURN(s string) (LeaseName, error) {
	if len(s) > maxLeaseURN {
		return LeaseName{}, fmt.Errorf("%w: URN longer than %d bytes", ErrInvalidLeaseCertificate, maxLeaseURN)
	}
	rest, ok := strings.CutPrefix(s, leaseURNPrefix)
	if !ok {
		return LeaseName{}, fmt.Errorf("%w: %q does not start with %q", ErrInvalidLeaseCertificate, s, leaseURNPrefix)
	}
	parts := strings.Split(rest, ":")
	if len(parts) != 4 {
		return LeaseName{}, fmt.Errorf("%w: %q is not %s<namespace>:<serviceaccount>:<lease-id>:<uid>", ErrInvalidLeaseCertificate, s, leaseURNPrefix)
	}
	n := LeaseName{Namespace: parts[0], ServiceAccount: parts[1], ID: parts[2], UID: parts[3]}
	if err := n.validate(); err != nil {
		return LeaseName{}, err
	}
	return n, nil
}

// SignLease issues the lease certificate of n for pub, valid until
// notAfter (the lease's expiry). The key is the caller's (from a CSR whose
// signature the caller checked) or one the broker made; checkPublicKey
// applies. It fails with ErrLifetimeExceedsCA past the CA's expiry.
func (ca *CA) SignLease(pub crypto.PublicKey, n LeaseName, notAfter time.Time) (*KeyPair, error) {
	if err := n.validate(); err != nil {
		return nil, fmt.Errorf("sign lease certificate: %w", err)
	}
	if _, _, err := ParseIdentity(n.Peer); err != nil {
		return nil, fmt.Errorf("sign lease certificate: peer: %w", err)
	}
	if err := checkPublicKey(pub); err != nil {
		return nil, fmt.Errorf("sign lease certificate: %w: %w", ErrInvalidCSR, err)
	}
	u, err := url.Parse(n.URN())
	if err != nil {
		return nil, fmt.Errorf("sign lease certificate: %w", err)
	}
	lifetime := notAfter.Sub(ca.now())
	if lifetime <= 0 {
		return nil, fmt.Errorf("sign lease certificate: the lease expired at %s", notAfter.UTC().Format(time.RFC3339))
	}
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: leaseCommonNamePrefix + n.ID, Organization: []string{n.Peer}},
		URIs:        []*url.URL{u},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	cert, err := ca.sign(tmpl, pub, lifetime, lifetime)
	if err != nil {
		return nil, fmt.Errorf("sign lease certificate: %w", err)
	}
	return &KeyPair{Cert: cert, CertPEM: ca.chainPEM(cert)}, nil
}

// NewLeaseKey makes a key for a lease certificate whose caller sent no
// CSR: ECDSA P-256, as every key this package makes. It returns the
// public key and the private key's PEM (returned once, never stored).
func (ca *CA) NewLeaseKey() (crypto.PublicKey, []byte, error) {
	key, err := newKey(ca.rand)
	if err != nil {
		return nil, nil, err
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return nil, nil, err
	}
	return key.Public(), keyPEM, nil
}

// VerifyLeaseCertificate verifies a chain a client presented to the
// gateway (leaf first) against roots, pinned: the gateway's CAs and
// nothing else. The leaf must allow client authentication, name nothing
// but one URI SAN that ParseLeaseURN reads, and carry a peer identity as
// its one organization. It returns the lease it names.
func VerifyLeaseCertificate(chain []*x509.Certificate, roots *x509.CertPool, now time.Time) (LeaseName, error) {
	if len(chain) == 0 {
		return LeaseName{}, fmt.Errorf("%w: no certificate", ErrInvalidLeaseCertificate)
	}
	c := chain[0]
	inter := x509.NewCertPool()
	for _, ic := range chain[1:] {
		inter.AddCert(ic)
	}
	chains, err := c.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}})
	if err != nil {
		return LeaseName{}, fmt.Errorf("%w: %w", ErrInvalidLeaseCertificate, err)
	}
	// A lease certificate is the gateway's CA's to sign, never a cluster
	// CA's (whose URI constraint refuses a URN already).
	if err := CheckNoClusterCA(chains); err != nil {
		return LeaseName{}, fmt.Errorf("%w: %w", ErrInvalidLeaseCertificate, err)
	}
	if c.IsCA || len(c.URIs) != 1 || len(c.DNSNames)+len(c.EmailAddresses)+len(c.IPAddresses) != 0 {
		return LeaseName{}, fmt.Errorf("%w: a lease certificate has one URI SAN and no other name", ErrInvalidLeaseCertificate)
	}
	n, err := ParseLeaseURN(c.URIs[0].String())
	if err != nil {
		return LeaseName{}, err
	}
	if len(c.Subject.Organization) != 1 {
		return LeaseName{}, fmt.Errorf("%w: no peer", ErrInvalidLeaseCertificate)
	}
	if _, _, err := ParseIdentity(c.Subject.Organization[0]); err != nil {
		return LeaseName{}, fmt.Errorf("%w: peer: %w", ErrInvalidLeaseCertificate, err)
	}
	if c.Subject.CommonName != leaseCommonNamePrefix+n.ID {
		return LeaseName{}, fmt.Errorf("%w: the common name does not name the lease", ErrInvalidLeaseCertificate)
	}
	n.Peer = c.Subject.Organization[0]
	return n, nil
}

// leaseCommonNamePrefix starts a lease certificate's common name; the
// lease id follows.
const leaseCommonNamePrefix = "tokenbroker-lease:"

// IsLeaseCertificate reports whether cert names a lease (its one URI is a
// lease URN), for listeners that must refuse it with a clear reason.
func IsLeaseCertificate(cert *x509.Certificate) bool {
	return cert != nil && len(cert.URIs) > 0 && strings.HasPrefix(cert.URIs[0].String(), leaseURNPrefix)
}

// ParseLeaseCSRPEM parses the CSR a caller sends for a lease certificate:
// ParseCSRPEM's strictness for the PEM, the key and the signature (proof
// that the caller holds the key), but its subject and names are ignored,
// since SignLease takes nothing from it but the public key. Errors wrap
// ErrInvalidCSR.
func ParseLeaseCSRPEM(data []byte) (*x509.CertificateRequest, error) {
	csr, err := parseCSRPEM(data)
	if err == nil {
		err = checkPublicKey(csr.PublicKey)
	}
	if err == nil {
		if err = csr.CheckSignature(); err != nil {
			err = fmt.Errorf("signature: %w", err)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("parse CSR: %w: %w", ErrInvalidCSR, err)
	}
	return csr, nil
}
