package pki

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"time"
)

// A cluster CA is the intermediate a source cluster receives when it
// enrolls or renews (fleet CA → cluster CA → pod certificates): a CA
// whose only name is the cluster's identity, that signs client
// certificates only, makes no further CAs, and is bound by an X.509 name
// constraint to URIs of its trust domain. Name constraints cannot bound
// a URI's path, so the constraint keeps a cluster's CA inside its trust
// domain only; a relying party must check that what it signs is under
// its own cluster (ClusterCAIdentity, ParseWorkloadIdentity), and
// SignPodCertificate refuses anything else.

// clusterCAOrganizationalUnit sets a cluster CA's subject apart from the
// client certificate of the same cluster, whose common name is the same.
const clusterCAOrganizationalUnit = "tokenbroker cluster CA"

// ErrNotClusterCA is wrapped by ClusterCAIdentity's refusals of a
// certificate that is not a cluster CA as SignClusterCA makes them. Not
// retryable.
var ErrNotClusterCA = errors.New("not a cluster CA")

// ErrCannotSignCAs is wrapped when a CA is asked to sign a cluster CA but
// its path length (or that of a CA above it) allows no further CA below
// it. Not retryable: the signing CA must be made again with a longer path
// length (tokenbroker pki init --cluster-cas).
var ErrCannotSignCAs = errors.New("the signing CA's path length allows no intermediate below it")

// CheckSignsClusterCAs reports, with an error wrapping ErrCannotSignCAs,
// whether ca's chain forbids one more CA below ca: the signing CA and
// each CA above it must allow as many CAs below it as the chain would
// then have. A CA made with path length 0 (pki init without
// --cluster-cas, or its intermediate) signs leaf certificates only.
func (ca *CA) CheckSignsClusterCAs() error {
	above := []*x509.Certificate{ca.cert}
	if len(ca.chain) > 1 {
		above = append(above, ca.chain[1:]...)
	}
	if len(ca.chain) > 0 {
		above = append(above, ca.roots...)
	}
	for i, c := range above {
		// A parsed certificate has MaxPathLen -1 when it sets no limit.
		// Below c would sit the i CAs between it and the cluster CA, and
		// the cluster CA.
		if c.MaxPathLen >= 0 && c.MaxPathLen < i+1 {
			what := "the signing CA"
			if i > 0 {
				what = "a CA above the signing CA"
			}
			return fmt.Errorf("%w: %s (%q) has path length %d, so it cannot have a cluster CA below it; "+
				"make the signing CA with one more level (tokenbroker pki init --cluster-cas)",
				ErrCannotSignCAs, what, c.Subject.CommonName, c.MaxPathLen)
		}
	}
	return nil
}

// SignClusterCA signs a cluster CA for clusterIdentity (a ClusterIdentity)
// with the public key of csr, for enrollment and renewal. The CSR is
// untrusted: its only name must be the URI clusterIdentity (as ParseCSRPEM
// checks) and it contributes its public key only; everything else comes
// from this package:
//
//   - IsCA, path length 0: it signs leaf certificates, never a CA;
//   - key usage CertSign only, extended key usage client authentication
//     only, so that what it signs verifies for client authentication
//     alone;
//   - its only name is the URI SAN clusterIdentity (also its common
//     name);
//   - a critical name constraint that permits URIs of clusterIdentity's
//     trust domain and excludes its subdomains, whatever the verifier's
//     reading of a URI constraint, so that everything it signs is in that
//     trust domain. It does not bound the path: see the package comment.
//
// lifetime zero means DefaultClientLifetime (a cluster CA lives as long as
// its client certificate); the certificate must end within ca's validity
// (ErrLifetimeExceedsCA). ca's path length must allow it
// (CheckSignsClusterCAs, ErrCannotSignCAs). The returned KeyPair has no
// KeyPEM; its CertPEM is the cluster CA followed by ca's Chain, the root
// left out. Errors wrapping ErrInvalidCSR are the requester's; none is
// retryable.
func (ca *CA) SignClusterCA(csr *x509.CertificateRequest, clusterIdentity string, lifetime time.Duration) (*KeyPair, error) {
	if csr == nil {
		return nil, fmt.Errorf("sign cluster CA: %w: no CSR", ErrInvalidCSR)
	}
	td, _, err := ParseIdentity(clusterIdentity)
	if err != nil {
		return nil, fmt.Errorf("sign cluster CA: %w", err)
	}
	csrIdentity, err := checkCSR(csr)
	if err != nil {
		return nil, fmt.Errorf("sign cluster CA: %w: %w", ErrInvalidCSR, err)
	}
	if csrIdentity != clusterIdentity {
		return nil, fmt.Errorf("sign cluster CA: %w: the CSR names %s, not %s", ErrInvalidCSR, csrIdentity, clusterIdentity)
	}
	if err := ca.CheckSignsClusterCAs(); err != nil {
		return nil, fmt.Errorf("sign cluster CA: %w", err)
	}
	notBefore, notAfter, err := ca.validity(lifetime, DefaultClientLifetime)
	if err != nil {
		return nil, fmt.Errorf("sign cluster CA: %w", err)
	}
	u, err := url.Parse(clusterIdentity)
	if err != nil {
		return nil, fmt.Errorf("sign cluster CA: %w: %w", ErrInvalidIdentity, err)
	}
	if notBefore.Before(ca.cert.NotBefore) {
		notBefore = ca.cert.NotBefore
	}
	tmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: clusterIdentity, OrganizationalUnit: []string{clusterCAOrganizationalUnit}},
		URIs:                  []*url.URL{u},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLen:            0,
		MaxPathLenZero:        true,
		// Go reads a URI constraint without a leading dot as the domain
		// and its subdomains, RFC 5280 as that host alone; excluding
		// ".<td>" (subdomains only, in both readings) makes it the trust
		// domain exactly, in both.
		PermittedURIDomains:         []string{td},
		ExcludedURIDomains:          []string{"." + td},
		PermittedDNSDomainsCritical: true, // marks the whole extension critical
		// And no DNS name, IP address or email under it at all, for
		// verifiers that check a leaf's extended key usage alone (so that
		// a cluster could never mint a server certificate for a broker's
		// name): "invalid" is a reserved name (RFC 6761), and every
		// address is excluded.
		PermittedDNSDomains:     []string{"invalid"},
		ExcludedIPRanges:        []*net.IPNet{{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}, {IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}},
		PermittedEmailAddresses: []string{"invalid"},
	}
	cert, err := createCert(ca.rand, tmpl, ca.cert, csr.PublicKey, ca.signer)
	if err != nil {
		return nil, fmt.Errorf("sign cluster CA: %w", err)
	}
	return &KeyPair{Cert: cert, CertPEM: ca.chainPEM(cert)}, nil
}

