package pki

import (
	"crypto/sha256"
	"crypto/subtle"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"
)

// ErrFingerprintMismatch is returned (wrapped) by VerifyBundleFingerprint when
// no CA of the bundle has the pinned fingerprint: the bundle is not the one
// the operator vouched for. Not retryable against the same server.
var ErrFingerprintMismatch = errors.New("no CA in the trust bundle has the pinned fingerprint")

// VerifyBundleFingerprint is the pin check of bootstrapping (like `step ca
// bootstrap`): it returns nil iff bundlePEM parses (see ParseCertificatesPEM)
// and one of its certificates is a CA whose Fingerprint is fingerprint
// ("sha256:" and 64 hex digits, either case). Digests are compared in constant
// time.
func VerifyBundleFingerprint(bundlePEM []byte, fingerprint string) error {
	_, _, err := pinnedCA(bundlePEM, fingerprint)
	return err
}

// pinnedCA parses bundlePEM and returns the CA certificate whose
// fingerprint is pinned, with all the bundle's certificates.
func pinnedCA(bundlePEM []byte, fingerprint string) (*x509.Certificate, []*x509.Certificate, error) {
	want, err := parseFingerprint(fingerprint)
	if err != nil {
		return nil, nil, err
	}
	certs, err := ParseCertificatesPEM(bundlePEM)
	if err != nil {
		return nil, nil, fmt.Errorf("verify trust bundle: %w", err)
	}
	var pinned *x509.Certificate
	for _, c := range certs {
		sum := sha256.Sum256(c.Raw)
		// No early exit: the time taken does not tell which certificate
		// matched.
		match := subtle.ConstantTimeCompare(sum[:], want) == 1
		if match && c.BasicConstraintsValid && c.IsCA && pinned == nil {
			pinned = c
		}
	}
	if pinned == nil {
		return nil, nil, fmt.Errorf("verify trust bundle: %w", ErrFingerprintMismatch)
	}
	return pinned, certs, nil
}

// ErrNoTrustedCA is returned (wrapped) by TrustedBundle when no CA of the
// bundle is, or chains to, a CA already trusted. Not retryable against the
// same server.
var ErrNoTrustedCA = errors.New("no CA in the trust bundle is trusted already")

// PinnedBundle returns the part of bundlePEM that the pinned CA vouches
// for: the CA with the pinned fingerprint first, then every other CA
// certificate of the bundle that chains to it at now (other bundle
// certificates may serve as intermediates on the way, never as an
// anchor). Everything else — a second root, a CA the pinned one did not
// sign, a leaf — is dropped, so that whoever serves the bundle cannot add a
// trust anchor beside the pinned one. The error wraps
// ErrFingerprintMismatch when no CA of the bundle has the fingerprint.
func PinnedBundle(bundlePEM []byte, fingerprint string, now time.Time) ([]*x509.Certificate, error) {
	pinned, certs, err := pinnedCA(bundlePEM, fingerprint)
	if err != nil {
		return nil, err
	}
	out := []*x509.Certificate{pinned}
	for _, c := range trustedCAs(certs, []*x509.Certificate{pinned}, now) {
		if !c.Equal(pinned) {
			out = append(out, c)
		}
	}
	return out, nil
}

// TrustedBundle is PinnedBundle with the trust already held in place of
// a pin: it returns, as PEM in bundle order, the CA certificates of
// bundlePEM that are one of anchors or chain at now to one of them (other
// bundle certificates may serve as intermediates on the way, never as an
// anchor). A root that no anchor signed — a partner CA the broker trusts
// for its clients, say — is dropped, so that a renewal answer can carry
// trust forward (a sub-CA, a CA cross-signed by a trusted one) and drop
// it, but never add an anchor of its own. Anchors that are not CA
// certificates are ignored. The error wraps ErrNoTrustedCA when nothing is
// kept.
func TrustedBundle(bundlePEM []byte, anchors []*x509.Certificate, now time.Time) ([]byte, error) {
	certs, err := ParseCertificatesPEM(bundlePEM)
	if err != nil {
		return nil, fmt.Errorf("trust bundle: %w", err)
	}
	var cas []*x509.Certificate
	for _, a := range anchors {
		if a.BasicConstraintsValid && a.IsCA {
			cas = append(cas, a)
		}
	}
	kept := trustedCAs(certs, cas, now)
	if len(kept) == 0 {
		return nil, fmt.Errorf("trust bundle: %w", ErrNoTrustedCA)
	}
	return encodeCerts(kept), nil
}

