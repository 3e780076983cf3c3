package pki

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"
)

// ErrTooManyCertificates is returned (wrapped) by MergeCABundles when the
// bundles together hold more than MaxCertificates distinct CA
// certificates. Not retryable until the bundles change.
var ErrTooManyCertificates = errors.New("too many CA certificates")

// MergeCABundles merges trust bundles read from a source the caller does
// not control (the ClusterTrustBundles of a cluster) the way the kubelet's
// clusterTrustBundle projection does: every distinct certificate of every
// bundle, in order. The input is untrusted: each bundle is parsed by
// ParseCertificatesPEM (bounded, strict), and a bundle that does not parse
// or holds a certificate that is not a CA is skipped whole, its error
// returned in skipped (named by its index) so that the caller can say which
// one. More than MaxCertificates distinct certificates over all bundles is
// an error wrapping ErrTooManyCertificates: a trust anchor set that large
// is an attack or a mistake, not a bundle.
func MergeCABundles(bundles [][]byte) (certs []*x509.Certificate, skipped []error, err error) {
	for i, b := range bundles {
		parsed, perr := ParseCertificatesPEM(b)
		if perr != nil {
			skipped = append(skipped, fmt.Errorf("bundle %d: %w", i, perr))
			continue
		}
		if bad := firstNonCA(parsed); bad >= 0 {
			skipped = append(skipped, fmt.Errorf("bundle %d: certificate %d (%s) is not a CA certificate", i, bad+1, Fingerprint(parsed[bad])))
			continue
		}
		for _, c := range parsed {
			if containsCert(certs, c) {
				continue
			}
			if len(certs) == MaxCertificates {
				return nil, skipped, fmt.Errorf("merge trust bundles: %w: more than %d", ErrTooManyCertificates, MaxCertificates)
			}
			certs = append(certs, c)
		}
	}
	return certs, skipped, nil
}

func firstNonCA(certs []*x509.Certificate) int {
	for i, c := range certs {
		if !c.BasicConstraintsValid || !c.IsCA {
			return i
		}
	}
	return -1
}

// PinnedCAs is PinnedBundle over parsed certificates: the CA with the
// pinned fingerprint first, then every other CA of certs that chains to it
// at now. The error wraps ErrFingerprintMismatch when no CA of certs has
// the fingerprint.
func PinnedCAs(certs []*x509.Certificate, fingerprint string, now time.Time) ([]*x509.Certificate, error) {
	if len(certs) == 0 {
		return nil, fmt.Errorf("verify trust bundle: %w", ErrFingerprintMismatch)
	}
	return PinnedBundle(encodeCerts(certs), fingerprint, now)
}

// EncodeCertificatesPEM encodes certs as PEM "CERTIFICATE" blocks, in
// order.
func EncodeCertificatesPEM(certs []*x509.Certificate) []byte { return encodeCerts(certs) }

// ValidSignerName checks a Kubernetes signer name as the API server does
// for a ClusterTrustBundle's spec.signerName: "<domain>/<path>", the
// domain DNS labels with at least one dot, the path DNS subdomains
// separated by dots. It also leaves room for the bundle name
// ClusterTrustBundleName makes from it.
func ValidSignerName(name string) error {
	domain, path, ok := strings.Cut(name, "/")
	if !ok || strings.Contains(path, "/") {
		return fmt.Errorf("signer name %q: want <domain>/<name>, e.g. tokenbroker.io/east", name)
	}
	if len(name) > maxSignerNameLen {
		return fmt.Errorf("signer name %q: longer than %d characters", name, maxSignerNameLen)
	}
	labels := strings.Split(domain, ".")
	if len(labels) < 2 {
		return fmt.Errorf("signer name %q: the domain %q needs at least two labels separated by dots", name, domain)
	}
	for _, l := range labels {
		if msgs := validation.IsDNS1123Label(l); len(msgs) > 0 {
			return fmt.Errorf("signer name %q: domain label %q: %s", name, l, strings.Join(msgs, "; "))
		}
	}
	for _, l := range strings.Split(path, ".") {
		if msgs := validation.IsDNS1123Subdomain(l); len(msgs) > 0 {
			return fmt.Errorf("signer name %q: name %q: %s", name, l, strings.Join(msgs, "; "))
		}
	}
	return nil
}

// ClusterTrustBundleSuffix is the last part of the name of the
// ClusterTrustBundle a broker publishes (ClusterTrustBundleName).
const ClusterTrustBundleSuffix = "trust-bundle"

// maxSignerNameLen leaves room in a 253-character object name for ":" and
// ClusterTrustBundleSuffix.
const maxSignerNameLen = 253 - 1 - len(ClusterTrustBundleSuffix)

// ClusterTrustBundleName is the name of the signer-linked
// ClusterTrustBundle a broker publishes for signer: the API server
// requires the signer name with "/" replaced by ":", then ":" and a
// suffix (KEP-3257).
func ClusterTrustBundleName(signer string) string {
	return strings.ReplaceAll(signer, "/", ":") + ":" + ClusterTrustBundleSuffix
}

// VerifyChainToPinned returns a check for tls.Config.VerifyConnection that
// makes pinned the only root of a server's chain: the peer's leaf must
// verify for serverAuth, now, to pinned, with others and the certificates
// the peer sent serving only as intermediates. The standard verification
// against a pool that holds others as roots (hostname included) still runs
// first; this one adds that a CA kept because it chains to the pin cannot
// shed the pin's constraints — its path length, name constraints and
// validity — by being a root itself.
func VerifyChainToPinned(pinned *x509.Certificate, others []*x509.Certificate) (func(tls.ConnectionState) error, error) {
	if pinned == nil || !pinned.BasicConstraintsValid || !pinned.IsCA {
		return nil, errors.New("verify chain to the pinned CA: the pinned certificate is not a CA")
	}
	roots := x509.NewCertPool()
	roots.AddCert(pinned)
	others = append([]*x509.Certificate(nil), others...)
	fp := Fingerprint(pinned)
	return func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("the server sent no certificate")
		}
		inter := x509.NewCertPool()
		for _, c := range others {
			inter.AddCert(c)
		}
		for _, c := range cs.PeerCertificates[1:] {
			inter.AddCert(c)
		}
		if _, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter,
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			return fmt.Errorf("the server's certificate does not chain to the pinned CA %s within its constraints: %w", fp, err)
		}
		return nil
	}, nil
}