// ClusterCAIdentity returns the cluster identity a cluster CA signs for:
// its one URI SAN. The certificate must be a cluster CA as SignClusterCA
// makes them (a CA of path length 0 whose only name is a valid cluster
// identity, for certificate signing, bound by a name constraint to that
// identity's trust domain); anything else fails with ErrNotClusterCA. It
// does not verify the certificate's signature or validity; do that first.
func ClusterCAIdentity(cert *x509.Certificate) (string, error) {
	if cert == nil {
		return "", fmt.Errorf("%w: no certificate", ErrNotClusterCA)
	}
	if !cert.BasicConstraintsValid || !cert.IsCA {
		return "", fmt.Errorf("%w: not a CA certificate", ErrNotClusterCA)
	}
	if cert.MaxPathLen != 0 || !cert.MaxPathLenZero {
		return "", fmt.Errorf("%w: its path length is not 0: it could make CAs", ErrNotClusterCA)
	}
	if cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		return "", fmt.Errorf("%w: its key usage does not include certificate signing", ErrNotClusterCA)
	}
	if n := len(cert.DNSNames) + len(cert.IPAddresses) + len(cert.EmailAddresses); n != 0 {
		return "", fmt.Errorf("%w: %d DNS, IP or email SANs, want none", ErrNotClusterCA, n)
	}
	if len(cert.URIs) != 1 {
		return "", fmt.Errorf("%w: %d URI SANs, want exactly 1 (the cluster identity)", ErrNotClusterCA, len(cert.URIs))
	}
	id := cert.URIs[0].String()
	td, _, err := ParseIdentity(id)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrNotClusterCA, err)
	}
	if !slices.Equal(cert.PermittedURIDomains, []string{td}) {
		return "", fmt.Errorf("%w: its name constraint does not permit exactly the URIs of trust domain %s", ErrNotClusterCA, td)
	}
	return id, nil
}

// ErrCertificateUnderClusterCA is wrapped by CheckNoClusterCA's refusal.
// Not retryable.
var ErrCertificateUnderClusterCA = errors.New("a cluster CA vouches for workloads of its own cluster only")

// CheckNoClusterCA refuses, with an error wrapping
// ErrCertificateUnderClusterCA, verified chains of which any passes
// through a cluster CA (ClusterCAIdentity). A cluster's identity, and
// everything but a pod certificate, is the fleet's signing CA's to give:
// a cluster CA's name constraint keeps it in its trust domain only, so
// without this check a cluster with a CA could sign itself another
// cluster's identity and be taken for it. Relying parties call it on the
// chains of every certificate they take for a cluster's.
func CheckNoClusterCA(chains [][]*x509.Certificate) error {
	for _, chain := range chains {
		for _, c := range chain[min(1, len(chain)):] {
			if id, err := ClusterCAIdentity(c); err == nil {
				return fmt.Errorf("%w: the certificate chains through the cluster CA of %s", ErrCertificateUnderClusterCA, id)
			}
		}
	}
	return nil
}