// trustedCAs returns, in the order of certs and without duplicates, the CA
// certificates of certs that are one of anchors or chain to one of them at
// now, with certs as the only intermediates. It is the one filter of
// PinnedBundle and TrustedBundle.
func trustedCAs(certs, anchors []*x509.Certificate, now time.Time) []*x509.Certificate {
	roots := x509.NewCertPool()
	for _, a := range anchors {
		roots.AddCert(a)
	}
	inter := x509.NewCertPool()
	for _, c := range certs {
		inter.AddCert(c)
	}
	var out []*x509.Certificate
	for _, c := range certs {
		if !c.BasicConstraintsValid || !c.IsCA || containsCert(out, c) {
			continue
		}
		if containsCert(anchors, c) {
			out = append(out, c)
			continue
		}
		if _, err := c.Verify(x509.VerifyOptions{
			Roots:         roots,
			Intermediates: inter,
			CurrentTime:   now,
			KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
		}); err == nil {
			out = append(out, c)
		}
	}
	return out
}

func containsCert(certs []*x509.Certificate, c *x509.Certificate) bool {
	for _, x := range certs {
		if x.Equal(c) {
			return true
		}
	}
	return false
}

func parseFingerprint(s string) ([]byte, error) {
	hexSum, ok := strings.CutPrefix(s, "sha256:")
	if !ok || len(hexSum) != 2*sha256.Size {
		return nil, fmt.Errorf("invalid fingerprint %q: want sha256:<64 hex digits>", s)
	}
	sum, err := hex.DecodeString(hexSum)
	if err != nil {
		return nil, fmt.Errorf("invalid fingerprint %q: want sha256:<64 hex digits>", s)
	}
	return sum, nil
}

// PoolReloader serves a trust bundle (a PEM file of CA certificates) as a
// cert pool and picks up a new file without a restart, for CA rotation: add
// the new CA to the bundle, then later remove the old one.
//
// It polls like CertReloader: a call that finds the last check older than the
// interval reads the file again (bounded) and, if its content changed, parses
// it. A bad new file (unreadable, unparsable, empty, or holding a certificate
// that is not a CA) is refused and the old bundle stays in service; the
// outcome goes to the callback (WithReloadCallback), once per new content.
// The options are CertReloader's.
//
// A PoolReloader is safe for concurrent use.
type PoolReloader struct {
	FileReloader[poolState]
	file string
}

// poolState is one bundle in service; it is never modified once stored.
type poolState struct {
	pool  *x509.CertPool
	certs []*x509.Certificate
	pem   []byte
}

// NewPoolReloader loads the bundle now and fails if it is bad; later bad
// files are reported to the callback instead.
func NewPoolReloader(file string, opts ...ReloaderOption) (*PoolReloader, error) {
	p := &PoolReloader{file: file}
	p.FileReloader = FileReloader[poolState]{
		reloadSettings: newReloadSettings(opts),
		read: func() ([][]byte, error) {
			data, err := readFileLimited(file, MaxCertificatesPEMSize)
			if err != nil {
				return nil, fmt.Errorf("reload trust bundle: %w", err)
			}
			return [][]byte{data}, nil
		},
		parse: func(c [][]byte) (*poolState, error) { return parseBundle(c[0]) },
		what:  "trust bundle " + file,
	}
	if err := p.load(); err != nil {
		return nil, err
	}
	return p, nil
}

// Pool returns the pool of the bundle in service. It is shared: callers must
// not add to it.
func (p *PoolReloader) Pool() *x509.CertPool { return p.state().pool }

// Certificates returns the certificates of the bundle in service, in file
// order. Callers must not modify them.
func (p *PoolReloader) Certificates() []*x509.Certificate {
	return append([]*x509.Certificate(nil), p.state().certs...)
}

// PEM returns the bundle in service as it was read, what GET
// /v1/trust-bundle serves.
func (p *PoolReloader) PEM() []byte { return append([]byte(nil), p.state().pem...) }

func (p *PoolReloader) state() *poolState { return p.get() }

func parseBundle(data []byte) (*poolState, error) {
	certs, err := ParseCertificatesPEM(data)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	for i, c := range certs {
		if !c.BasicConstraintsValid || !c.IsCA {
			return nil, fmt.Errorf("certificate %d (%s) is not a CA certificate", i+1, Fingerprint(c))
		}
		pool.AddCert(c)
	}
	return &poolState{pool: pool, certs: certs, pem: append([]byte(nil), data...)}, nil
}
