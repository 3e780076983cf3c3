package pki

import (
	"crypto/x509"
	"errors"
	"fmt"
	"time"
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
