package agent

import (
	"context"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/tokenbroker/tokenbroker/agent/client"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// The files of an identity directory, named like the keys of a
// kubernetes.io/tls Secret so that the directory can be a mounted Secret.
const (
	CertFile   = "tls.crt"
	KeyFile    = "tls.key"
	BundleFile = "ca.crt"
)

// IdentityDir is a directory holding a client certificate, its key and the
// trust bundle.
type IdentityDir string

// Cert, Key and Bundle return the paths of the identity's files.
func (d IdentityDir) Cert() string   { return filepath.Join(string(d), CertFile) }
func (d IdentityDir) Key() string    { return filepath.Join(string(d), KeyFile) }
func (d IdentityDir) Bundle() string { return filepath.Join(string(d), BundleFile) }

// EnrollOptions configure Enroll.
type EnrollOptions struct {
	// BrokerURL is the broker's enrollment listener, e.g. https://east.example.com:8444.
	BrokerURL string
	// Fingerprint pins the CA ("sha256:<hex>") when Bundle is empty.
	Fingerprint string
	// Bundle is a trust bundle the caller already trusts; if empty it is
	// fetched from the broker and checked against Fingerprint.
	Bundle []byte
	// Token is the join token.
	Token string
	// Dir receives tls.crt, tls.key (0600) and ca.crt.
	Dir IdentityDir
}

// Enroll makes a key pair, sends a CSR for the join token's identity with
// the token, and writes the certificate, the key and the trust bundle to
// opts.Dir. The private key never leaves this process except into
// opts.Dir. Nothing is written if enrollment fails.
func Enroll(ctx context.Context, opts EnrollOptions) (*apiv1.CertificateResponse, error) {
	identity, err := joinTokenSubject(opts.Token)
	if err != nil {
		return nil, err
	}
	bundle := opts.Bundle
	if len(bundle) == 0 {
		if bundle, err = client.FetchTrustBundle(ctx, opts.BrokerURL, opts.Fingerprint); err != nil {
			return nil, fmt.Errorf("fetch trust bundle: %w", err)
		}
	}
	roots, err := certPool(bundle)
	if err != nil {
		return nil, err
	}
	c, err := client.New(client.Config{URL: opts.BrokerURL, RootCAs: roots})
	if err != nil {
		return nil, err
	}
	csrPEM, keyPEM, err := pki.NewCSR(identity, rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("make CSR: %w", err)
	}
	resp, err := c.Enroll(ctx, opts.Token, csrPEM)
	if err != nil {
		return nil, fmt.Errorf("enroll: %w", err)
	}
	if err := writeIdentity(opts.Dir, resp, keyPEM); err != nil {
		return nil, err
	}
	return resp, nil
}

// Renew asks the broker, through c (which authenticates with the current
// certificate in dir), for a new certificate with a new key for the same
// identity, and replaces the files in dir. The old files stay if anything
// fails.
func Renew(ctx context.Context, c *client.Client, dir IdentityDir) (*apiv1.CertificateResponse, error) {
	data, err := os.ReadFile(dir.Cert())
	if err != nil {
		return nil, fmt.Errorf("read current certificate: %w", err)
	}
	certs, err := pki.ParseCertificatesPEM(data)
	if err != nil {
		return nil, fmt.Errorf("current certificate: %w", err)
	}
	identity, err := pki.IdentityFromCert(certs[0])
	if err != nil {
		return nil, fmt.Errorf("current certificate: %w", err)
	}
	csrPEM, keyPEM, err := pki.NewCSR(identity, rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("make CSR: %w", err)
	}
	resp, err := c.Renew(ctx, csrPEM)
	if err != nil {
		return nil, fmt.Errorf("renew: %w", err)
	}
	if err := writeIdentity(dir, resp, keyPEM); err != nil {
		return nil, err
	}
	// New connections must present the new certificate.
	c.CloseIdleConnections()
	return resp, nil
}

func writeIdentity(dir IdentityDir, resp *apiv1.CertificateResponse, keyPEM []byte) error {
	certs, err := pki.ParseCertificatesPEM([]byte(resp.Certificate))
	if err != nil {
		return fmt.Errorf("issued certificate: %w", err)
	}
	if _, err := certPool([]byte(resp.CABundle)); err != nil {
		return fmt.Errorf("issued trust bundle: %w", err)
	}
	if err := os.MkdirAll(string(dir), 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	kp := &pki.KeyPair{Cert: certs[0], CertPEM: []byte(resp.Certificate), KeyPEM: keyPEM}
	if err := kp.WriteFiles(dir.Cert(), dir.Key()); err != nil {
		return fmt.Errorf("write certificate and key: %w", err)
	}
	if err := writeFileAtomic(dir.Bundle(), []byte(resp.CABundle), 0o644); err != nil {
		return fmt.Errorf("write trust bundle: %w", err)
	}
	return nil
}

func certPool(bundle []byte) (*x509.CertPool, error) {
	certs, err := pki.ParseCertificatesPEM(bundle)
	if err != nil {
		return nil, fmt.Errorf("trust bundle: %w", err)
	}
	pool := x509.NewCertPool()
	for _, c := range certs {
		pool.AddCert(c)
	}
	return pool, nil
}

// joinTokenSubject reads the sub claim of a join token without verifying
// it: the broker verifies the token; the client only needs to know which
// identity to put in its CSR.
func joinTokenSubject(token string) (string, error) {
	token = strings.TrimSpace(token)
	parts := strings.Split(token, ".")
	if len(parts) != 3 || len(token) > pki.MaxJoinTokenBytes {
		return "", errors.New("the join token is not a JWT")
	}
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return "", errors.New("the join token is not a JWT")
	}
	var claims struct {
		Sub string `json:"sub"`
	}
	if err := json.Unmarshal(raw, &claims); err != nil || claims.Sub == "" {
		return "", errors.New("the join token names no identity (sub)")
	}
	if _, _, err := pki.ParseIdentity(claims.Sub); err != nil {
		return "", fmt.Errorf("the join token's subject: %w", err)
	}
	return claims.Sub, nil
}

// writeFileAtomic writes data to name through a temporary file in the same
// directory, fsync and rename, so a reader sees the old or the new file,
// never a partial one.
func writeFileAtomic(name string, data []byte, mode os.FileMode) (err error) {
	f, err := os.CreateTemp(filepath.Dir(name), "."+filepath.Base(name)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			_ = os.Remove(f.Name())
		}
	}()
	if err = f.Chmod(mode); err != nil {
		f.Close()
		return err
	}
	if _, err = f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err = f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), name)
}
