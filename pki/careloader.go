package pki

import (
	"crypto"
	"crypto/x509"
	"errors"
	"time"
)

// CAReloader is the signing CA read from its certificate and key files
// (LoadCA's files), picked up again when they change, so that the signing
// CA is rotated without a restart. It is a FileReloader: the files are
// read again at most every interval by the calls that use the CA
// (SignClient, Certificate) or on Reload, and new content replaces the CA
// only if it parses as a CA (ParseCA: CA certificates in order, a key
// that matches the first) that has not expired; otherwise the CA in
// service stays and the callback gets the error. Writing the key and then
// the certificate is safe: the half-written state is refused, the
// complete pair taken at the next look.
//
// A CAReloader is safe for concurrent use.
type CAReloader struct {
	FileReloader[CA]
}

// NewCAReloader loads the CA now and fails if it cannot; later bad files
// are reported to the callback (WithReloadCallback) instead. Only
// caOpts.Now and caOpts.Rand are used, for signing; the reload options'
// clock decides expiry and the interval.
func NewCAReloader(certFile, keyFile string, caOpts CAOptions, opts ...ReloaderOption) (*CAReloader, error) {
	r := &CAReloader{}
	r.FileReloader = FileReloader[CA]{
		reloadSettings: newReloadSettings(opts),
		read: func() ([][]byte, error) {
			certPEM, keyPEM, err := readCAFiles(certFile, keyFile)
			if err != nil {
				return nil, err
			}
			return [][]byte{certPEM, keyPEM}, nil
		},
		what: "signing CA " + certFile,
	}
	r.parse = func(c [][]byte) (*CA, error) {
		ca, err := ParseCA(c[0], c[1], caOpts)
		if err != nil {
			return nil, err
		}
		if now := r.now(); now.After(ca.cert.NotAfter) {
			return nil, errors.New("CA certificate expired at " + ca.cert.NotAfter.UTC().Format(time.RFC3339))
		}
		return ca, nil
	}
	if err := r.load(); err != nil {
		return nil, err
	}
	return r, nil
}

// CA returns the CA in service after a reload if one is due.
func (r *CAReloader) CA() *CA { return r.get() }

// SignClient signs with the CA in service (see CA.SignClient).
func (r *CAReloader) SignClient(csr *x509.CertificateRequest, identity string, lifetime time.Duration) (*KeyPair, error) {
	return r.get().SignClient(csr, identity, lifetime)
}

// SignClusterCA signs with the CA in service (see CA.SignClusterCA).
func (r *CAReloader) SignClusterCA(csr *x509.CertificateRequest, clusterIdentity string, lifetime time.Duration) (*KeyPair, error) {
	return r.get().SignClusterCA(csr, clusterIdentity, lifetime)
}

// CheckSignsClusterCAs checks the CA in service (see
// CA.CheckSignsClusterCAs).
func (r *CAReloader) CheckSignsClusterCAs() error { return r.get().CheckSignsClusterCAs() }

// Certificate is the certificate of the CA in service.
func (r *CAReloader) Certificate() *x509.Certificate { return r.get().Certificate() }

// SignLease signs with the CA in service (see CA.SignLease).
func (r *CAReloader) SignLease(pub crypto.PublicKey, n LeaseName, notAfter time.Time) (*KeyPair, error) {
	return r.get().SignLease(pub, n, notAfter)
}

// NewLeaseKey makes a key with the CA in service's randomness (see
// CA.NewLeaseKey).
func (r *CAReloader) NewLeaseKey() (crypto.PublicKey, []byte, error) { return r.get().NewLeaseKey() }
