package pki

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"
)

// The files of a CA directory, as "tokenbroker pki init" lays it out and
// "pki issue", "pki join-token" and the docs read it.
const (
	// CADirCert and CADirKey are the signing CA: the CA itself, or the
	// intermediate of a directory made with an intermediate.
	CADirCert = "ca.crt"
	CADirKey  = "ca.key"
	// CADirRootCert and CADirRootKey are the root of a directory made
	// with an intermediate; the root key belongs offline.
	CADirRootCert = "root.crt"
	CADirRootKey  = "root.key"
	// CADirBundle is the trust bundle brokers and agents trust: the
	// root's certificate.
	CADirBundle = "bundle.crt"
)

// CADirOptions says how InitCADir makes a CA directory.
type CADirOptions struct {
	CommonName string
	Lifetime   time.Duration
	// Intermediate makes a root that may sign one intermediate (path
	// length 1) and an intermediate that signs (path length 0); their
	// common names get " root" and " intermediate" appended.
	Intermediate bool
	// ClusterCAs lets the signing CA sign cluster CAs (SignClusterCA):
	// every path length one more, so a root of path length 1, or with
	// Intermediate a root of 2 and an intermediate of 1.
	ClusterCAs bool
	// Force overwrites existing files; without it InitCADir refuses,
	// before writing anything, if any of them exists.
	Force bool
	Now   func() time.Time
	Rand  io.Reader
}

// CADirFiles lists the files of a directory with opts' layout.
func CADirFiles(opts CADirOptions) []string {
	files := []string{CADirCert, CADirKey, CADirBundle}
	if opts.Intermediate {
		files = append(files, CADirRootCert, CADirRootKey)
	}
	return files
}

// InitCADir creates a CA directory: dir (0700, it holds the CA key), the
// signing CA, the root when there is an intermediate, and the trust
// bundle. It returns the signing CA and the root (the same CA without an
// intermediate). A refusal to overwrite wraps fs.ErrExist and leaves no
// half-made CA behind.
func InitCADir(dir string, opts CADirOptions) (signing, root *CA, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, nil, fmt.Errorf("create CA directory: %w", err)
	}
	path := func(name string) string { return filepath.Join(dir, name) }
	if !opts.Force {
		for _, f := range CADirFiles(opts) {
			if _, err := os.Lstat(path(f)); err == nil {
				return nil, nil, fmt.Errorf("%s: %w (refusing to overwrite)", path(f), fs.ErrExist)
			}
		}
	}
	caOpts := CAOptions{CommonName: opts.CommonName, Lifetime: opts.Lifetime, Now: opts.Now, Rand: opts.Rand}
	// The intermediate's path length, if any.
	interPathLen := 0
	if opts.ClusterCAs {
		caOpts.PathLen, interPathLen = 1, 1
	}
	if opts.Intermediate {
		caOpts.PathLen = interPathLen + 1
		caOpts.CommonName = opts.CommonName + " root"
	}
	root, err = NewCA(caOpts)
	if err != nil {
		return nil, nil, err
	}
	signing = root
	if opts.Intermediate {
		signing, err = root.NewIntermediate(CAOptions{CommonName: opts.CommonName + " intermediate", PathLen: interPathLen})
		if err != nil {
			return nil, nil, err
		}
	}
	write := func(c *CA, certFile, keyFile string) error {
		if opts.Force {
			return c.ReplaceFiles(certFile, keyFile)
		}
		return c.WriteFiles(certFile, keyFile)
	}
	if opts.Intermediate {
		if err := write(root, path(CADirRootCert), path(CADirRootKey)); err != nil {
			return nil, nil, err
		}
	}
	if err := write(signing, path(CADirCert), path(CADirKey)); err != nil {
		return nil, nil, err
	}
	if err := WriteCertificatesFile(path(CADirBundle), root.BundlePEM(), opts.Force); err != nil {
		return nil, nil, err
	}
	return signing, root, nil
}

// LoadCADir loads the signing CA of a directory made by InitCADir, with
// its root from bundle.crt when the directory has one (directories made
// before bundle.crt existed hold a root CA in ca.crt alone).
func LoadCADir(dir string, opts CAOptions) (*CA, error) {
	certFile, keyFile, bundleFile := filepath.Join(dir, CADirCert), filepath.Join(dir, CADirKey), filepath.Join(dir, CADirBundle)
	if _, err := os.Stat(bundleFile); errors.Is(err, fs.ErrNotExist) {
		return LoadCAWithOptions(certFile, keyFile, opts)
	}
	return LoadCAChain(certFile, keyFile, bundleFile, opts)
}

// CADirTrustAnchors is the trust bundle file of a CA directory:
// bundle.crt, or ca.crt for a directory made before bundle.crt existed.
func CADirTrustAnchors(dir string) string {
	if _, err := os.Stat(filepath.Join(dir, CADirBundle)); errors.Is(err, fs.ErrNotExist) {
		return filepath.Join(dir, CADirCert)
	}
	return filepath.Join(dir, CADirBundle)
}

// PEMSource is PEM content and the name it came from, for messages.
type PEMSource struct {
	Name string
	PEM  []byte
}

// BuildTrustBundle concatenates the CA certificates of sources in order,
// without duplicates: the trust bundle of a CA rotation (the new CA, then
// the old ones). Every certificate must be a CA.
func BuildTrustBundle(sources []PEMSource) ([]*x509.Certificate, []byte, error) {
	var certs []*x509.Certificate
	var bundle []byte
	seen := map[string]bool{}
	for _, src := range sources {
		cs, err := ParseCertificatesPEM(src.PEM)
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", src.Name, err)
		}
		for _, c := range cs {
			fp := Fingerprint(c)
			if !c.BasicConstraintsValid || !c.IsCA {
				return nil, nil, fmt.Errorf("%s: %s (%s) is not a CA certificate", src.Name, c.Subject.CommonName, fp)
			}
			if seen[fp] {
				continue
			}
			seen[fp] = true
			certs = append(certs, c)
			bundle = append(bundle, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})...)
		}
	}
	return certs, bundle, nil
}
